"""Redis backend against a real redis-server: round trip (also across processes), prefix match,
server-side eviction, corrupted entries miss, and a killed server degrades to misses."""
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

redis = pytest.importorskip("redis", reason="the `redis` Python client is not installed "
                                              "(pip install redis)")

from jkv.kvpool.hashing import chunk_keys  # noqa: E402
from jkv.kvpool.redis_pool import RedisKVPool  # noqa: E402
from tests.kvpool.pool_cases import (NS, buffers, check_dead_backend_misses,  # noqa: E402
                                     check_longest_prefix, check_round_trip, chunk_payload)
from tests.kvpool.redis_server import RedisServer, needs_redis_server  # noqa: E402

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


@pytest.fixture
def pool(redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    with RedisKVPool(redis_server.url) as p:
        yield p


def test_round_trip(pool):
    check_round_trip(pool)


def test_longest_prefix(pool):
    check_longest_prefix(pool)


def test_keys_name_model_dtype_and_hash(pool, redis_server):
    key = chunk_keys(list(range(4)), NS)[0]
    pool.put(key, chunk_payload(key))
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.keys("*") == [f"jkv:smollm2-135m:float16:c4:{key.digest.hex()}".encode()]
    assert set(raw.hkeys(key.name)) == {b"payload", b"meta"}


def test_put_in_one_process_get_in_another(pool, redis_server):
    prompt = list(range(200, 216))
    code = (
        "import sys; from jkv.kvpool.redis_pool import RedisKVPool;"
        "from jkv.kvpool.hashing import chunk_keys;"
        "from tests.kvpool.pool_cases import NS, chunk_payload;"
        "p = RedisKVPool(sys.argv[1]);"
        f"ks = chunk_keys({prompt}, NS);"
        "assert all(p.put(k, chunk_payload(k)) for k in ks)")
    subprocess.run([sys.executable, "-c", code, redis_server.url], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    keys = chunk_keys(prompt, NS)
    assert pool.longest_prefix(prompt, NS) == 4
    out = buffers(4)
    for key, meta, buf in zip(keys, pool.get_many(keys, out), out):
        np.testing.assert_array_equal(meta.view(buf), chunk_payload(key))


def test_pipelined_batch_of_many_chunks(pool):
    keys = chunk_keys(list(range(4 * 200)), NS)
    for key in keys[::2]:
        pool.put(key, chunk_payload(key))
    out = buffers(len(keys))
    metas = pool.get_many(keys, out)
    assert [m is not None for m in metas] == [i % 2 == 0 for i in range(len(keys))]
    for key, meta, buf in zip(keys[::2], metas[::2], out[::2]):
        np.testing.assert_array_equal(meta.view(buf), chunk_payload(key))
    assert pool.stats().hits == 100 and pool.stats().misses == 100


def test_corrupt_or_misplaced_entries_miss_never_hit(pool, redis_server):
    a, b, c = chunk_keys(list(range(12)), NS)
    for key in (a, b):
        pool.put(key, chunk_payload(key))
    raw = redis.Redis.from_url(redis_server.url)
    payload = bytearray(raw.hget(a.name, "payload"))
    payload[5] ^= 0x01
    raw.hset(a.name, "payload", bytes(payload))                     # bit flip
    raw.hset(c.name, mapping=raw.hgetall(b.name))                   # b's entry under c's key
    raw.hset(b.name, "meta", b"{not json")                          # unreadable metadata
    assert pool.get_many([a, b, c], buffers(3)) == [None, None, None]


@needs_redis_server
def test_server_side_lru_eviction_under_maxmemory(tmp_path):
    server = RedisServer(tmp_path, maxmemory="2mb").start()
    try:
        pool = RedisKVPool(server.url)
        keys = chunk_keys(list(range(4 * 300)), NS)
        big = lambda k: np.repeat(chunk_payload(k).reshape(-1), 32)   # 24 KiB per chunk
        stored = [pool.put(k, big(k)) for k in keys]
        present = pool.contains_many(keys)
        assert all(stored) and 0 < sum(present) < len(keys)
        assert present[-1] and not present[0]                      # oldest went first
        out = [np.empty(big(keys[0]).nbytes, np.uint8) for _ in keys]
        for key, meta, buf in zip(keys, pool.get_many(keys, out), out):
            if meta is not None:
                np.testing.assert_array_equal(meta.view(buf), big(key))
        pool.close()
    finally:
        server.stop()


def test_killed_server_degrades_to_recompute_then_recovers(private_redis_server):
    pool = RedisKVPool(private_redis_server.url, socket_timeout_s=0.5, retry_after_s=0.3)
    prompt = list(range(16))
    keys = chunk_keys(prompt, NS)
    for key in keys:
        assert pool.put(key, chunk_payload(key))
    assert pool.longest_prefix(prompt, NS) == 4

    private_redis_server.stop()
    check_dead_backend_misses(pool, prompt, keys, within_s=5)

    private_redis_server.start()                                   # same port, empty memory
    time.sleep(0.35)
    assert pool.longest_prefix(prompt, NS) == 0
    assert pool.put(keys[0], chunk_payload(keys[0])) and pool.longest_prefix(prompt, NS) == 1
    pool.close()
