"""Prefix caching bookkeeping (pure Python plus the cache's host tables): cached pages in the
allocator (states, LRU eviction only under pressure, the eviction hook, duplicate keys, clearing),
the chained page keys (the kvpool scheme), `PagedKVCache.reserve_prefix` / `commit_pages`, and a
property test that random reuse never hands a request a page whose content is not its own tokens'
and never leaks a page."""
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kvcache import OutOfPages, PageAllocator, PageConfig, PagedKVCache
from jkv.kvcache.prefix import extend_page_keys, shareable_pages
from jkv.kvpool.hashing import ChunkNamespace, chunk_keys
from models import tiny_config

P = 4
NS = ChunkNamespace("tiny@0123", "float32", P)


def test_a_released_cached_page_is_kept_and_matched_back_not_freed():
    alloc = PageAllocator(5)
    a, b = alloc.allocate(2)
    assert alloc.cache_page(a, "k0")
    assert alloc.decref([a, b]) == [a, b]
    assert (alloc.num_free, alloc.num_used, alloc.num_cached, alloc.num_evictable) == (4, 0, 1, 1)
    assert alloc.match(["k0", "k1"]) == [a]  # stops at the first key that is not cached
    assert alloc.refcount(a) == 1 and alloc.num_evictable == 0 and alloc.num_used == 1
    assert alloc.match(["k0"]) == [a] and alloc.refcount(a) == 2  # shared by two holders
    assert alloc.match(["k1", "k0"]) == []  # a leading miss matches nothing
    alloc.check()


def test_eviction_happens_only_when_the_free_list_is_empty_least_recently_used_first():
    evicted = []
    alloc = PageAllocator(5, on_evict=evicted.extend)
    pages = alloc.allocate(4)
    for i, p in enumerate(pages):
        assert alloc.cache_page(p, f"k{i}")
    alloc.decref([pages[2]])
    alloc.decref([pages[0]])
    alloc.decref([pages[1]])  # LRU order now: k2, k0, k1
    alloc.match(["k0"])  # a hit refreshes nothing but takes k0 out of the LRU
    alloc.decref([pages[0]])  # back in, most recent: k2, k1, k0
    assert evicted == [] and alloc.num_free == 3
    assert alloc.allocate(2) == [pages[2], pages[1]] and evicted == [(pages[2], "k2"), (pages[1], "k1")]
    assert alloc.evictions == 2 and alloc.key_of(pages[2]) is None and alloc.match(["k2"]) == []
    assert alloc.match(["k0"]) == [pages[0]]  # not evicted
    with pytest.raises(OutOfPages):
        alloc.allocate(1)  # k0 is held again, k3 is held: nothing to evict
    assert alloc.evictions == 2
    alloc.check()


def test_a_key_cached_twice_keeps_the_first_page_and_the_second_is_freed_normally():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    assert alloc.cache_page(a, "k") and not alloc.cache_page(b, "k") and not alloc.cache_page(a, "other")
    assert alloc.decref([b]) == [b] and alloc.num_evictable == 0 and alloc.num_cached == 1
    with pytest.raises(ValueError, match="page 2 is free"):
        alloc.cache_page(b, "k2")
    alloc.check()


def test_clear_cache_frees_evictable_pages_and_unkeys_held_ones():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.cache_page(a, "ka")
    alloc.cache_page(b, "kb")
    alloc.decref([a])
    assert alloc.clear_cache() == 2 and alloc.num_cached == 0 and alloc.match(["ka"]) == []
    assert alloc.decref([b]) == [b] and alloc.num_free == alloc.capacity and alloc.num_evictable == 0
    alloc.check()


def test_page_keys_are_the_kvpool_chunk_keys_and_extend_incrementally():
    tokens = list(range(3, 3 + 4 * P + 2))
    want = [k.digest for k in chunk_keys(tokens, NS)]
    assert len(want) == 4 and extend_page_keys([], tokens, NS) == want
    keys = extend_page_keys([], tokens[:2 * P + 1], NS)
    assert extend_page_keys(keys, tokens, NS, limit=3) == want[:3]
    other = ChunkNamespace("tiny@0123", "bfloat16", P)  # the dtype is in the key
    assert extend_page_keys([], tokens, other)[0] != want[0]
    assert [shareable_pages(n, P) for n in (0, 1, P, P + 1, 2 * P, 2 * P + 1)] == [0, 0, 0, 1, 1, 2]


def _cache(num_pages=9):
    return PagedKVCache(tiny_config(), PageConfig(P, num_pages), prefix_namespace=NS)


def test_reserve_prefix_shares_cached_leading_pages_and_always_leaves_the_last_token_to_compute():
    cache = _cache()
    prompt = list(range(10, 10 + 3 * P))  # exactly 3 pages
    assert cache.reserve_prefix("a", prompt, len(prompt) + 2) == 0
    assert cache.commit_pages("a", prompt) == 3
    pages_a = cache.pages_of("a")
    # the same prompt: its last page holds the last prompt token, which must be computed
    assert cache.reserve_prefix("b", prompt, len(prompt) + 2) == 2 * P
    assert cache.pages_of("b")[:2] == pages_a[:2] and cache.pages_of("b")[2] not in pages_a
    # a longer prompt sharing 3 pages, then diverging
    assert cache.reserve_prefix("c", prompt + [1, 2], 20) == 3 * P and cache.pages_of("c")[:3] == pages_a[:3]
    assert cache.stats()["prefix_hit_tokens"] == 5 * P and cache.stats()["prefix_query_tokens"] == 2 * P + 2 * P + 3 * P
    for r in ("a", "b", "c"):
        cache.free(r)
    assert cache.pages_in_use == 0 and cache.pages_cached == 3 and cache.pages_free == cache.allocator.capacity
    cache.allocator.check()


def test_commit_pages_caches_only_the_pages_the_written_tokens_fill():
    """reserve_prefix keys the whole shareable prompt up front; a first prefill chunk that wrote
    only part of it must not make the unwritten pages shareable."""
    cache = _cache()
    prompt = list(range(40, 40 + 3 * P + 1))
    cache.reserve_prefix("a", prompt, len(prompt))
    assert cache.commit_pages("a", prompt[:P + 1]) == 1 and cache.pages_cached == 1
    assert cache.reserve_prefix("b", prompt, len(prompt)) == P  # only the written page is shared
    assert cache.commit_pages("a", prompt) == 2 and cache.pages_cached == 3
    cache.free("a")
    cache.free("b")
    cache.allocator.check()


def test_reserve_prefix_out_of_pages_releases_the_shared_pages_again():
    cache = _cache(num_pages=5)  # 4 usable pages
    prompt = list(range(20, 20 + 2 * P + 1))
    cache.reserve_prefix("a", prompt, len(prompt))
    cache.commit_pages("a", prompt)
    cache.free("a")
    blocker = cache.reserve("x", 2 * P)
    assert len(blocker) == 2  # the free pages went first; the two cached pages are left
    with pytest.raises(OutOfPages) as e:
        cache.reserve_prefix("b", prompt, len(prompt) + P)  # 2 shared + 2 new, no page free
    assert (e.value.needed, e.value.free) == (4, 2)  # counted with the shared pages
    assert "b" not in cache and cache.allocator.num_evictable == 2 and cache.pages_cached == 2
    cache.free("x")
    cache.allocator.check()


def test_commit_pages_without_prefix_caching_is_a_no_op():
    cache = PagedKVCache(tiny_config(), PageConfig(P, 9))
    assert cache.reserve_prefix("a", [1] * 9, 9) == 0 and cache.commit_pages("a", [1] * 9) == 0
    assert cache.stats().keys() == {"kv_pages_in_use", "kv_pages_free", "kv_bytes_in_use", "kv_bytes_total",
                                    "kv_requests", "kv_h2d_arrived_bytes", "kv_h2d_fetched_bytes",
                                    "kv_h2d_other_bytes"}
    cache.free("a")


# --------------------------------------------------------------- property test
_ops = st.lists(st.tuples(st.sampled_from(["start", "write", "finish"]), st.integers(0, 7), st.integers(0, 3),
                          st.integers(1, 14)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_random_reuse_never_shares_a_page_holding_other_tokens_and_never_leaks(ops):
    """The device pages are simulated by what each page holds (the tokens at each slot); a request
    that shares a page must find exactly its own tokens there. Prompts are built from 4 'system
    prompts' plus a random tail so prefixes collide often; the pool is tiny so eviction is common."""
    cache = _cache(num_pages=12)
    content: dict[int, list] = {}  # page -> the token written at each slot (None: not written)
    live: dict[str, tuple[list[int], int]] = {}  # request -> (its tokens, tokens written so far)
    systems = [[s * 10 + j for j in range(2 * P + s)] for s in range(4)]

    def write(rid, upto):
        tokens, done = live[rid]
        pages = cache.pages_of(rid)
        for pos in range(done, upto):
            content.setdefault(pages[pos // P], [None] * P)[pos % P] = tokens[pos]
        live[rid] = (tokens, upto)
        cache.commit_pages(rid, tokens[:upto])

    for n, (op, who, system, tail) in enumerate(ops):
        rid = f"r{who}"
        if op == "start" and rid not in live:
            prompt = systems[system] + [100 + n + j for j in range(tail)]
            tokens = prompt + [200 + n + j for j in range(3)]  # the prompt, then 3 'generated' tokens
            try:
                cached = cache.reserve_prefix(rid, prompt, len(tokens))
            except OutOfPages:
                assert rid not in cache
                continue
            assert cached % P == 0 and cached < len(prompt)
            pages = cache.pages_of(rid)
            for pos in range(cached):  # every shared slot holds this request's own token
                assert content[pages[pos // P]][pos % P] == tokens[pos], "a shared page holds other tokens"
            for p in pages[cached // P:]:
                assert cache.allocator.refcount(p) == 1, "a page the request will write is shared"
                content[p] = [None] * P
            live[rid] = (tokens, cached)
        elif op == "write" and rid in live:
            tokens, done = live[rid]
            write(rid, min(len(tokens), done + tail))  # prompt chunks, then 'generated' tokens
        elif op == "finish" and rid in live:
            cache.free(rid)
            del live[rid]
        cache.allocator.check()
        held = [p for r in live for p in cache.pages_of(r)]
        assert cache.pages_in_use == len(set(held))
    for rid in list(live):
        cache.free(rid)
    assert cache.pages_in_use == 0 and cache.requests == []
    cache.clear_prefix_cache()
    cache.allocator.check()
    assert cache.pages_free == cache.allocator.capacity and cache.pages_cached == 0


def _zero_donated(kv):
    import functools

    import jax

    @functools.partial(jax.jit, donate_argnums=(0,))
    def zero(kv):
        return tuple((K * 0, V * 0) for K, V in kv)

    return zero(kv)


def test_an_evicted_page_goes_to_the_host_tier_and_comes_back_bit_exact():
    import jax.numpy as jnp
    import numpy as np

    from jkv.kvpool import HostKVPool

    cfg = tiny_config()
    pool = HostKVPool(1 << 24)
    cache = PagedKVCache(cfg, PageConfig(P, 4), prefix_namespace=NS, host_pool=pool)  # 3 usable pages
    rng = np.random.default_rng(0)
    cache.kv = tuple((jnp.asarray(rng.normal(size=K.shape), K.dtype), jnp.asarray(rng.normal(size=V.shape), V.dtype))
                     for K, V in cache.kv)
    prompt = list(range(60, 60 + 2 * P + 1))
    cache.reserve_prefix("a", prompt, len(prompt))
    cache.commit_pages("a", prompt)
    first = cache.pages_of("a")[0]
    want = [(np.asarray(K[first]), np.asarray(V[first])) for K, V in cache.kv]
    cache.free("a")
    cache.reserve("x", 3 * P)  # needs every page: both cached pages are evicted and written back
    # the device copies are overwritten (donated) before the background write-back need have copied them: it
    # works on a snapshot dispatched at eviction
    cache.kv = _zero_donated(cache.kv)
    assert cache.writeback.flush(30) and cache.writeback.pending_pages == 0
    assert cache.allocator.evictions == 2 and cache.writeback.host_writes == 2 and pool.stats().entries == 2
    cache.free("x")
    assert cache.reserve_prefix("b", prompt, len(prompt)) == 2 * P  # both pages from the host tier
    loaded = cache.pages_of("b")[0]
    for (K, V), (k, v) in zip(cache.kv, want):
        np.testing.assert_array_equal(np.asarray(K[loaded]), k)
        np.testing.assert_array_equal(np.asarray(V[loaded]), v)
    assert cache.stats()["prefix_hit_tokens_host"] == 2 * P and cache.stats()["prefix_hit_tokens"] == 0
    assert cache.pages_cached == 2  # loaded pages are device-cached again
    cache.free("b")
    cache.allocator.check()
    cache.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("jkv-prefix-writeback")]
