"""Endpoint API in one process (real sockets): auth, errors, timeouts, notifications, metrics."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from transport import (AuthError, BackendUnavailable, Endpoint, Mask, OpTimeout, RemoteError,
                       TransferState, TransportError, aligned_empty)
from transport.auth import Deadline, client_handshake, proof, recv_frame, send_frame
from transport.wire import HEADER_SIZE, Op

from transport_consts import SECRET  # noqa: E402  (tests/transport is on sys.path)


@pytest.fixture(params=["tcp", "shm"])
def pair(request, make_endpoint):
    server = make_endpoint("server", request.param)
    client = make_endpoint("client", request.param)
    server.register("pool", np.zeros(1 << 20, np.uint8))
    server.register("mask", np.zeros(64, np.int8))
    peer = client.connect(server.listen())
    return server, client, peer


def test_write_then_mask_and_metrics(pair):
    server, client, peer = pair
    data = np.arange(10000, dtype=np.uint16)
    t = peer.write("pool", 128, data, then=Mask("mask", 5, b"\x01\x01\x01"))
    assert t.wait(5) is t and t.state is TransferState.COMPLETE and t.elapsed >= 0
    pool = server.regions.by_name("pool").array
    assert np.array_equal(pool[128:128 + data.nbytes].view(np.uint16), data)
    assert list(server.regions.by_name("mask").array[4:9]) == [0, 1, 1, 1, 0]
    snap = client.metrics.snapshot()
    assert snap["tx"]["write"] == {**snap["tx"]["write"], "ops": 1, "bytes": data.nbytes + 3,
                                   "failures": 0}
    assert server.metrics.snapshot()["rx"]["write"]["bytes"] == data.nbytes + 3
    assert server.peers["client"].name == "client" and client.peer("server") is peer


def test_caller_errors_are_clear(pair):
    server, client, peer = pair
    with pytest.raises(ValueError, match="does not fit"):
        peer.write("pool", (1 << 20) - 10, b"x" * 11)
    with pytest.raises(ValueError, match="does not fit"):
        peer.write("pool", 0, b"x", then=("mask", 64, 1))
    with pytest.raises(KeyError, match="no region 'nope'.*pool"):
        peer.write("nope", 0, b"x")
    with pytest.raises(ValueError, match="C-contiguous"):
        peer.write("pool", 0, np.zeros((8, 8), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="timeout"):
        peer.write("pool", 0, b"x", timeout=0)
    with pytest.raises(RemoteError, match="serves no method 'missing'"):
        peer.call("missing")


def test_rpc_handler_errors_into_buffer_and_timeouts(pair):
    server, client, peer = pair

    def boom(peer_name, payload):
        raise RuntimeError(f"bad request from {peer_name}")

    server.serve("boom", boom)
    server.serve("big", lambda p, payload: b"y" * 100)
    release = threading.Event()  # the slow reply waits for it (at most 10 s), not for a fixed sleep
    server.serve("slow", lambda p, payload: (release.wait(10), b"late")[1])
    with pytest.raises(RemoteError, match="RuntimeError: bad request from client"):
        peer.call("boom")
    into = bytearray(10)
    with pytest.raises(RemoteError, match="does not fit"):
        peer.call("big", into=into)
    into = bytearray(200)
    assert bytes(peer.call("big", into=into)) == b"y" * 100 and into[:100] == b"y" * 100
    started = time.monotonic()
    t = peer.call_async("slow", timeout=0.2)
    with pytest.raises(OpTimeout, match="0.2s timeout"):
        t.result()
    # The reply is held until after this check, so the failure can only be the 0.2 s timeout; the
    # bound is loose because a wall-clock margin of 0.35 s is not one on a loaded two-worker box.
    assert t.state is TransferState.FAILED and time.monotonic() - started < 5
    release.set()
    time.sleep(0.5)  # the late reply arrives and is dropped; the connection stays usable
    assert peer.alive and peer.call("big") == b"y" * 100
    with pytest.raises(ValueError, match="reserved"):
        server.serve("_jkv.x", boom)


def test_notifications_in_order_with_handler_and_inbox(pair):
    server, client, peer = pair
    seen, done = [], threading.Event()

    def on_tick(n):
        seen.append(n.payload)
        if len(seen) == 100:
            done.set()

    server.on_notify("tick", on_tick)
    for i in range(100):
        peer.notify("tick", i.to_bytes(4, "little"))
        if i % 10 == 0:
            peer.notify("other", i.to_bytes(4, "little"))
    assert done.wait(5)
    assert seen == [i.to_bytes(4, "little") for i in range(100)]
    others = [server.next_notification(2) for _ in range(10)]
    assert [int.from_bytes(n.payload, "little") for n in others] == list(range(0, 100, 10))
    assert all(n.peer == "client" and n.kind == "other" for n in others)
    with pytest.raises(OpTimeout):
        server.next_notification(0.05)


def test_unregistered_region_rejected_by_receiver(pair):
    server, client, peer = pair
    peer.write("pool", 0, b"a").wait(5)  # caches the region id
    server.unregister("pool")
    t = peer.write("pool", 0, b"b")
    with pytest.raises(TransportError, match="unknown region"):
        t.wait(5)
    assert not peer.alive


def test_close_fails_pending_operations(pair):
    server, client, peer = pair
    release = threading.Event()
    server.serve("block", lambda p, payload: (release.wait(5), b"")[1])
    t = peer.call_async("block")
    time.sleep(0.1)
    client.close()
    release.set()
    with pytest.raises(TransportError, match="closed"):
        t.wait(2)
    with pytest.raises(TransportError):
        peer.call("block")


def test_wrong_secret_refused_by_client_and_server(make_endpoint):
    server = make_endpoint("server")
    server.register("pool", np.zeros(4096, np.uint8))
    address = server.listen()
    intruder = make_endpoint("intruder", secret="another-secret")
    with pytest.raises(AuthError, match="failed to prove the shared secret"):
        intruder.connect(address)
    # A client that guesses: the server refuses it and never answers a region query on that socket.
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        send_frame(s, Op.HELLO, b"n" * 32 + b"tcp".ljust(8, b"\0") + b"guesser", 1)
        challenge = recv_frame(s, Op.CHALLENGE, Deadline(5))
        send_frame(s, Op.AUTH, proof(b"wrong-secret", "client", b"jkvt-v2" + challenge[:32]), 2)
        with pytest.raises(AuthError, match="wrong shared secret"):
            recv_frame(s, Op.WELCOME, Deadline(5))
        try:
            s.sendall(b"\0" * HEADER_SIZE)
            assert s.recv(1) == b""  # closed, nothing exposed
        except OSError:
            pass
    deadline = time.monotonic() + 2
    while server.metrics.snapshot()["auth_failures"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metrics.snapshot()["auth_failures"] == 2
    assert server.peers == {}
    assert make_endpoint("friend").connect(address).regions()["pool"].nbytes == 4096


def test_backend_mismatch_and_garbage_clients_refused(make_endpoint):
    server = make_endpoint("server")
    host, port = server.listen().rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        with pytest.raises(AuthError, match="backend mismatch"):
            client_handshake(s, SECRET.encode(), "c", "shm", Deadline(5))
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        try:
            assert s.recv(100) == b""  # closed without a reply
        except ConnectionResetError:
            pass  # or reset: unread bytes were pending when the server closed
    assert make_endpoint("ok").connect(f"{host}:{port}").alive


def test_listen_defaults_to_loopback_and_connect_retries(make_endpoint):
    server = make_endpoint("server")
    client = make_endpoint("client")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = {}

    def late_listen():
        time.sleep(0.3)
        result["addr"] = server.listen(f"127.0.0.1:{port}")

    t = threading.Thread(target=late_listen)
    t.start()
    peer = client.connect(f"127.0.0.1:{port}", connect_timeout=5)
    t.join()
    assert peer.name == "server" and client.metrics.snapshot()["retries"] >= 1
    assert make_endpoint("x").listen().startswith("127.0.0.1:")
    with pytest.raises(TransportError, match="could not connect"):
        client.connect("127.0.0.1:1", connect_timeout=0.2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(secret="short"), "at least 8"),
    (dict(backend="udp"), "backend='udp'"),
    (dict(timeout=0), "timeout=0"),
    (dict(heartbeat=10.0), "heartbeat=10.0"),
    (dict(bandwidth="fast"), "bandwidth='fast'"),
    (dict(op_timeout=-1), "op_timeout=-1"),
])
def test_endpoint_config_validation(kwargs, match):
    kwargs = {"secret": SECRET, **kwargs}
    with pytest.raises(ValueError, match=match):
        Endpoint("bad", **kwargs)


def test_rdma_backend_fails_at_start_with_the_fix():
    with pytest.raises(BackendUnavailable, match="--transport tcp"):
        Endpoint("r", "rdma", secret=SECRET)


def test_aligned_empty_is_page_aligned():
    a = aligned_empty((3, 1000), np.float16)
    assert a.ctypes.data % 4096 == 0 and a.shape == (3, 1000) and a.flags.c_contiguous


def test_aligned_empty_zeroed_is_zeros_even_where_freed_memory_is_reused():
    for _ in range(3):  # small sizes come from malloc's free lists: calloc must clear what it reuses
        dirty = aligned_empty((3, 1000), np.float16)
        dirty[...] = 7
        del dirty
        a = aligned_empty((3, 1000), np.float16, zeroed=True)
        assert a.ctypes.data % 4096 == 0 and a.shape == (3, 1000) and not a.any()
    big = aligned_empty((2, 30, 3, 2176, 64), np.float32, zeroed=True)  # a 4 x 2K request's staging
    assert big.ctypes.data % 4096 == 0 and not big[:, :, :, ::97].any() and not big[-1, -1, -1, -1].any()


def test_payload_checksum_off_must_match_on_both_sides(make_endpoint):
    fast = make_endpoint("fast-rx", payload_checksum=False)
    pool = np.zeros(1 << 16, np.uint8)
    fast.register("pool", pool)
    sender = make_endpoint("fast-tx", payload_checksum=False)
    peer = sender.connect(fast.listen())
    peer.write("pool", 10, b"abc", then=("pool", 0, 1)).wait(5)
    assert bytes(pool[10:13]) == b"abc" and pool[0] == 1
    strict = make_endpoint("strict-rx")
    strict.register("pool", np.zeros(16, np.uint8))
    t = sender.connect(strict.listen()).write("pool", 0, b"x")
    with pytest.raises(TransportError, match="requires them"):
        t.wait(5)
    assert strict.metrics.snapshot()["frames_rejected"] == 1


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_multiple_streams_per_peer(backend, make_endpoint):
    server = make_endpoint("server", backend)
    pool = np.zeros((64, 4096), np.uint8)
    server.register("pool", pool)
    client = make_endpoint("client", backend)
    peer = client.connect(server.listen(), streams=3)
    assert peer.streams == 3
    deadline = time.monotonic() + 5
    while ("client" not in server.peers or server.peers["client"].streams < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.peers["client"].streams == 3
    data = np.random.default_rng(5).integers(0, 256, pool.shape, dtype=np.uint8)
    ts = [peer.write("pool", i * 4096, data[i]) for i in range(64)]  # rotate over the streams
    for t in ts:
        t.wait(5)
    assert np.array_equal(pool, data)
    assert min(c._seq_tx for c in peer._conns) >= 64 // 3  # every stream carried writes
    # one stream dying takes the whole peer down, on both sides
    peer._conns[1].sock.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 5
    # the peer reads down as soon as one stream fails; the endpoint then fails its other streams
    while ((not all(c.failed for c in peer._conns) or "client" in server.peers or "server" in client.peers)
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert not peer.alive and all(c.failed for c in peer._conns)
    assert "server" not in client.peers and "client" not in server.peers
    with pytest.raises(TransportError):
        peer.write("pool", 0, b"x").wait(2)
    with pytest.raises(ValueError, match="streams=0"):
        client.connect(server.address, streams=0)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_idle_peer_heartbeats_within_the_other_sides_liveness_timeout(make_endpoint, backend):
    """Each side heartbeats at most every fifth of the *peer's* liveness timeout (learned in the
    handshake), not only of its own: a client with a long timeout (a KV-pool client whose op
    timeout is 10 s heartbeats every 2 s on its own) stays connected to a server that drops a
    peer after 0.5 s of silence, however long it idles."""
    server = make_endpoint("server", backend, timeout=0.5)
    client = make_endpoint("client", backend, timeout=10.0, op_timeout=10.0)
    server.serve("echo", lambda peer_name, payload: bytes(payload))
    peer = client.connect(server.listen())
    time.sleep(1.5)  # idle for 3x the server's liveness timeout
    assert peer.alive and "client" in server.peers
    assert bytes(peer.call("echo", b"still here")) == b"still here"
    assert server.metrics.snapshot().get("peers_failed", 0) == 0


def _slow_reply_pair(make_endpoint, backend):
    """A server whose replies are paced to 8 kbit/s: its 2,000-byte reply takes ~2 s."""
    server = make_endpoint("server", backend, bandwidth="8kbit")
    client = make_endpoint("client", backend)
    server.serve("big", lambda peer_name, payload: b"z" * 2000)
    return server, client, client.connect(server.listen())


def test_a_peer_dropping_mid_reply_fails_the_call_at_once(make_endpoint, backend="tcp"):  # shm replies are not paced
    """The reader takes a call out of the pending table when its REPLY header arrives; a peer that
    dies while the payload is still arriving must fail that call too, not leave it waiting
    forever (it was in no queue that failing the connection empties)."""
    server, client, peer = _slow_reply_pair(make_endpoint, backend)
    into = bytearray(4096)
    t = peer.call_async("big", timeout=60, into=into)
    time.sleep(0.5)                               # the reply is on its way, not yet complete
    server.close()
    with pytest.raises(TransportError) as failed:
        t.wait(10)
    assert t.state is TransferState.FAILED and not isinstance(failed.value, OpTimeout), failed.value


def test_a_reply_still_arriving_past_the_calls_deadline_fails_it(make_endpoint, backend="tcp"):  # shm replies are not paced
    """A call's deadline holds while its reply arrives: the call fails with OpTimeout near its
    deadline (the connection closes, since the stream cannot skip the rest of the frame), not
    when the slow reply finally lands."""
    server, client, peer = _slow_reply_pair(make_endpoint, backend)
    t0 = time.monotonic()
    t = peer.call_async("big", timeout=0.6, into=bytearray(4096))
    with pytest.raises(OpTimeout, match="still arriving|did not complete"):
        t.wait(10)
    assert t.state is TransferState.FAILED and time.monotonic() - t0 < 1.8
