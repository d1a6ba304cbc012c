"""Wire format: header round trip, corruption detection, and fuzzing of the receive path.

The fuzz tests push random and adversarial byte streams through a real Connection (a
socketpair adopted by an Endpoint) into a region surrounded by canary bytes, then check
that nothing outside the region changed, that bytes inside it changed only where an
in-bounds WRITE header pointed, and that the endpoint still serves a normal peer.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import FrameError
from transport.wire import (FLAG_ACK, FLAG_ERR, HEADER_SIZE, VERSION, Header, Op, crc32c, decode_header,
                            encode_header, pack_named, unpack_named)

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@given(op=st.sampled_from(list(Op)), flags=st.sampled_from([0, FLAG_ACK, FLAG_ERR, FLAG_ACK | FLAG_ERR]),
       region=U32, seq=U64, offset=U64, length=U64, aux=U64, crc=U32)
@settings(max_examples=200, deadline=None)
def test_header_round_trip(op, flags, region, seq, offset, length, aux, crc):
    h = Header(op, flags, region, seq, offset, length, aux, crc)
    raw = encode_header(h)
    assert len(raw) == HEADER_SIZE == 52
    assert decode_header(raw) == h


def test_every_bit_flip_is_rejected():
    raw = bytearray(encode_header(Header(Op.WRITE, FLAG_ACK, 3, 17, 4096, 65536, 0, 0xDEADBEEF)))
    for bit in range(len(raw) * 8):
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError):
            decode_header(bytes(bad))


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "version"),
    (lambda b: b[:51], "expected 52"),
])
def test_header_errors_name_the_problem(mutate, match):
    raw = encode_header(Header(Op.PING, 0, 0, 1))
    with pytest.raises(FrameError, match=match):
        decode_header(mutate(raw))


def test_unknown_op_and_flags_rejected_even_with_valid_checksum():
    import struct
    for op, flags, match in ((99, 0, "unknown op"), (int(Op.PING), 0x80, "flag")):
        body = struct.pack("<4sBBHIQQQQI", b"JKVT", VERSION, op, flags, 0, 1, 0, 0, 0, 0)
        with pytest.raises(FrameError, match=match):
            decode_header(body + struct.pack("<I", crc32c(body)))


@given(name=st.text(min_size=1, max_size=40), payload=st.binary(max_size=64))
@settings(max_examples=100, deadline=None)
def test_named_payload_round_trip(name, payload):
    raw = b"".join(bytes(p) for p in pack_named(name, payload))
    got_name, got_payload = unpack_named(memoryview(raw))
    assert got_name == name and bytes(got_payload) == payload


@pytest.mark.parametrize("raw", [b"", b"\x01", b"\x05\x00ab", b"\x00\x00x", b"\x02\x00\xff\xfe"])
def test_malformed_named_payload_rejected(raw):
    with pytest.raises(FrameError):
        unpack_named(memoryview(raw))


# ---------------------------------------------------------------- receive-path fuzzing
CANARY, REGION = 4096, 4096


class Target:
    """An endpoint with one region inside a canary-guarded buffer."""

    def __init__(self, make_endpoint):
        self.ep = make_endpoint("rx", max_message=1 << 16)
        self.ep.serve("echo", lambda peer, payload: bytes(payload))
        self.buf = np.full(CANARY + REGION + CANARY, 0xAA, np.uint8)
        self.region = self.ep.register("r", self.buf[CANARY:CANARY + REGION])
        self.n = 0

    def feed(self, data: bytes) -> None:
        self.buf[:] = 0xAA
        self.n += 1
        ours, theirs = socket.socketpair()
        peer = self.ep._adopt(theirs, f"fuzzer-{self.n}")
        try:
            ours.sendall(data)
            ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the endpoint rejected the stream and closed while we were still sending
        peer._conn.join(10)
        assert not peer._conn._reader.is_alive()
        ours.close()

    def changed(self) -> np.ndarray:
        return np.flatnonzero(self.buf != 0xAA)


def _frame(op, seq, region=1, offset=0, length=None, payload=b"", crc=None, flags=0, aux=0,
           truncate=None):
    length = len(payload) if length is None else length
    crc = crc32c(payload) if crc is None else crc
    raw = encode_header(Header(op, flags, region, seq, offset, length, aux, crc)) + payload
    return raw if truncate is None else raw[:truncate]


@st.composite
def adversarial_frames(draw):
    frames, allowed, seq = [], [], 1
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from([Op.WRITE] * 4 + list(Op)))
        region = draw(st.sampled_from([1, 1, 1, 0, 2, 2**32 - 1]))
        offset = draw(st.one_of(st.integers(0, REGION), st.integers(REGION - 64, REGION + 64),
                                st.just(2**63), U64))
        size = draw(st.integers(0, 300))
        payload = bytes([draw(st.integers(0, 0xA9))]) * size  # never the canary value
        length = draw(st.one_of(st.just(size), st.just(size), U64, st.integers(0, 1 << 20)))
        crc = draw(st.one_of(st.none(), st.none(), U32))
        s = draw(st.one_of(st.just(seq), st.just(seq), U64))
        truncate = draw(st.one_of(st.none(), st.none(), st.integers(0, HEADER_SIZE + size)))
        frames.append(_frame(op, s, region, offset, length, payload, crc,
                             flags=draw(st.sampled_from([0, FLAG_ACK])),
                             aux=draw(st.sampled_from([0, 1, 2**64 - 1])), truncate=truncate))
        if op == Op.WRITE and region == 1 and offset + length <= REGION:
            allowed.append((offset, offset + length))
        seq += 1
    return b"".join(frames), allowed


def test_fuzz_receive_path_random_bytes(make_endpoint):
    target = Target(make_endpoint)

    @given(data=st.one_of(st.binary(max_size=400),
                          st.builds(lambda tail: encode_header(Header(Op.WRITE, 0, 1, 1, 0, 64, 0, 0))[:-4] + tail,
                                    st.binary(min_size=4, max_size=80))))
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def run(data):
        target.feed(data)
        assert target.changed().size == 0  # random bytes never pass the header checksum

    run()
    assert target.ep.metrics.snapshot()["frames_rejected"] > 0
    _still_serves(target.ep, make_endpoint)


def test_fuzz_receive_path_adversarial_frames(make_endpoint):
    target = Target(make_endpoint)

    @given(case=adversarial_frames())
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    def run(case):
        data, allowed = case
        target.feed(data)
        changed = target.changed()
        assert ((changed >= CANARY) & (changed < CANARY + REGION)).all(), "wrote outside the region"
        for pos in changed - CANARY:
            assert any(lo <= pos < hi for lo, hi in allowed), f"byte {pos} written without a valid header"

    run()
    _still_serves(target.ep, make_endpoint)


def _still_serves(ep, make_endpoint):
    address = ep.listen()
    peer = make_endpoint("client").connect(address)
    assert peer.call("echo", b"alive") == b"alive"
    peer.write("r", 0, b"\x01" * REGION).wait(5)


def test_out_of_bounds_and_unknown_region_frames_write_nothing(make_endpoint):
    target = Target(make_endpoint)
    payload = b"\x11" * 64
    cases = [
        _frame(Op.WRITE, 1, 1, REGION - 32, payload=payload),  # straddles the end
        _frame(Op.WRITE, 1, 1, 2**64 - 16, payload=payload),  # offset wraps in C, not here
        _frame(Op.WRITE, 1, 7, 0, payload=payload),  # unknown region id
        _frame(Op.WRITE, 1, 1, 0, length=1 << 40, payload=payload),  # oversized
        _frame(Op.CALL, 1, 0, 0, length=1 << 30),  # bigger than max_message
        _frame(Op.WRITE, 2, 1, 0, payload=payload),  # sequence gap
    ]
    for raw in cases:
        target.feed(raw)
        assert target.changed().size == 0
    assert target.ep.metrics.snapshot()["frames_rejected"] == len(cases)


def test_bad_payload_checksum_is_not_acknowledged_and_stops_the_stream(make_endpoint):
    """Zero-copy receive lands the bytes, but the frame is not acked and later frames
    (the block's mask) are never applied."""
    target = Target(make_endpoint)
    block = b"\x22" * 128
    data = (_frame(Op.WRITE, 1, 1, 0, payload=block, crc=crc32c(block) ^ 1)
            + _frame(Op.WRITE, 2, 1, 1000, payload=b"\x01"))  # the "mask" after the block
    target.feed(data)
    changed = target.changed() - CANARY
    assert changed.min() >= 0 and changed.max() < 128  # the mask byte at 1000 was not applied
    assert target.ep.metrics.snapshot()["frames_rejected"] == 1
