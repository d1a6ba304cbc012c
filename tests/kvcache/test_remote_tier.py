"""The prefix cache's remote tier (L3) and asynchronous write-back, on `PagedKVCache` with a tiny
config and a real redis-server: evicted pages reach Redis and come back bit-exact in another cache
(another server), pages failing verification (CRC, shape, dtype) are never used, a killed or
stopped server costs at most the op timeout and is used again once it returns, and a full
write-back stage drops (and counts) instead of blocking the engine."""
import functools
import logging
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kvcache import PageConfig, PagedKVCache
from jkv.kvcache.remote_tier import open_remote_pool
from jkv.kvcache.writeback import WriteBack
from jkv.kvpool import HostKVPool
from jkv.kvpool.hashing import ChunkKey, ChunkNamespace
from models import tiny_config
from tests.kvpool.redis_server import running_redis
from tests.stop_process import stop_process

redis = pytest.importorskip("redis", reason="the `redis` Python client is not installed (pip install redis)")

P = 4
NS = ChunkNamespace("tiny@0123", "float32", P)
TIMEOUT = 0.3
PROMPT = list(range(60, 60 + 2 * P + 1))  # two shareable full pages


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path) as server:
        yield server


def _cache(url, pages=4):
    """A 3-usable-page cache with random KV, L3 at `url`."""
    cache = PagedKVCache(tiny_config(), PageConfig(P, pages), prefix_namespace=NS,
                         remote_pool=open_remote_pool(url, TIMEOUT, retry_after_s=0.5), remote_timeout_s=TIMEOUT)
    rng = np.random.default_rng(pages)
    cache.kv = tuple((jnp.asarray(rng.normal(size=K.shape), K.dtype), jnp.asarray(rng.normal(size=V.shape), V.dtype))
                     for K, V in cache.kv)
    return cache


@functools.partial(jax.jit, donate_argnums=(0,))
def _zero(kv):
    return tuple((K * 0, V * 0) for K, V in kv)


def _write_prompt_to_l3(cache, check_writes=True):
    """Cache PROMPT's two pages, evict them (written back), return their KV [(K, V) per layer] per page."""
    before = cache.writeback.remote_writes
    cache.reserve_prefix("a", PROMPT, len(PROMPT))
    cache.commit_pages("a", PROMPT)
    pages = cache.pages_of("a")[:2]
    want = [[(np.asarray(K[p]), np.asarray(V[p])) for K, V in cache.kv] for p in pages]
    cache.free("a")
    cache.reserve("x", 3 * P)  # every page: both cached pages are evicted and written back
    cache.kv = _zero(cache.kv)  # overwritten (donated) at once: the write-back copies its snapshot
    cache.free("x")
    assert cache.writeback.flush(30) and cache.writeback.pending_pages == 0
    assert cache.writeback.remote_writes - before == 2 or not check_writes
    return want


def _load(cache, prompt=PROMPT, rid="b"):
    """Admit `prompt` the way the batcher does: prefetch from L3, wait for it, reserve_prefix."""
    pre = cache.prefetch_remote(prompt)
    got = None
    while pre is not None and (got := cache.remote.collect(pre)) is None:
        time.sleep(0.005)
    return cache.reserve_prefix(rid, prompt, len(prompt), remote=None if pre is None else (pre.start, got))


def _check_pages(cache, rid, want):
    for page, layers in zip(cache.pages_of(rid), want):
        for (K, V), (k, v) in zip(cache.kv, layers):
            np.testing.assert_array_equal(np.asarray(K[page]), k)
            np.testing.assert_array_equal(np.asarray(V[page]), v)


def _close(*caches):
    for c in caches:
        for rid in c.requests:
            c.free(rid)
        c.allocator.check()
        assert c.pages_in_use == 0
        c.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(("jkv-prefix-writeback", "jkv-prefix-l3"))]


def test_evicted_pages_reach_l3_and_load_bit_exact_into_another_servers_cache(redis_server):
    _check_shared_l3(redis_server.url)
    assert redis.Redis.from_url(redis_server.url).dbsize() == 2


def test_a_jkv_pool_server_is_an_l3_too(monkeypatch):
    from tests.kvpool.pool_server import SECRET, PoolServerProcess

    monkeypatch.setenv("JKV_SECRET", SECRET)
    server = PoolServerProcess().start()
    try:
        _check_shared_l3("jkvpool://" + server.address)
    finally:
        server.stop()


def _check_shared_l3(url):
    a, b = _cache(url), _cache(url, pages=5)
    try:
        want = _write_prompt_to_l3(a)
        assert _load(b) == 2 * P  # b never computed the prompt: both pages come from Redis
        _check_pages(b, "b", want)
        stats = b.stats()
        assert stats["prefix_hit_tokens_remote"] == 2 * P and stats["prefix_hit_tokens"] == 0
        assert stats["prefix_l3_errors"] == 0 and b.pages_cached == 2  # device-cached again
        b.free("b")
        assert _load(b, rid="c") == 2 * P and b.stats()["prefix_hit_tokens"] == 2 * P  # now from L1
    finally:
        _close(a, b)


def _corrupt_payload(url, name):
    raw = redis.Redis.from_url(url)
    payload = bytearray(raw.hget(name, "payload"))
    payload[len(payload) // 2] ^= 0x40
    raw.hset(name, "payload", bytes(payload))


def _page_of_shape(shape, dtype):
    """A valid entry (CRC and key name right) whose page has another geometry or dtype."""
    def put(url, name):
        pool = open_remote_pool(url, TIMEOUT, 0.5)
        assert pool.put(ChunkKey(NS, -1, bytes.fromhex(name.rsplit(":", 1)[1])), np.zeros(shape, dtype))
        pool.close()
    return put


_CFG = tiny_config()
_PAGE = (_CFG.num_layers, 2, _CFG.num_kv_heads, P, _CFG.head_dim)


# the smaller shape fits the page buffer (the shape check catches it); the larger one does not (the whole read
# is refused, so even the first page is recomputed)
@pytest.mark.parametrize("spoil, loaded", [
    (_corrupt_payload, 1), (_page_of_shape((*_PAGE[:-1], _PAGE[-1] - 1), np.float32), 1),
    (_page_of_shape(_PAGE, np.float16), 1), (_page_of_shape((*_PAGE[:-1], _PAGE[-1] + 1), np.float32), 0)],
    ids=["crc", "shape", "dtype", "too-big"])
def test_a_page_failing_verification_is_recomputed_never_used(redis_server, spoil, loaded):
    a, b = _cache(redis_server.url), _cache(redis_server.url, pages=5)
    try:
        want = _write_prompt_to_l3(a)
        spoil(redis_server.url, ChunkKey(NS, -1, b.prompt_keys(PROMPT)[1]).name)
        assert _load(b) == loaded * P  # from the spoiled page on (at least), the request recomputes
        _check_pages(b, "b", want[:loaded])
        assert b.stats()["prefix_l3_errors"] == 1
    finally:
        _close(a, b)


@pytest.mark.parametrize("outage", ["kill", "stop"])
def test_a_dead_or_stopped_redis_costs_at_most_the_op_timeout_and_is_used_again_when_it_returns(
        redis_server, outage, caplog):
    a, b = _cache(redis_server.url), _cache(redis_server.url, pages=5)
    try:
        want = _write_prompt_to_l3(a)
        if outage == "kill":
            redis_server.stop()
        else:
            stop_process(redis_server.proc.pid)
        with caplog.at_level(logging.WARNING, logger="jkv"):
            t0 = time.monotonic()
            assert _load(b) == 0  # recompute
            waited = time.monotonic() - t0
        assert waited < TIMEOUT + 0.5, f"admission waited {waited:.2f} s for L3 (op timeout {TIMEOUT} s)"
        assert b.stats()["prefix_l3_errors"] >= 1
        assert any("prefix cache L3" in r.getMessage() for r in caplog.records)
        b.free("b")
        t0 = time.monotonic()
        assert _load(b, rid="c") == 0 and time.monotonic() - t0 < TIMEOUT + 0.5  # skipped while it is down
        b.free("c")
        if outage == "kill":  # back on the same port, empty
            redis_server.start()
        else:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while True:  # recovery: after the retry pause the tier writes and reads again
            if outage == "kill":  # back on the same port but empty: a writes the pages again
                a.clear_prefix_cache()
                want = _write_prompt_to_l3(a, check_writes=False)
            if _load(b, rid="d") == 2 * P:
                break
            b.free("d")
            b.clear_prefix_cache()
            assert time.monotonic() < deadline, "L3 was not used again after Redis came back"
            time.sleep(0.2)
        _check_pages(b, "d", want)
    finally:
        if redis_server.proc is not None:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        _close(a, b)


class _BlockingPool(HostKVPool):
    def __init__(self):
        super().__init__(1 << 20)
        self.release = threading.Event()

    def put(self, key, payload, meta=None):
        assert self.release.wait(30)
        return super().put(key, payload, meta)


def test_a_full_write_back_stage_drops_and_counts_instead_of_blocking_and_leaks_nothing():
    pool = _BlockingPool()
    wb = WriteBack(NS, pool, max_pages=2)
    page = np.ones((1, 2, 2, 2, P, 8), np.float32)
    keys = [bytes([i]) * 16 for i in range(4)]
    try:
        t0 = time.monotonic()
        assert wb.submit(page, keys[:1])  # taken by the host stage, which blocks in put
        assert wb.submit(page, keys[1:2])  # queued: the stage now holds 2 pages
        assert not wb.submit(page, keys[2:3])  # full: dropped, never blocks the engine thread
        assert time.monotonic() - t0 < 1.0
        assert wb.dropped == {"host": 1, "remote": 0} and wb.pending_pages == 2
        pool.release.set()
        assert wb.flush(30) and wb.pending_pages == 0 and wb.host_writes == 2
        assert wb.submit(page, keys[3:]) and wb.flush(30) and wb.host_writes == 3
    finally:
        pool.release.set()
        wb.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("jkv-prefix-writeback")]
    assert not wb.submit(page, keys[:1])  # closed: dropped
