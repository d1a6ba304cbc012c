"""The budget floor (issue 23, defect 1): k = min(N, max(ceil(max_ratio * N), min_budget)), and rows
of requests with N <= min_budget attend to every token, for every selector and sparse path."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.disagg.config import Disaggregation
from jkv.selection import get_selector, selection_budget
from jkv.selection.base import DEFAULT_MIN_BUDGET, SelectorConfig
from jkv.selection.sparse_decode import decode, prefill_to_host
from jkv.serving.config import ServeConfig, config_from_flags, read_config_file
from tests.selection.test_sparse_decode import (MAX_TOKENS, all_selectors, calibration, dense_reference,  # noqa: F401
                                                model, prompts)


@pytest.mark.parametrize("n,ratio,floor,expected", [
    (6, 0.2, 0, 2), (6, 0.2, 256, 6), (256, 0.2, 256, 256), (257, 0.2, 256, 256), (1000, 0.2, 256, 256),
    (1280, 0.2, 256, 256), (1281, 0.2, 256, 257), (2048, 0.2, 256, 410), (10, 0.2, 4, 4), (30, 0.1, 1, 3)])
def test_budget_floor(n, ratio, floor, expected):
    assert selection_budget(n, ratio, floor) == expected
    assert int(selection_budget(jnp.asarray([n]), ratio, floor)[0]) == expected
    assert SelectorConfig(max_ratio=ratio, min_budget=floor).budget(n) == expected


def test_sparse_decode_below_the_floor_is_dense_decode(model, prompts, calibration):  # noqa: F811
    """Prompts of 37 and 21 tokens under a floor of 64: every selector at ratio 0.2 (which alone
    keeps 8 and 5 tokens) decodes exactly the dense tokens and reads every cached entry."""
    expected = dense_reference(model, prompts, MAX_TOKENS)
    host = prefill_to_host(model, prompts, 37 + MAX_TOKENS)
    for name, selector in all_selectors(model, calibration, 0.2).items():
        if name == "dense":
            continue
        bare = decode(model, host, selector, MAX_TOKENS)
        assert bare.mean("sparse_kv_fraction") < 0.8, name  # without the floor it is sparse
        floored = decode(model, host, selector.with_min_budget(64), MAX_TOKENS)
        np.testing.assert_array_equal(floored.tokens, expected, err_msg=name)
        assert all(s.kv_fraction == pytest.approx(1.0) for s in floored.steps), name


def test_rows_past_the_floor_keep_at_least_min_budget_tokens(model, prompts, calibration):  # noqa: F811
    """A batch of a 37- and a 21-token request under a floor of 24: the short one is dense, in
    position order; every row of the long one holds at least 24 tokens (its 20 % would be 8; Quest
    rounds to pages)."""
    cfg = model.cfg
    capacity = 64
    rng = np.random.default_rng(3)
    K = jnp.asarray(rng.normal(size=(2, cfg.num_kv_heads, capacity, cfg.head_dim)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(2, cfg.num_heads, cfg.head_dim)).astype(np.float32))
    lengths = jnp.asarray([37, 21], jnp.int32)
    H = cfg.num_kv_heads
    for name, selector in all_selectors(model, calibration, 0.2).items():
        if name == "dense":
            continue
        selector = selector.with_min_budget(24)
        index = np.asarray(selector.select(3, q, selector.prepare(3, K, lengths), lengths))
        counts = (index >= 0).sum(axis=1)
        # Quest budgets whole pages: its partly filled newest page counts as a full one.
        floor = 24 - (selector.config.page_size - 1 if name == "quest" else 0)
        assert (counts[:H] >= floor).all() and (counts[:H] <= 37).all(), (name, counts)
        for row in index[:H]:
            valid = row[row >= 0]
            assert len(set(valid.tolist())) == len(valid) and valid.max() < 37, name
        for row in index[H:]:  # the short request: every token, in order, then -1
            np.testing.assert_array_equal(row[:21], np.arange(21), err_msg=name)
            assert (row[21:] == -1).all(), name


def test_with_min_budget_keeps_fitted_state_and_leaves_the_original(model, calibration):  # noqa: F811
    sel = get_selector("infinigen", calibration=calibration)
    floored = sel.with_min_budget(128)
    assert floored.config.min_budget == 128 and sel.config.min_budget == 0
    assert floored.skew is sel.skew and floored.with_min_budget(128) is floored
    assert dataclasses.replace(floored.config, min_budget=0) == sel.config
    with pytest.raises(ValueError, match="min_budget=-1 must be an int >= 0"):
        sel.with_min_budget(-1)
    with pytest.raises(ValueError, match="min_budget"):
        get_selector("quest", min_budget=1.5)


def test_engines_default_to_the_floor_and_plumb_it(tmp_path):
    assert Disaggregation().min_budget == DEFAULT_MIN_BUDGET == 256
    assert ServeConfig().disagg.min_budget == DEFAULT_MIN_BUDGET
    assert config_from_flags(dict(disaggregation="smartgen", strategy="sequential", min_budget=32)
                             ).disagg.min_budget == 32
    path = tmp_path / "serve.yaml"
    path.write_text("min-budget: 0\n")
    assert read_config_file(path) == {"min_budget": 0}
    with pytest.raises(ValueError, match="min_budget=-3"):
        Disaggregation(min_budget=-3)
    with pytest.raises(ValueError, match=r"Disaggregation\(min_budget=...\)"):
        Disaggregation(selector_options=dict(min_budget=0))
