"""The prose+code calibration mix (issue 23): its token spans, the stdlib code split, InfiniGen's
skew pooled over several calibration windows, and `jkv train-hata --calibration`."""
import argparse

import numpy as np
import pytest

from tests.selection.tiny import shared_tiny_model

from jkv.corpus import code_text, stdlib_sources
from jkv.selection import get_selector
from jkv.selection.calibration import MIX_STEPS, MIX_WINDOWS, collect_calibration, joint_windows, mix_spans
from jkv.selection.hata_train import add_parser
from jkv.selection.infinigen import InfiniGenConfig, fit_skew


def test_mix_spans_are_disjoint_consecutive_per_source_and_in_window_order():
    sources = {"corpus": list(range(1000)), "code": list(range(5000, 6000))}
    windows = (("code", 100), ("corpus", 50), ("code", 200), ("corpus", 20))
    spans = mix_spans(sources, windows, steps=10)
    assert [len(s) for s in spans] == [110, 60, 210, 30]
    assert spans[0] == list(range(5000, 5110)) and spans[2] == list(range(5110, 5320))
    assert spans[1] == list(range(0, 60)) and spans[3] == list(range(60, 90))
    with pytest.raises(ValueError, match="'code' has 1000 tokens < 1330"):
        mix_spans(sources, windows + (("code", 1000),), steps=10)
    with pytest.raises(ValueError, match="'prose' is not one of"):
        mix_spans(sources, (("prose", 10),), steps=1)


def test_default_mix_is_prose_and_code_at_1k_and_2k_with_as_many_queries_as_train_hata():
    assert {name for name, _ in MIX_WINDOWS} == {"corpus", "code"}
    assert {n for _, n in MIX_WINDOWS} == {1024, 2048}
    assert len(MIX_WINDOWS) * MIX_STEPS >= 4 * 192  # `jkv train-hata`'s 4 corpus windows of 192 queries
    assert MIX_WINDOWS[-1] == ("corpus", 2048)  # trained in turn: ends on prose at the longest length


def test_code_text_halves_are_the_two_halves_of_the_stdlib_files():
    files = stdlib_sources()
    first, second = code_text("calibration"), code_text("eval")
    with open(files[0], encoding="utf-8", errors="replace") as f:
        assert first.startswith(f.read())
    with open(files[len(files) // 2], encoding="utf-8", errors="replace") as f:
        assert second.startswith(f.read())
    with open(files[-1], encoding="utf-8", errors="replace") as f:
        last = f.read()
    assert second.endswith(last) and last not in first
    with pytest.raises(ValueError, match="split='train' must be"):
        code_text("train")


def test_infinigen_pools_a_list_of_calibration_windows_per_layer():
    model = shared_tiny_model()
    rng = np.random.default_rng(3)
    a = collect_calibration(model, list(rng.integers(3, 301, size=40)), 32, 8)
    b = collect_calibration(model, list(rng.integers(3, 301, size=60)), 48, 12)
    config = InfiniGenConfig()
    pooled = get_selector("infinigen", calibration=[a, b])
    for layer in range(model.cfg.num_layers):
        expected = fit_skew(np.concatenate([a.queries[layer], b.queries[layer]]),
                            np.concatenate([a.keys[layer], b.keys[layer]]), config.partial_ratio)
        np.testing.assert_array_equal(np.asarray(pooled.layer_state(layer)), expected)
    single = get_selector("infinigen", calibration=a)
    np.testing.assert_array_equal(np.asarray(get_selector("infinigen", calibration=[a]).layer_state(2)),
                                  np.asarray(single.layer_state(2)))
    # Pooling changes the fit: the mix is not just its first window.
    assert not np.array_equal(np.asarray(pooled.layer_state(2)), np.asarray(single.layer_state(2)))
    with pytest.raises(ValueError, match="empty list"):
        get_selector("infinigen", calibration=[])


def test_train_hata_calibration_flag():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    # joint is the default (docs/selection.md, 'Fourth run'): served HATA weights come from it.
    assert parser.parse_args(["train-hata", "--out", "/tmp/x"]).calibration == "joint"
    assert parser.parse_args(["train-hata", "--out", "/tmp/x", "--calibration", "corpus"]).calibration == "corpus"
    assert parser.parse_args(["train-hata", "--out", "/tmp/x", "--calibration", "mix"]).calibration == "mix"
    assert parser.parse_args(["train-hata", "--out", "/tmp/x", "--calibration", "joint"]).calibration == "joint"
    with pytest.raises(SystemExit):
        parser.parse_args(["train-hata", "--out", "/tmp/x", "--calibration", "licences"])


def test_joint_windows_alternate_corpus_and_broad_without_the_duplicate_corpus_1k_window():
    corpus = ["c0", "c1", "c2", "c3"]
    broad = [f"{name}{n}" for name, n in MIX_WINDOWS]  # code1024, corpus1024, code2048, corpus2048
    assert joint_windows(corpus, broad) == ["c0", "code1024", "c1", "code2048", "c2", "corpus2048", "c3"]
    assert joint_windows(["c0"], broad) == ["c0", "code1024", "code2048", "corpus2048"]
    with pytest.raises(ValueError, match="broad has 3 windows"):
        joint_windows(corpus, broad[:3])


def test_fit_skew_matches_the_full_svd_for_few_and_many_query_rows():
    # The reduced SVD (many rows) must give the same rotation as the full one; with fewer rows
    # than the head dimension only the full SVD has all D right singular vectors.
    rng = np.random.default_rng(6)
    head_dim, partial_ratio = 16, 0.5
    for rows in (3, 200):
        queries = rng.normal(size=(rows, 2, head_dim)) * np.linspace(0.2, 2.0, head_dim)
        keys = rng.normal(size=(50, 1, head_dim))
        q = queries.reshape(-1, head_dim)
        rotation = np.linalg.svd(q, full_matrices=True)[2].T
        importance = np.abs(q @ rotation).mean(0) * np.abs(keys[:, 0] @ rotation).mean(0)
        channels = np.sort(np.argsort(-importance, kind="stable")[:8])
        np.testing.assert_allclose(fit_skew(queries, keys, partial_ratio)[0], rotation[:, channels], atol=1e-6)
