"""Behaviour every KVPool backend must show; imported by the per-backend test modules."""
import time

import numpy as np
import pytest

from jkv.kvpool.hashing import ChunkNamespace, chunk_keys

NS = ChunkNamespace("smollm2-135m", "float16", 4)
CHUNK_SHAPE = (2, 2, 3, 4, 8)  # [L, K|V, H_kv, C, D]


def chunk_payload(key) -> np.ndarray:
    """Deterministic fp16 KV for a key: distinct keys give distinct bytes."""
    seed = int.from_bytes(key.digest[:8], "little")
    return np.random.default_rng(seed).standard_normal(CHUNK_SHAPE).astype(np.float16)


def buffers(n: int) -> list[np.ndarray]:
    nbytes = int(np.prod(CHUNK_SHAPE)) * 2
    return [np.full(nbytes, 0xAB, dtype=np.uint8) for _ in range(n)]


def check_round_trip(pool):
    keys = chunk_keys(list(range(20)), NS)
    for key in keys[:3]:
        assert pool.put(key, chunk_payload(key))
    out = buffers(5)
    metas = pool.get_many(keys, out)
    assert [m is not None for m in metas] == [True, True, True, False, False]
    for key, meta, buf in zip(keys[:3], metas, out):
        assert meta.shape == CHUNK_SHAPE and meta.dtype == "float16" and meta.num_tokens == 4
        np.testing.assert_array_equal(meta.view(buf), chunk_payload(key))
    assert (out[3] == 0xAB).all() and (out[4] == 0xAB).all()  # misses leave buffers untouched


def check_longest_prefix(pool):
    prompt = list(range(100, 120))  # 5 chunks
    keys = chunk_keys(prompt, NS)
    for key in keys[:3]:
        pool.put(key, chunk_payload(key))
    assert pool.longest_prefix(prompt, NS) == 3
    assert pool.longest_prefix(prompt[:9], NS) == 2          # only full chunks count
    diverged = prompt[:8] + [7] * 12                           # shares chunks 0, 1
    assert pool.longest_prefix(diverged, NS) == 2
    assert pool.longest_prefix(prompt, ChunkNamespace("other", "float16", 4)) == 0
    assert pool.delete(keys[1]) and not pool.delete(keys[1])
    assert pool.longest_prefix(prompt, NS) == 1               # a hole ends the prefix
    assert pool.contains(keys[2]) and not pool.contains(keys[1])


def check_caller_errors(pool):
    """A buffer too small for the stored chunk, or a buffer count that does not match the keys,
    is the caller's error: ValueError naming the fix, whatever the backend."""
    a, b = chunk_keys(list(range(8)), NS)
    pool.put(a, chunk_payload(a))
    with pytest.raises(ValueError, match="holds 10 bytes"):
        pool.get_many([a], [np.zeros(10, np.uint8)])
    with pytest.raises(ValueError, match="one each"):
        pool.get_many([a, b], buffers(1))


def check_dead_backend_misses(pool, prompt, keys, within_s: float):
    """With the backend gone, every operation degrades within `within_s` seconds: reads miss
    (never raise, never write a buffer), writes and deletes return False, errors are counted."""
    out = buffers(4)
    t0 = time.monotonic()
    assert pool.get_many(keys, out) == [None] * 4                  # a miss, not an exception
    assert pool.longest_prefix(prompt, NS) == 0
    assert not pool.put(keys[0], chunk_payload(keys[0]))
    assert not pool.contains(keys[0]) and not pool.delete(keys[0])
    assert time.monotonic() - t0 < within_s
    assert all((b == 0xAB).all() for b in out)                     # nothing written on a miss
    assert pool.stats().errors >= 1
