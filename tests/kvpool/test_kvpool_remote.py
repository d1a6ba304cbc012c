"""The built-in `jkv pool` server (a child process) and its RemoteKVPool client: the shared pool
cases, cross-process round trip, LRU eviction under capacity, a killed or stopped server
degrades to misses within the op timeout and never to a wrong hit."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from jkv.kvpool.hashing import chunk_keys, key_from_name
from jkv.kvpool.remote_pool import RemoteKVPool
from jkv.kvpool.server import PoolServer, parse_size
from tests.kvpool.pool_cases import (NS, buffers, check_caller_errors, check_dead_backend_misses,
                                     check_longest_prefix, check_round_trip, chunk_payload)
from tests.kvpool.pool_server import REPO_ROOT, SECRET, PoolServerProcess

CHUNK_BYTES = chunk_payload(chunk_keys([0] * 4, NS)[0]).nbytes


@pytest.fixture(scope="module")
def server():
    proc = PoolServerProcess().start()
    yield proc
    proc.stop()


@pytest.fixture
def pool(server):
    with RemoteKVPool(server.address, secret=SECRET) as client:
        for key in chunk_keys(list(range(100, 120)) + list(range(20)), NS):
            client.delete(key)
        for key in chunk_keys(list(range(20)), NS):
            client.delete(key)
        yield client


def test_round_trip(pool):
    check_round_trip(pool)


def test_longest_prefix(pool):
    check_longest_prefix(pool)


def test_shm_backend_round_trip():
    proc = PoolServerProcess(backend="shm").start()
    try:
        with RemoteKVPool(proc.address, secret=SECRET, backend="shm") as client:
            check_round_trip(client)
    finally:
        proc.stop()


def test_put_in_one_process_get_in_another(server):
    prompt = list(range(300, 316))
    code = ("import sys; from jkv.kvpool.remote_pool import RemoteKVPool;"
            "from jkv.kvpool.hashing import chunk_keys;"
            "from tests.kvpool.pool_cases import NS, chunk_payload;"
            "p = RemoteKVPool(sys.argv[1], secret=sys.argv[2]);"
            f"ks = chunk_keys({prompt}, NS);"
            "assert all(p.put(k, chunk_payload(k)) for k in ks); p.close()")
    subprocess.run([sys.executable, "-c", code, server.address, SECRET], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    keys = chunk_keys(prompt, NS)
    with RemoteKVPool(server.address, secret=SECRET) as client:
        assert client.longest_prefix(prompt, NS) == 4
        out = buffers(4)
        for key, meta, buf in zip(keys, client.get_many(keys, out), out):
            np.testing.assert_array_equal(meta.view(buf), chunk_payload(key))


def test_lru_eviction_under_capacity():
    proc = PoolServerProcess(capacity=str(3 * CHUNK_BYTES)).start()
    try:
        with RemoteKVPool(proc.address, secret=SECRET) as pool:
            a, b, c, d, e = chunk_keys(list(range(20)), NS)
            for key in (a, b, c):
                assert pool.put(key, chunk_payload(key))
            assert pool.get_many([a], buffers(1))[0] is not None      # a becomes most recent
            assert pool.put(d, chunk_payload(d))                      # evicts b
            assert pool.contains_many([a, b, c, d]) == [True, False, True, True]
            assert pool.put(e, chunk_payload(e))                      # evicts c
            assert pool.contains_many([a, b, c, d, e]) == [True, False, False, True, True]
            assert not pool.put(b, np.zeros(4 * CHUNK_BYTES, np.uint8))   # larger than the pool
            stats = pool.stats()
            assert (stats.entries, stats.bytes_used, stats.evictions) == (3, 3 * CHUNK_BYTES, 2)
            assert stats.capacity_bytes == 3 * CHUNK_BYTES and stats.rejected_puts == 1
    finally:
        proc.stop()


def test_killed_server_degrades_to_recompute_then_recovers():
    proc = PoolServerProcess().start()
    address = proc.address
    pool = RemoteKVPool(address, secret=SECRET, op_timeout_s=1.0, retry_after_s=0.3)
    try:
        prompt = list(range(16))
        keys = chunk_keys(prompt, NS)
        assert all(pool.put(k, chunk_payload(k)) for k in keys)
        assert pool.longest_prefix(prompt, NS) == 4

        proc.stop()
        check_dead_backend_misses(pool, prompt, keys, within_s=3)

        proc = PoolServerProcess(listen=address).start()              # same address, empty pool
        time.sleep(0.35)
        assert pool.longest_prefix(prompt, NS) == 0
        assert pool.put(keys[0], chunk_payload(keys[0])) and pool.longest_prefix(prompt, NS) == 1
    finally:
        pool.close()
        proc.stop()


def test_pending_get_of_a_stopped_server_fails_within_the_timeout():
    proc = PoolServerProcess().start()
    # bounds leave room for a loaded 2-core CI box (a 0.1 s bound once failed under load):
    # the first read waits the op timeout (1 s), the next must not wait it again
    pool = RemoteKVPool(proc.address, secret=SECRET, op_timeout_s=1.0, retry_after_s=30)
    try:
        keys = chunk_keys(list(range(8)), NS)
        assert all(pool.put(k, chunk_payload(k)) for k in keys)
        proc.pause()                                                  # alive but silent
        t0 = time.monotonic()
        out = buffers(2)
        assert pool.get_many(keys, out) == [None, None]
        assert 0.9 < time.monotonic() - t0 < 5.0
        t1 = time.monotonic()
        assert pool.get_many(keys, out) == [None, None]               # dead: no network wait
        assert time.monotonic() - t1 < 0.5
        assert all((b == 0xAB).all() for b in out)
    finally:
        proc.resume()
        pool.close()
        proc.stop()


def test_a_server_sending_wrong_bytes_causes_misses_not_hits():
    server = PoolServer(1 << 20, secret=SECRET)
    try:
        address = server.start()
        with RemoteKVPool(address, secret=SECRET) as pool:
            a, b = chunk_keys(list(range(8)), NS)
            pool.put(a, chunk_payload(a))
            pool.put(b, chunk_payload(b))
            good = server.pool.lookup_many
            # The server's store hands out a's bytes for b (a buggy or malicious server).
            server.pool.lookup_many = lambda keys: [good([a])[0] for _ in keys]
            out = buffers(2)
            metas = pool.get_many([a, b], out)
            assert metas[0] is not None and metas[1] is None
            np.testing.assert_array_equal(metas[0].view(out[0]), chunk_payload(a))
            assert (out[1] == 0xAB).all()
    finally:
        server.close()


def test_a_read_slower_than_the_servers_liveness_timeout_completes():
    """`jkv serve --prefix-cache-l3-timeout 10` reading through a slow link from a pool that drops a
    peer after 0.5 s of silence: a reply takes ~1.6 s here, during which the client sends nothing
    but heartbeats. On its own the client would heartbeat every 2 s (a fifth of its own timeout),
    the server would drop it mid-reply and the read would fail (L3 then skipped for
    retry_after_s, the stall behind the first CALVO serving figure). It heartbeats within the
    server's timeout instead (learned in the handshake), so the read completes."""
    server = PoolServer(1 << 20, secret=SECRET, timeout=0.5, bandwidth="4kbit")  # 768 B: ~1.6 s
    try:
        address = server.start()
        with RemoteKVPool(address, secret=SECRET, op_timeout_s=10.0, retry_after_s=60) as pool:
            a, = chunk_keys(list(range(4)), NS)
            assert pool.put(a, chunk_payload(a))
            out = buffers(1)
            t0 = time.monotonic()
            meta, = pool.get_many([a], out)
            assert time.monotonic() - t0 > 1.0                        # the reply did outlast 0.5 s
            assert meta is not None
            np.testing.assert_array_equal(meta.view(out[0]), chunk_payload(a))
    finally:
        server.close()


def test_caller_errors_are_clear(pool):
    check_caller_errors(pool)
    with pytest.raises(ValueError, match="op_timeout_s"):
        RemoteKVPool("127.0.0.1:1", secret=SECRET, op_timeout_s=0)


@pytest.mark.parametrize("name, match", [("x:y", "must look like"),
                                         ("jkv:m:float16:c4:zz", "malformed"),
                                         ("jkv:m:float16:c4:abcd", "2-byte digest")])
def test_key_from_name_rejects_malformed_names(name, match):
    with pytest.raises(ValueError, match=match):
        key_from_name(name)
    key = chunk_keys(list(range(8)), NS)[1]
    assert key_from_name(key.name).name == key.name


def test_parse_size():
    assert parse_size("3MiB") == 3 << 20 and parse_size("2gb") == 2 * 10**9
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_server_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != "JKV_SECRET"}
    env["PYTHONPATH"] = REPO_ROOT
    done = subprocess.run([sys.executable, "-m", "jkv.kvpool.server"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "JKV_SECRET is empty" in done.stderr


def test_jkv_cli_has_the_pool_subcommand():
    from jkv.cli import build_parser
    args = build_parser().parse_args(["pool", "--capacity", "1GiB", "--backend", "shm"])
    assert (args.command, args.capacity, args.backend) == ("pool", "1GiB", "shm")
