"""Checksum trailers (FLAG_TRAILER): large payloads carry their XXH3-64 digest after the payload, computed
on a side thread while the socket copies (or, with checksum_offload=False, on the socket threads).
A bit flipped anywhere in such a frame (header, payload, trailer), or a frame cut short, is
rejected: nothing acknowledged, and the mask frame that follows the block on the stream (its
commit) never applied; a damaged header writes nothing at all."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import checksum
from transport.checksum import ChecksumWorker
from transport.connection import _SMALL, _split_tail
from transport.wire import (FLAG_ACK, FLAG_TRAILER, HEADER_SIZE, TRAILER, Header, Op, crc32c, decode_header,
                            encode_header, trailer_digest)

BLOCK = _SMALL + 4096 + 3  # above the header-checksum limit, not a round size
MASK_AT = BLOCK + 100  # the "mask" byte that commits the block, in the same region
REGION = BLOCK + 4096
FILL = 0xAA


def _block() -> bytes:
    return np.random.default_rng(5).integers(0, FILL, BLOCK, dtype=np.uint8).tobytes()  # never FILL


def trailer_frame(seq: int, payload: bytes, offset: int = 0, flags: int = FLAG_ACK) -> bytes:
    h = Header(Op.WRITE, flags | FLAG_TRAILER, 1, seq, offset, len(payload), 0, 0)
    return encode_header(h) + payload + TRAILER.pack(trailer_digest(payload))


def block_then_mask() -> tuple[bytes, int, int]:
    """The stream a sender produces for a block and its mask: (bytes, header end, trailer start)."""
    payload = _block()
    block = trailer_frame(1, payload, flags=0)
    mask = encode_header(Header(Op.WRITE, FLAG_ACK, 1, 2, MASK_AT, 1, 0, crc32c(b"\x01"))) + b"\x01"
    return block + mask, HEADER_SIZE, HEADER_SIZE + BLOCK


class Receiver:
    """An endpoint with one region; ``feed`` pushes raw bytes through a real Connection and
    returns the ops of the frames it sent back (ACK, ERROR, ...)."""

    def __init__(self, make_endpoint, checksum_offload: bool | None = None):
        self.ep = make_endpoint("rx", checksum_offload=checksum_offload)
        self.buf = np.full(REGION, FILL, np.uint8)
        self.ep.register("r", self.buf)
        self.n = 0

    def feed(self, data: bytes, answered: bool = True) -> list[Header]:
        """answered: the receiver will answer (ACK or ERROR): wait for that before closing our
        side (closing first would fail the connection before a queued ACK goes out)."""
        self.buf[:] = FILL
        self.n += 1
        ours, theirs = socket.socketpair()
        peer = self.ep._adopt(theirs, f"fuzzer-{self.n}")
        back = bytearray()
        reader = threading.Thread(target=_read_all, args=(ours, back))
        reader.start()
        try:
            ours.sendall(data)
            for _ in range(1000 if answered else 0):
                if len(back) >= HEADER_SIZE:
                    break
                threading.Event().wait(0.005)
            ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # rejected and closed while we were still sending
        peer._conn.join(10)
        reader.join(10)
        ours.close()
        return _frames(bytes(back))

    def rejected(self) -> int:
        return self.ep.metrics.snapshot()["frames_rejected"]


def _read_all(sock, out: bytearray) -> None:
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            return
        if not chunk:
            return
        out += chunk


def _frames(raw: bytes) -> list[Header]:
    out, pos = [], 0
    while pos + HEADER_SIZE <= len(raw):
        h = decode_header(raw[pos:pos + HEADER_SIZE])
        out.append(h)
        pos += HEADER_SIZE + h.length
    return out


def test_intact_trailer_frame_is_applied_and_acknowledged(make_endpoint):
    rx = Receiver(make_endpoint)
    data, _, _ = block_then_mask()
    back = rx.feed(data)
    assert bytes(rx.buf[:BLOCK]) == _block() and rx.buf[MASK_AT] == 1
    assert [h.aux for h in back if h.op == Op.ACK] == [2] and rx.rejected() == 0


@pytest.mark.parametrize("offload", [False, True], ids=["inline", "side-thread"])
def test_any_flipped_bit_is_rejected_before_the_commit(make_endpoint, offload):
    rx = Receiver(make_endpoint, checksum_offload=offload)
    data, header_end, _ = block_then_mask()

    @given(bit=st.integers(0, 8 * (HEADER_SIZE + BLOCK + 4) - 1))  # header, payload, trailer
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def run(bit):
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        before = rx.rejected()
        back = rx.feed(bytes(bad))
        assert rx.rejected() == before + 1
        assert not [h for h in back if h.op == Op.ACK], "a damaged frame was acknowledged"
        assert rx.buf[MASK_AT] == FILL, "the mask after a damaged block was applied"
        if bit // 8 < header_end:  # a damaged header is rejected before any payload byte lands
            assert (rx.buf == FILL).all()
        assert [h.op for h in back] == [Op.ERROR]  # the sender is told why, then the stream closes

    for bit in (0, 8 * HEADER_SIZE - 1, 8 * HEADER_SIZE, 8 * (HEADER_SIZE + BLOCK) - 1,
                8 * (HEADER_SIZE + BLOCK), 8 * (HEADER_SIZE + BLOCK + 4) - 1):  # every boundary
        run.hypothesis.inner_test(bit)
    run()


@pytest.mark.parametrize("cut", [HEADER_SIZE - 1, HEADER_SIZE + 10, HEADER_SIZE + BLOCK - 1,
                                 HEADER_SIZE + BLOCK + 2])
def test_truncated_trailer_frame_is_rejected(make_endpoint, cut):
    rx = Receiver(make_endpoint)
    data, _, _ = block_then_mask()
    back = rx.feed(data[:cut], answered=False)
    assert not [h for h in back if h.op == Op.ACK] and rx.buf[MASK_AT] == FILL
    if cut < HEADER_SIZE:
        assert (rx.buf == FILL).all()


@pytest.mark.parametrize("flags, payload_crc, length", [
    (FLAG_TRAILER, 1, BLOCK),  # trailer and a header checksum at once
    (FLAG_TRAILER | 0x4, 0, BLOCK),  # trailer and "no checksum" at once
])
def test_contradictory_checksum_flags_write_nothing(make_endpoint, flags, payload_crc, length):
    rx = Receiver(make_endpoint)
    h = Header(Op.WRITE, flags, 1, 1, 0, length, 0, payload_crc)
    payload = _block()
    rx.feed(encode_header(h) + payload + TRAILER.pack(trailer_digest(payload)))
    assert (rx.buf == FILL).all() and rx.rejected() == 1


@pytest.mark.parametrize("offload", [False, True], ids=["inline", "side-thread"])
@pytest.mark.parametrize("nbytes", [_SMALL + 1, 3 << 20, (16 << 20) + 5])
def test_large_writes_calls_and_notifies_round_trip_with_trailers(make_endpoint, nbytes, offload):
    """Both checksum placements (side threads, or the socket threads) on both sides."""
    rx = make_endpoint("rx", max_message=32 << 20, checksum_offload=offload)
    region = np.zeros(nbytes, np.uint8)
    rx.register("big", region)
    rx.serve("echo", lambda peer, payload: bytes(payload))
    got = []
    rx.on_notify("note", lambda n: got.append(n.payload))
    peer = make_endpoint("tx", max_message=32 << 20, checksum_offload=offload).connect(rx.listen())
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    peer.write("big", 0, data, then=("big", 0, int(data[0]))).wait(30)
    assert np.array_equal(region, data)
    assert peer.call("echo", data.tobytes(), timeout=30) == data.tobytes()
    into = np.empty(nbytes, np.uint8)
    assert np.array_equal(np.frombuffer(peer.call("echo", data, into=into, timeout=30), np.uint8), data)
    peer.notify("note", data).wait(30)
    assert rx.metrics.snapshot()["frames_rejected"] == 0
    for _ in range(200):
        if got:
            break
        threading.Event().wait(0.01)
    assert got == [data.tobytes()]


def test_tcp_payloads_up_to_4_MiB_are_digested_by_the_submitting_thread(monkeypatch, make_endpoint):
    """Without side threads, the submitting thread digests a tcp trailer payload of up to
    _SUBMIT_DIGEST_MAX bytes (overlapping the sender thread's copies); larger ones are digested
    by the sender thread right before their sendmsg. Either way the receiver accepts them."""
    from transport import connection
    threads = []

    def recording(*parts):
        threads.append((threading.current_thread().name, sum(len(p) for p in parts)))
        return trailer_digest(*parts)

    monkeypatch.setattr(connection, "trailer_digest", recording)
    rx = make_endpoint("rx", checksum_offload=False)
    region = np.zeros(connection._SUBMIT_DIGEST_MAX + 4096, np.uint8)
    rx.register("r", region)
    peer = make_endpoint("tx", checksum_offload=False).connect(rx.listen())
    rng = np.random.default_rng(7)
    for nbytes, where in [(1 << 20, threading.current_thread().name),
                          (connection._SUBMIT_DIGEST_MAX, threading.current_thread().name),
                          (connection._SUBMIT_DIGEST_MAX + 1, "jkvt-tx-")]:
        threads.clear()
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        peer.write("r", 0, data).wait(30)
        assert np.array_equal(region[:nbytes], data)
        assert [(name.startswith(where), n) for name, n in threads] == [(True, nbytes)], threads
    assert rx.metrics.snapshot()["frames_rejected"] == 0


def test_trailer_is_standard_xxh3_64():
    """The trailer is plain XXH3-64 (seed 0), so any xxhash implementation can check it."""
    assert trailer_digest(b"") == 0x2D06800538D394C2
    assert trailer_digest(b"abc") == 0x78AF5F94892F3950
    assert trailer_digest(b"a", b"", b"bc") == trailer_digest(b"abc")  # parts are one stream


def test_checksum_worker_matches_the_digest_of_the_pieces_in_order():
    worker = ChecksumWorker("jkvt-crc-test")
    try:
        data = np.random.default_rng(0).bytes(1 << 20)
        running = worker.begin()
        for start in range(0, len(data), 70_001):
            running.add(memoryview(data)[start:start + 70_001])
        assert running.result() == trailer_digest(data)
        assert worker.begin().result() == trailer_digest(b"")  # an empty payload
    finally:
        worker.close()
    assert not [t for t in threading.enumerate() if t.name == "jkvt-crc-test"]


def test_split_tail_keeps_every_byte_in_order():
    parts = [memoryview(b"abc"), memoryview(b"defgh"), memoryview(b"ij")]
    for tail in range(0, 11):
        head, back = _split_tail(parts, tail)
        assert b"".join(bytes(p) for p in back) == b"abcdefghij"[10 - tail:]
        assert b"".join(bytes(p) for p in head + back) == b"abcdefghij"


def test_owner_steals_pieces_the_side_thread_has_not_reached():
    """With the side thread never scheduled (here: never started), result() still returns: the
    owner checksums every piece itself."""
    worker = ChecksumWorker("jkvt-crc-idle")
    worker._thread = threading.current_thread()  # pretend it runs; nothing consumes the queue
    data = np.random.default_rng(1).bytes(3 << 20)
    running = worker.begin()
    running.add(data)
    assert running.result() == trailer_digest(data)
    worker._thread = None


@pytest.mark.parametrize("cpus, offload", [(1, False), (2, False), (3, False), (4, True), (16, True)])
def test_checksums_go_to_side_threads_only_with_cores_to_spare(monkeypatch, make_endpoint, cpus, offload):
    monkeypatch.setattr(checksum.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert checksum.offload_default() is offload
    assert make_endpoint("auto").checksum_offload is offload
    assert make_endpoint("forced", checksum_offload=not offload).checksum_offload is (not offload)
