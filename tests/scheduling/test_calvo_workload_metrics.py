"""Workload generator (local documents, shared contexts, Poisson arrivals, SLOs) and metrics."""
import numpy as np
import pytest

from jkv.kvpool.hashing import ChunkNamespace, chunk_keys
from jkv.scheduling.metrics import summarize
from jkv.scheduling.workload import (WorkloadConfig, build_workload, load_local_documents,
                                     with_deadlines, word_tokenize)

DOCS = [("a", "The quick brown fox jumps over the lazy dog. " * 200),
        ("b", "Permission is hereby granted, free of charge, to any person. " * 200)]


def small_config(**kw):
    base = dict(qps=2.0, num_contexts=3, queries_per_context=5, min_context_tokens=300,
                max_context_tokens=1200, min_query_tokens=10, max_query_tokens=30,
                chunk_tokens=64, seed=7)
    return WorkloadConfig(**{**base, **kw})


def test_deterministic_given_seed_and_varies_with_it():
    a = build_workload(small_config(), documents=DOCS)
    b = build_workload(small_config(), documents=DOCS)
    c = build_workload(small_config(seed=8), documents=DOCS)
    assert all(np.array_equal(x.tokens(), y.tokens()) and x.arrival_s == y.arrival_s
               for x, y in zip(a, b))
    assert any(x.arrival_s != y.arrival_s for x, y in zip(a, c))


def test_many_queries_share_each_context():
    config = small_config()
    requests = build_workload(config, documents=DOCS)
    assert len(requests) == 15
    ns = ChunkNamespace("m", "float16", config.chunk_tokens)
    for cid in range(3):
        group = [r for r in requests if r.context_id == cid]
        assert len(group) == 5
        keys = [chunk_keys(r.tokens(), ns, max_chunks=r.cached_tokens // 64) for r in group]
        assert all(k == keys[0] for k in keys)             # same pool prefix for all its queries
        assert len({r.query.tobytes() for r in group}) > 1  # but different questions
    for r in requests:
        assert 300 <= len(r.context) <= 1200 and 10 <= len(r.query) <= 30
        assert r.cached_tokens == len(r.context) // 64 * 64   # hit ratio 1.0: whole chunks
        assert r.compute_tokens == r.prompt_tokens - r.cached_tokens
        assert r.slo_factor in (2.0, 4.0, 8.0)


def test_hit_ratios_set_the_cached_fraction():
    requests = build_workload(small_config(hit_ratios=(0.25, 0.5), num_contexts=4,
                                           queries_per_context=20), documents=DOCS)
    for r in requests:
        assert r.cached_tokens % 64 == 0
        assert r.cached_tokens in (int(0.25 * len(r.context)) // 64 * 64,
                                   int(0.5 * len(r.context)) // 64 * 64)
    assert len({r.cached_tokens / len(r.context) > 0.4 for r in requests}) == 2


def test_poisson_arrivals_match_qps():
    requests = build_workload(small_config(qps=5.0, num_contexts=20, queries_per_context=50),
                              documents=DOCS)
    arrivals = np.array([r.arrival_s for r in requests])
    assert arrivals[0] == 0.0 and (np.diff(arrivals) >= 0).all()
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(0.2, rel=0.08)
    assert gaps.std() == pytest.approx(0.2, rel=0.15)     # exponential: std == mean


def test_deadlines_scale_isolated_ttft():
    requests = build_workload(small_config(), documents=DOCS)
    infos = with_deadlines(requests, lambda r: 0.001 * r.prompt_tokens)
    for r, info in zip(requests, infos):
        assert info.deadline_s == pytest.approx(r.arrival_s + r.slo_factor * 0.001 * r.prompt_tokens)
        assert (info.cached_tokens, info.compute_tokens) == (r.cached_tokens, r.compute_tokens)


def test_local_documents_exist_and_fall_back_to_stdlib():
    assert load_local_documents()                       # license texts or stdlib docstrings
    docs = load_local_documents(roots=["/nonexistent-dir"])
    assert docs and all(name.endswith(".py") for name, _ in docs)
    assert word_tokenize("Hello, world").tolist() == word_tokenize("Hello, world").tolist()
    assert len(word_tokenize("Hello, world")) == 3


@pytest.mark.parametrize("kw, match", [(dict(qps=0), "qps"), (dict(hit_ratios=(1.5,)), "hit_ratios"),
                                       (dict(min_context_tokens=10, max_context_tokens=5), "context"),
                                       (dict(slo_factors=()), "slo_factors")])
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        small_config(**kw)


def test_summary_statistics_and_slo_attainment():
    ttft = np.arange(1, 101, dtype=float)                 # 1..100 s
    summary = summarize(ttft, slo_s=np.full(100, 25.0))
    assert summary.count == 100 and summary.mean_s == 50.5
    assert summary.p50_s == pytest.approx(50.5) and summary.p99_s == pytest.approx(99.01)
    assert summary.slo_attainment == 0.25
    assert summarize([1.0]).slo_attainment is None
    with pytest.raises(ValueError, match="match"):
        summarize([1.0, 2.0], slo_s=[1.0])
    with pytest.raises(ValueError, match="non-empty"):
        summarize([])
