"""How a tcp connection uses its socket per frame — the rules that keep tcp with payload checksums
close to a raw socket's CPU per byte (experiments/bench_transport.py, docs/transport.md "Benchmark"):

* sender, checksums on the socket thread: one ``sendmsg`` per 1 MiB piece, the header riding with
  the first and the trailer with the last (a 1 MiB write is one call, like a raw ``sendall``).

Each test wraps one end of a socketpair in :class:`Recorder` and adopts it as a connection.
"""
from __future__ import annotations

import socket
import threading

import numpy as np

from transport.wire import (FLAG_ACK, FLAG_TRAILER, HEADER_SIZE, TRAILER, Header, Op, crc32c, decode_header,
                            encode_header)

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
    return encode_header(h) + payload + TRAILER.pack(crc32c(payload))


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


def test_checksummed_frames_go_out_one_sendmsg_per_mib(make_endpoint):
    rx = make_endpoint("rx", checksum_offload=False, timeout=60.0)
    region = np.zeros(4 * MiB, np.uint8)
    rx.register("r", region)
    ours, theirs = socket.socketpair()
    rec = Recorder(ours)
    rx._adopt(theirs, "tx")
    peer = make_endpoint("tx", checksum_offload=False, timeout=60.0)._adopt(rec, "rx")
    peer.regions()
    rng = np.random.default_rng(3)
    for nbytes, sendmsgs in [(MiB, 1), (3 * MiB + 5, 4)]:
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        rec.calls.clear()
        peer.write("r", 0, data).wait(10)
        sizes = [size for call, size, _, _ in rec.calls if call == "sendmsg"]
        assert len(sizes) == sendmsgs and sum(sizes) == HEADER_SIZE + nbytes + 4, sizes
        assert np.array_equal(region[:nbytes], data)
