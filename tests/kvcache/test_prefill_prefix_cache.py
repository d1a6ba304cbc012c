"""`PrefillPrefixCache` bookkeeping (jkv/disagg/prefill_cache.py) under random reuse patterns on a
tiny budget: batches of requests that share prefixes (several plans open at once), abandoned
prefills (cancelled or failed: `release`), eviction under pressure. A row's context is always
the KV of exactly its own leading tokens, and no page leaks."""
import numpy as np
import pytest

from jkv.disagg.prefill_cache import PrefillPrefixCache
from models import tiny_model

P = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0)


def fake_kv(cfg, tokens) -> np.ndarray:
    """f32[2, L, H_kv, N, D] whose row i depends on every token up to i (like real KV)."""
    n = len(tokens)
    prefix_sums = np.cumsum(np.asarray(tokens, np.float64) * (1 + np.arange(n)))  # order-dependent
    base = (prefix_sums % 1000.0).astype(np.float32)
    kv = np.empty((2, cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim), np.float32)
    for kind in range(2):
        for layer in range(cfg.num_layers):
            kv[kind, layer] = base[None, :, None] + 1000 * (kind * cfg.num_layers + layer)
    return kv


@pytest.mark.parametrize("seed", range(6))
def test_random_reuse_on_a_tiny_budget_gives_exact_context_and_leaks_nothing(model, seed):
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    cache = PrefillPrefixCache(model, budget_tokens=6 * P)  # 6 pages: constant eviction
    stems = [rng.integers(3, 300, 5 * P).tolist() for _ in range(3)]
    hits = 0
    for _ in range(25):
        batch = []
        for _ in range(int(rng.integers(1, 4))):  # requests of one batch share stems: plans open at once
            stem = stems[int(rng.integers(len(stems)))]
            cut = int(rng.integers(1, len(stem)))
            batch.append(stem[:cut] + rng.integers(3, 300, int(rng.integers(1, 40))).tolist())
        plans = [cache.plan(tokens) for tokens in batch]
        width = max(len(t) for t in batch)
        for layer in range(cfg.num_layers):
            K, V = cache.context(plans, layer, width)
            for b, (tokens, plan) in enumerate(zip(batch, plans)):
                assert plan.start % P == 0 and plan.start < len(tokens)
                ref = fake_kv(cfg, tokens)[:, layer, :, :plan.start]
                np.testing.assert_array_equal(K[b, :, :plan.start], ref[0])
                np.testing.assert_array_equal(V[b, :, :plan.start], ref[1])
                assert not K[b, :, plan.start:].any()
                cache.store_layer(plan, layer, fake_kv(cfg, tokens)[:, layer])
        hits += sum(p.start for p in plans)
        for plan in plans:
            if rng.random() < 0.2:  # cancelled or failed mid-prefill: nothing it computed is cached
                cache.release(plan)
            else:
                cache.commit(plan)
            cache.release(plan)  # idempotent after either
        cache.allocator.check()
        assert cache.allocator.num_used == 0  # a plan holds pages only during its prefill
    assert hits > 0 and cache.allocator.evictions > 0  # the pattern really reused and evicted
    s = cache.stats()
    assert s["prefill_prefix_hit_tokens"] == hits and s["prefill_prefix_pages_in_use"] == 0


def test_full_budget_computes_whole_and_a_released_plan_caches_nothing(model):
    cache = PrefillPrefixCache(model, budget_tokens=2 * P)
    a = list(range(3, 3 + 3 * P + 5))
    plan = cache.plan(a)  # 3 full pages, only 2 in the budget: computed, nothing cached
    assert plan.new == [] and plan.start == 0
    cache.commit(plan)
    assert cache.allocator.num_cached == 0
    b = a[:2 * P + 1]
    plan = cache.plan(b)
    assert len(plan.new) == 2
    cache.release(plan)  # abandoned: its pages were never published
    again = cache.plan(b)
    assert again.start == 0 and cache.allocator.num_cached == 0
    cache.release(again)
    cache.allocator.check()
    assert cache.allocator.num_used == 0
    with pytest.raises(ValueError, match="budget_tokens"):
        PrefillPrefixCache(model, budget_tokens=P - 1)
