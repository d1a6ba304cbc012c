"""Sparse decode through the host pool against the fully jitted dense decode (tiny models)."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from tests.selection.tiny import shared_tiny_model

from jkv.selection import get_selector
from jkv.selection.calibration import collect_calibration
from jkv.selection.simple import Dense
from jkv.selection.sparse_decode import decode, gather_rows, generate_sparse, prefill_to_host

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return shared_tiny_model()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(3, 301, size=n)) for n in (37, 21)]


@pytest.fixture(scope="module")
def calibration(model):
    rng = np.random.default_rng(1)
    return collect_calibration(model, list(rng.integers(3, 301, size=48)), 40, 8)


def dense_reference(model, prompts, max_tokens):
    """Greedy tokens from model.prefill + model.decode_step (the jitted dense path)."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    logits, kv = model.prefill(jnp.asarray(tokens), jnp.asarray(lengths))
    cache = model.cache_from_prefill(kv, int(lengths.max()) + max_tokens)
    out = [np.asarray(logits).argmax(-1)]
    positions = lengths.copy()
    for _ in range(max_tokens - 1):
        logits, cache = model.decode_step(cache, jnp.asarray(out[-1], jnp.int32), jnp.asarray(positions))
        out.append(np.asarray(logits).argmax(-1))
        positions += 1
    return np.stack(out, axis=1)


def all_selectors(model, calibration, ratio, **infinigen):
    cfg = model.cfg
    projection = np.random.default_rng(0).normal(size=(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256))
    return {
        "dense": Dense(),
        "oracle": get_selector("oracle", max_ratio=ratio),
        "quest": get_selector("quest", max_ratio=ratio),
        "hata": get_selector("hata", max_ratio=ratio, projection=projection),
        "infinigen": get_selector("infinigen", max_ratio=ratio, calibration=calibration, **infinigen),
        "streamingllm": get_selector("streamingllm", max_ratio=ratio),
        "sequential": get_selector("sequential", max_ratio=ratio),
        "random": get_selector("random", max_ratio=ratio),
    }


def test_full_ratio_sparse_decode_equals_dense_decode(model, prompts, calibration):
    expected = dense_reference(model, prompts, MAX_TOKENS)
    # alpha = inf: InfiniGen's score threshold would otherwise drop tokens even at ratio 1.
    np.testing.assert_array_equal(generate_sparse(model, prompts, Dense(), MAX_TOKENS).tokens, expected)
    host = prefill_to_host(model, prompts, 37 + MAX_TOKENS)  # one prefill, every selector decodes from it
    for name, selector in all_selectors(model, calibration, 1.0, alpha=math.inf).items():
        result = decode(model, host, selector, MAX_TOKENS)
        np.testing.assert_array_equal(result.tokens, expected, err_msg=name)
        assert len(result.steps) == MAX_TOKENS - 1
        assert all(s.kv_fraction == pytest.approx(1.0) for s in result.steps), name


def test_low_ratio_uses_a_fraction_of_the_kv_and_stays_close(model, prompts, calibration):
    host = prefill_to_host(model, prompts, 37 + MAX_TOKENS)
    dense = decode(model, host, Dense(), MAX_TOKENS, keep_logits=True)
    for name, selector in all_selectors(model, calibration, 0.2).items():
        result = decode(model, host, selector, MAX_TOKENS, keep_logits=True)
        if name == "dense":
            continue
        sparse = result.mean("sparse_kv_fraction")
        # Quest rounds up to whole pages and always adds the newest one: a few pages at <= 43 tokens.
        limit = 0.75 if name == "quest" else 0.26
        assert 0 < sparse <= limit, (name, sparse)
        assert result.mean("kv_fraction") > sparse  # the dense layers 0, 1 count in full
        assert result.logits.shape == dense.logits.shape
        np.testing.assert_array_equal(result.logits[:, 0], dense.logits[:, 0])  # prefill logits shared


def test_teacher_forcing_feeds_the_given_tokens(model, prompts):
    host = prefill_to_host(model, prompts, 37 + MAX_TOKENS)
    forced = np.asarray([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], np.int32)
    result = decode(model, host, Dense(), MAX_TOKENS, forced_tokens=forced, keep_logits=True)
    np.testing.assert_array_equal(result.tokens[:, :5], forced)
    assert result.logits.shape == (2, MAX_TOKENS, model.cfg.vocab_size)


def test_gather_rows_and_bad_inputs(model, prompts):
    pool = np.arange(2 * 2 * 5 * 1, dtype=np.float32).reshape(2, 2, 5, 1)
    index = np.asarray([[4, 0, -1], [1, -1, -1], [2, 3, 4], [0, -1, -1]], np.int32)
    np.testing.assert_array_equal(gather_rows(pool, index)[..., 0],
                                  [[[4, 0, 0], [6, 5, 5]], [[12, 13, 14], [15, 15, 15]]])
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        generate_sparse(model, prompts, Dense(), 0)
    with pytest.raises(ValueError, match="capacity"):
        decode(model, prefill_to_host(model, prompts, 37), Dense(), 3)
    with pytest.raises(ValueError, match="non-empty"):
        prefill_to_host(model, [[]], 4)


def test_calibration_shapes(model, calibration):
    cfg = model.cfg
    assert len(calibration.queries) == cfg.num_layers
    assert calibration.queries[2].shape == (8, cfg.num_heads, cfg.head_dim)
    np.testing.assert_array_equal(calibration.query_positions, np.arange(40, 48))
    assert calibration.keys[1].shape == (48, cfg.num_kv_heads, cfg.head_dim)
