"""How a tcp connection uses its socket per frame — the rules that keep tcp with payload checksums
close to a raw socket's CPU per byte (experiments/bench_transport.py, docs/transport.md "Benchmark"):

* sender, checksums on the socket thread: header, payload and trailer in one ``sendmsg`` (like a
  raw socket's one ``sendall`` of the block);
* receiver: one ``recv`` per whole piece (MSG_WAITALL), the trailer in the same call as the last
  piece, and SO_RCVTIMEO returning what has arrived so that a slowly arriving piece keeps the
  connection's liveness fresh;
* the reader acknowledges a write on its own thread when nothing else is being written (no sender
  wake-up per write); bytes the kernel does not take at once go out first on the sender thread.

Each test wraps one end of a socketpair in :class:`Recorder` and adopts it as a connection.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from transport.receiver import _DIGEST_PIECE, RECV_TIMEOUT_S
from transport.wire import (FLAG_ACK, FLAG_TRAILER, HEADER_SIZE, TRAILER, TRAILER_SIZE, Header, Op, crc32c, decode_header,
                            encode_header, trailer_digest)

MiB = 1 << 20


class Recorder:
    """A socket that records each send/recv call: (call, bytes asked or given, flags, thread name)."""

    def __init__(self, sock: socket.socket, send_limit: int | None = None):
        self._s = sock
        self.calls: list[tuple[str, object, int, str]] = []
        self.send_limit = send_limit  # MSG_DONTWAIT sends take at most this many bytes (-1: none)

    def _note(self, call: str, size, flags: int = 0) -> None:
        self.calls.append((call, size, flags, threading.current_thread().name))

    def sendmsg(self, bufs, *args):
        self._note("sendmsg", sum(len(b) for b in bufs))
        return self._s.sendmsg(bufs, *args)

    def sendall(self, data, *args):
        self._note("sendall", len(data))
        return self._s.sendall(data, *args)

    def send(self, data, flags: int = 0):
        self._note("send", len(data), flags)
        if self.send_limit is not None and flags & socket.MSG_DONTWAIT:
            if self.send_limit < 0:
                raise BlockingIOError("send buffer full (simulated)")
            data = data[:self.send_limit]
        return self._s.send(data, flags)

    def recv_into(self, view, nbytes: int = 0, flags: int = 0):
        self._note("recv_into", nbytes or len(view), flags)
        return self._s.recv_into(view, nbytes, flags)

    def recvmsg_into(self, bufs, ancbufsize: int = 0, flags: int = 0):
        self._note("recvmsg_into", [len(b) for b in bufs], flags)
        return self._s.recvmsg_into(bufs, ancbufsize, flags)

    def __getattr__(self, name):
        return getattr(self._s, name)


def trailer_write(seq: int, payload: bytes, offset: int = 0) -> bytes:
    h = Header(Op.WRITE, FLAG_ACK | FLAG_TRAILER, 1, seq, offset, len(payload), 0, 0)
    return encode_header(h) + payload + TRAILER.pack(trailer_digest(payload))


def read_frames(sock: socket.socket, count: int, timeout: float = 10.0) -> list[Header]:
    """The next ``count`` control frames other than heartbeats (none of them carries a payload)."""
    sock.settimeout(timeout)
    frames = []
    while len(frames) < count:
        raw = b""
        while len(raw) < HEADER_SIZE:
            chunk = sock.recv(HEADER_SIZE - len(raw))
            assert chunk, "stream closed before the expected frames"
            raw += chunk
        h = decode_header(raw)
        if h.op != Op.PING:
            frames.append(h)
    return frames


def receiver(make_endpoint, nbytes: int, **kw):
    """(endpoint with region "r" of ``nbytes``, its array, our end, the Recorder on its end)."""
    kw.setdefault("timeout", 60.0)  # no heartbeat among the recorded sends
    ep = make_endpoint("rx", checksum_offload=False, **kw)
    region = np.zeros(nbytes, np.uint8)
    ep.register("r", region)
    ours, theirs = socket.socketpair()
    rec = Recorder(theirs)
    ep._adopt(rec, "fuzzer")
    return ep, region, ours, rec


def test_a_checksummed_frame_goes_out_in_one_sendmsg(make_endpoint):
    rx = make_endpoint("rx", checksum_offload=False, timeout=60.0)
    region = np.zeros(4 * MiB, np.uint8)
    rx.register("r", region)
    ours, theirs = socket.socketpair()
    rec = Recorder(ours)
    rx._adopt(theirs, "tx")
    peer = make_endpoint("tx", checksum_offload=False, timeout=60.0)._adopt(rec, "rx")
    peer.regions()
    rng = np.random.default_rng(3)
    for nbytes in [MiB, 3 * MiB + 5]:
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        rec.calls.clear()
        peer.write("r", 0, data).wait(10)
        sizes = [size for call, size, _, _ in rec.calls if call == "sendmsg"]
        assert sizes == [HEADER_SIZE + nbytes + TRAILER_SIZE], sizes
        assert np.array_equal(region[:nbytes], data)


def test_receiver_digests_cache_sized_spans_then_reads_the_trailer(make_endpoint):
    """A trailer payload is received in spans of at most _DIGEST_PIECE bytes (each hashed while
    it is in cache), never one MSG_WAITALL call for a whole MiB; the trailer comes last."""
    nbytes = 2 * MiB + 1000
    ep, region, ours, rec = receiver(make_endpoint, nbytes)
    payload = np.random.default_rng(4).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    sender = threading.Thread(target=ours.sendall, args=(trailer_write(1, payload),))
    sender.start()
    (ack,) = read_frames(ours, 1)
    sender.join()
    assert ack.op == Op.ACK and ack.aux == 1 and bytes(region) == payload
    asks = [(call, size, flags) for call, size, flags, _ in rec.calls if call.startswith("recv")]
    assert asks[0] == ("recv_into", HEADER_SIZE, 0)
    trailer_at = next(i for i, (_, size, _) in enumerate(asks) if i and size == TRAILER_SIZE)
    payload_asks = asks[1:trailer_at]
    assert payload_asks and all(call == "recv_into" and 0 < size <= _DIGEST_PIECE and flags == 0
                                for call, size, flags in payload_asks)
    assert len(payload_asks) >= nbytes // _DIGEST_PIECE
    assert all(size in (HEADER_SIZE, TRAILER_SIZE) or size < TRAILER_SIZE  # the trailer, then the next header
               for _, size, _ in asks[trailer_at:])


def test_a_piece_arriving_slowly_keeps_the_connection_alive(make_endpoint):
    """A whole-piece recv must not starve the liveness check: the receiver (0.5 s liveness
    timeout) sees no complete piece for 1.5 s, only a byte every 50 ms, and keeps the connection."""
    nbytes = 300_000
    ep, region, ours, rec = receiver(make_endpoint, nbytes, timeout=0.5)
    payload = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    frame = trailer_write(1, payload)
    ours.sendall(frame[:HEADER_SIZE + 100])
    for i in range(30):
        time.sleep(0.05)
        ours.sendall(frame[HEADER_SIZE + 100 + i:HEADER_SIZE + 101 + i])
    ours.sendall(frame[HEADER_SIZE + 130:])
    (ack,) = read_frames(ours, 1)
    assert ack.op == Op.ACK and bytes(region) == payload
    assert ep.metrics.snapshot().get("peers_failed", 0) == 0 and RECV_TIMEOUT_S < 0.5 / 2


def test_the_reader_acknowledges_on_its_own_thread_when_the_stream_is_idle(make_endpoint):
    ep, region, ours, rec = receiver(make_endpoint, MiB)
    payload = bytes(range(256)) * 1024
    ours.sendall(trailer_write(1, payload))
    (ack,) = read_frames(ours, 1)
    assert ack.op == Op.ACK and ack.aux == 1
    (call, size, flags, thread), = [c for c in rec.calls if c[0].startswith("send")]
    assert call == "send" and size == HEADER_SIZE and flags & socket.MSG_DONTWAIT
    assert thread.startswith("jkvt-rx-"), thread


def test_bytes_the_kernel_does_not_take_go_out_first_on_the_sender_thread(make_endpoint):
    """The reader's non-blocking send takes part of the ACK (or nothing): the sender thread writes
    the rest before anything else, so the peer reads whole, in-order frames."""
    ep, region, ours, rec = receiver(make_endpoint, MiB)
    payload = bytes(range(256)) * 1024
    for seq, limit in [(1, 10), (2, -1), (3, 0)]:
        rec.send_limit = limit
        rec.calls.clear()
        ours.sendall(trailer_write(seq, payload))
        (ack,) = read_frames(ours, 1)
        assert (ack.op, ack.aux, ack.seq) == (Op.ACK, seq, seq)
        rest = [(call, size, thread) for call, size, _, thread in rec.calls if call == "sendall"]
        assert rest == [("sendall", HEADER_SIZE - max(limit, 0), rest[0][2])] and rest[0][2].startswith("jkvt-tx-")
    assert ep.metrics.snapshot()["frames_rejected"] == 0
