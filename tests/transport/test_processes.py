"""Two real OS processes over loopback TCP and shm: writes, RPC, notifications, faults."""
from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from transport import Mask, PeerDeadError, TransferState, TransportError
from transport.tool import read_request

from tests.stop_process import stop_process

BACKENDS = ["tcp", "shm"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_land_byte_exact_rpc_and_notifications(backend, spawn_peer, make_endpoint):
    child = spawn_peer("--backend", backend, "--name", "decode", "--region", "pool:8388608",
                       "--region", "mask:256")
    ep = make_endpoint("prefill", backend)
    peer = ep.connect(child.address)
    assert peer.name == "decode"
    rng = np.random.default_rng(1)
    expected = np.zeros(8 << 20, np.uint8)
    blocks = []
    for i in range(24):  # mixed sizes, unaligned offsets, a 3 MiB block bigger than any chunk
        size = int(rng.integers(1, 200_000)) if i != 7 else 3 << 20
        off = int(rng.integers(0, len(expected) - size))
        data = rng.integers(0, 256, size, dtype=np.uint8)
        expected[off:off + size] = data
        blocks.append((off, data))
    # per-block mask bytes, sent as a write_many so the whole batch is one transfer
    t = peer.write_many([("pool", off, data, Mask("mask", i, 1)) for i, (off, data) in enumerate(blocks)])
    t.wait(20)
    assert t.state is TransferState.COMPLETE
    assert peer.call("digest", b"pool") == hashlib.sha256(expected).digest()
    mask = np.zeros(256, np.uint8)
    mask[:24] = 1
    assert peer.call("digest", b"mask") == hashlib.sha256(mask).digest()
    # RPC round trips: echo, and a 64 KiB row read received straight into a caller buffer
    for n in (0, 1, 1000, 1 << 20):
        payload = rng.bytes(n)
        assert bytes(peer.call("echo", payload)) == payload
    into = np.zeros(1 << 16, np.uint8)
    reply = peer.call("read", read_request("pool", 12345, 1 << 16), into=into)
    assert len(reply) == 1 << 16 and np.array_equal(into, expected[12345:12345 + (1 << 16)])
    # notifications in order, both directions
    for i in range(50):
        peer.notify("seq", str(i).encode())
    assert peer.notify("seq", b"50").wait(5).state is TransferState.COMPLETE
    # ACK means received; the child's handler thread may still be appending: poll briefly
    expected = ",".join(map(str, range(51))).encode()
    deadline = time.monotonic() + 5
    while (got := bytes(peer.call("notified"))) != expected and time.monotonic() < deadline:
        assert expected.startswith(got), got  # a prefix so far, never out of order
        time.sleep(0.01)
    assert got == expected
    assert peer.call("notify_back", b"40") == b"sent"
    got = [ep.next_notification(5).payload for _ in range(40)]
    assert got == [str(i).encode() for i in range(40)]
    snap = ep.metrics.snapshot()
    assert snap["tx"]["write"]["ops"] == 1
    assert snap["tx"]["write"]["bytes"] == sum(len(d) for _, d in blocks) + 24
    assert snap["tx"]["write"]["busy_bandwidth_bps"] > 0
    assert snap["rx"]["notify"]["ops"] == 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_killed_mid_transfer_fails_pending_and_survivor_serves(backend, spawn_peer, make_endpoint):
    doomed = spawn_peer("--backend", backend, "--name", "doomed", "--region", "pool:67108864")
    healthy = spawn_peer("--backend", backend, "--name", "healthy", "--region", "pool:1048576")
    timeout = 2.0
    ep = make_endpoint("survivor", backend, timeout=timeout)
    ep.serve("ping", lambda peer, payload: b"pong")
    address = ep.listen()
    to_doomed = ep.connect(doomed.address, bandwidth="200mbit")  # 64 MiB takes ~2.7 s
    to_healthy = ep.connect(healthy.address)
    big = np.ones(64 << 20, np.uint8)
    write = to_doomed.write("pool", 0, big)
    call = to_doomed.call_async("sleep", b"30")
    deadline = time.monotonic() + 5
    while write.state is not TransferState.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert write.state is TransferState.TRANSFERRING
    killed_at = time.monotonic()
    doomed.kill()
    for t in (write, call):
        with pytest.raises(TransportError):
            t.wait(timeout + 1.0)
        assert t.state is TransferState.FAILED and t.reason
        assert t.finished_at - killed_at < timeout
    assert isinstance(write.error, PeerDeadError)
    # The endpoint drops the peer right after failing its operations (same teardown, other thread).
    gone_by = time.monotonic() + 1.0
    while "doomed" in ep.peers and time.monotonic() < gone_by:
        time.sleep(0.01)
    assert not to_doomed.alive and "doomed" not in ep.peers
    # the survivor keeps serving: outgoing to the other process, incoming from a new peer
    assert to_healthy.call("echo", b"still here") == b"still here"
    to_healthy.write("pool", 0, b"x" * 1000).wait(5)
    other = make_endpoint("other", backend)
    assert other.connect(address).call("ping") == b"pong"
    assert ep.metrics.snapshot()["peers_failed"] == 1
    write_failures = ep.metrics.snapshot()["tx"]["write"]["failures"]
    assert write_failures == 1


def test_silent_peer_fails_pending_within_timeout(spawn_peer, make_endpoint):
    """A stopped (not dead) process: no EOF, only heartbeats can tell."""
    import os
    import signal
    child = spawn_peer("--name", "frozen", "--region", "pool:1024")
    ep = make_endpoint("watcher", timeout=1.0)
    peer = ep.connect(child.address)
    assert peer.call("echo", b"a") == b"a"
    stop_process(child.pid)
    try:
        stopped_at = time.monotonic()
        call = peer.call_async("echo", b"b", timeout=30)
        with pytest.raises(PeerDeadError, match="silent"):
            call.wait(5)
        assert call.finished_at - stopped_at < 1.0 + 0.5  # timeout + watchdog tick + slack
    finally:
        os.kill(child.pid, signal.SIGCONT)


def test_ops_from_many_threads_complete(spawn_peer, make_endpoint):
    child = spawn_peer("--name", "sink", "--region", "pool:1048576")
    ep = make_endpoint("src")
    peer = ep.connect(child.address)
    errors = []

    def worker(k):
        try:
            for i in range(20):
                assert peer.call("echo", f"{k}-{i}".encode()) == f"{k}-{i}".encode()
                peer.write("pool", k * 4096 + i, bytes([k])).wait(5)
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
