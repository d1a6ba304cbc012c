"""In-process host-memory pool: round trip, prefix match, LRU eviction under a byte capacity."""
import threading

import numpy as np
import pytest

from jkv.kvpool import HostKVPool, make_meta
from jkv.kvpool.hashing import chunk_keys
from tests.kvpool.pool_cases import (NS, buffers, check_caller_errors, check_longest_prefix,
                                     check_round_trip, chunk_payload)

CHUNK_BYTES = chunk_payload(chunk_keys([0] * 4, NS)[0]).nbytes


def test_round_trip():
    check_round_trip(HostKVPool(1 << 20))


def test_longest_prefix():
    check_longest_prefix(HostKVPool(1 << 20))


def test_lru_eviction_under_capacity():
    pool = HostKVPool(3 * CHUNK_BYTES)
    a, b, c, d, e = chunk_keys(list(range(20)), NS)
    for key in (a, b, c):
        assert pool.put(key, chunk_payload(key))
    assert pool.get_many([a], buffers(1))[0] is not None       # a becomes most recent
    assert pool.put(d, chunk_payload(d))                       # evicts b (least recent)
    assert pool.contains_many([a, b, c, d]) == [True, False, True, True]
    assert pool.put(e, chunk_payload(e))                       # evicts c
    assert pool.contains_many([a, b, c, d, e]) == [True, False, False, True, True]
    stats = pool.stats()
    assert (stats.entries, stats.bytes_used, stats.evictions) == (3, 3 * CHUNK_BYTES, 2)
    assert stats.bytes_used <= stats.capacity_bytes


def test_overwrite_does_not_double_count_and_oversize_is_rejected():
    pool = HostKVPool(2 * CHUNK_BYTES)
    a, b = chunk_keys(list(range(8)), NS)
    pool.put(a, chunk_payload(a))
    pool.put(a, chunk_payload(a))
    assert pool.stats().bytes_used == CHUNK_BYTES
    assert not pool.put(b, np.zeros(3 * CHUNK_BYTES, np.uint8))
    assert pool.stats().rejected_puts == 1 and pool.contains(a) and not pool.contains(b)


def test_caller_errors_are_clear():
    pool = HostKVPool(1 << 20)
    check_caller_errors(pool)
    a, b = chunk_keys(list(range(8)), NS)
    with pytest.raises(ValueError, match="read-only"):
        pool.get_many([a], [bytes(CHUNK_BYTES)])
    with pytest.raises(ValueError, match="C-contiguous"):
        pool.put(b, np.zeros((8, 8), np.float16).T)
    with pytest.raises(ValueError, match="does not describe"):
        pool.put(b, chunk_payload(b), make_meta(a, chunk_payload(a)))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostKVPool(0)


def test_concurrent_puts_and_gets_never_return_wrong_bytes():
    pool = HostKVPool(8 * CHUNK_BYTES)   # small: eviction races with reads
    keys = chunk_keys(list(range(4 * 64)), NS)
    errors = []

    def writer():
        for key in keys:
            pool.put(key, chunk_payload(key))

    def reader():
        for _ in range(3):
            out = buffers(len(keys))
            for key, meta, buf in zip(keys, pool.get_many(keys, out), out):
                if meta is not None and not np.array_equal(meta.view(buf), chunk_payload(key)):
                    errors.append(key.name)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader),
               threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.stats().bytes_used <= 8 * CHUNK_BYTES
