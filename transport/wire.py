"""Wire format shared by the ``tcp`` and ``shm`` backends (and the RDMA control channel).

Every message is a fixed 52-byte little-endian header, optionally followed by ``length``
payload bytes on the same stream (``shm`` WRITE payloads live in a shared ring instead and
the header's ``aux`` field says where)::

    offset size field
    0      4    magic        b"JKVT"
    4      1    version      3 (2: 4-byte crc32c trailers; 1: the handshake before the client proved first)
    5      1    op           Op
    6      2    flags        FLAG_*
    8      4    region       region id (WRITE) / 0
    12     8    seq          sender's frame sequence number, +1 per frame, starts at 1
    20     8    offset       destination byte offset inside the region (WRITE)
    28     8    length       payload length in bytes
    36     8    aux          WRITE over shm: ring position; ACK/REPLY/ERROR: referenced seq;
                             CREDIT: bytes consumed from the ring (monotonic)
    44     4    payload_crc  crc32c of the payload bytes (0 with FLAG_TRAILER or FLAG_NOCRC)
    48     4    header_crc   crc32c of bytes 0..47

With ``FLAG_TRAILER`` the payload's XXH3-64 digest (seed 0) follows the payload on the stream as
an 8-byte little-endian trailer instead of a crc32c in the header, so a sender can put the first
payload byte on the wire before the digest is computed (large payloads; :mod:`transport.checksum`
can compute it on a side thread while the socket copies). The trailer is covered by nothing but
itself: a flipped trailer bit is a mismatch like a flipped payload bit.

Why XXH3-64 for the large payloads: on a box where sender and receiver each keep a core busy with
socket copies, the checksum's own CPU is what the link loses. crc32c (SSE4.2) runs ~30 GB/s per
core here, XXH3 (AVX2/AVX-512) ~90-120 GB/s on the same cache-resident pieces, with a 64-bit value
(a random corruption passes with probability 2^-64 instead of 2^-32). zstd frames carry XXH64 for
the same job. Small payloads and headers keep crc32c (its cost there is per call, not per byte).

The header checksum is verified before anything else is looked at, so random bytes never
get as far as a region lookup. Decoding is pure: :func:`decode_header` either returns a
:class:`Header` or raises :class:`~transport.errors.FrameError` naming what was wrong.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import crc32c as _crc32c
import xxhash

from transport.errors import FrameError

MAGIC = b"JKVT"
VERSION = 3  # 3: XXH3-64 trailers; 2: the client proves the secret first (transport.auth)
_HEADER = struct.Struct("<4sBBHIQQQQII")
HEADER_SIZE = _HEADER.size  # 52
_CRC_SPAN = HEADER_SIZE - 4

FLAG_ACK = 0x1  # receiver acknowledges this frame once it (and every earlier frame) is applied
FLAG_ERR = 0x2  # REPLY carries an error message instead of a result
FLAG_NOCRC = 0x4  # WRITE payload carries no checksum (sender has payload_checksum=False)
FLAG_TRAILER = 0x8  # the payload's XXH3-64 follows the payload as an 8-byte trailer (header field 0)
FLAG_ALL = FLAG_ACK | FLAG_ERR | FLAG_NOCRC | FLAG_TRAILER
TRAILER = struct.Struct("<Q")
TRAILER_SIZE = TRAILER.size  # 8


class Op(enum.IntEnum):
    HELLO = 1  # handshake: client nonce + backend + name
    CHALLENGE = 2  # handshake: server nonce + name (nothing keyed by the secret)
    AUTH = 3  # handshake: client proof (+ shm ring name)
    WELCOME = 4  # handshake: accepted: server proof (+ shm ring name)
    WRITE = 10  # one-sided write into a registered region
    CALL = 11  # two-sided RPC request: u16 method length, method, payload
    REPLY = 12  # RPC reply (aux = request seq)
    NOTIFY = 13  # small control message: u16 kind length, kind, payload
    ACK = 14  # aux = acknowledged seq
    ERROR = 15  # receiver rejected a frame; payload = reason; connection closes after it
    PING = 16  # heartbeat
    CREDIT = 17  # shm: ring bytes consumed (aux)


HANDSHAKE_OPS = frozenset({Op.HELLO, Op.CHALLENGE, Op.AUTH, Op.WELCOME, Op.ERROR})


def crc32c(data, value: int = 0) -> int:
    """crc32c (Castagnoli) of a bytes-like object, continuing from ``value``; hardware
    accelerated where available."""
    return _crc32c.crc32c(data, value)


def trailer_hasher():
    """A streaming XXH3-64 state (seed 0) for a ``FLAG_TRAILER`` payload: ``update`` it with the
    payload's bytes in order (any split gives the same value), then ``intdigest()``."""
    return xxhash.xxh3_64()


def trailer_digest(*parts) -> int:
    """The ``FLAG_TRAILER`` value of a payload given as one or more bytes-like parts, in order."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


@dataclass(frozen=True, slots=True)
class Header:
    op: Op
    flags: int = 0
    region: int = 0
    seq: int = 0
    offset: int = 0
    length: int = 0
    aux: int = 0
    payload_crc: int = 0


def encode_header(h: Header) -> bytes:
    """Pack ``h`` into 52 bytes, computing the header checksum."""
    body = _HEADER.pack(MAGIC, VERSION, int(h.op), h.flags, h.region, h.seq, h.offset,
                        h.length, h.aux, h.payload_crc, 0)[:_CRC_SPAN]
    return body + struct.pack("<I", crc32c(body))


def decode_header(buf) -> Header:
    """Parse and validate 52 header bytes. Raises FrameError naming the first problem."""
    if len(buf) != HEADER_SIZE:
        raise FrameError(f"header is {len(buf)} bytes, expected {HEADER_SIZE}")
    (magic, version, op, flags, region, seq, offset, length, aux, payload_crc,
     header_crc) = _HEADER.unpack(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a jkv transport peer")
    if version != VERSION:
        raise FrameError(f"protocol version {version} not supported (this side speaks {VERSION})")
    if crc32c(memoryview(buf)[:_CRC_SPAN]) != header_crc:
        raise FrameError("header checksum mismatch")
    try:
        op = Op(op)
    except ValueError:
        raise FrameError(f"unknown op code {op}") from None
    if flags & ~FLAG_ALL:
        raise FrameError(f"unknown flag bits {flags:#x}")
    return Header(op, flags, region, seq, offset, length, aux, payload_crc)


def pack_named(name: str, payload=b"") -> list:
    """CALL/NOTIFY payload: u16 name length, utf-8 name, then the payload (returned as parts)."""
    raw = name.encode()
    if not 0 < len(raw) < 65536:
        raise ValueError(f"name {name!r} must be 1..65535 utf-8 bytes")
    return [struct.pack("<H", len(raw)) + raw, payload]


def unpack_named(payload: memoryview) -> tuple[str, memoryview]:
    """Inverse of :func:`pack_named`. Raises FrameError on a malformed payload."""
    if len(payload) < 2:
        raise FrameError(f"named payload of {len(payload)} bytes has no name length")
    (n,) = struct.unpack_from("<H", payload)
    if n == 0 or 2 + n > len(payload):
        raise FrameError(f"name length {n} does not fit a {len(payload)}-byte payload")
    try:
        name = bytes(payload[2:2 + n]).decode()
    except UnicodeDecodeError:
        raise FrameError("name is not valid utf-8") from None
    return name, payload[2 + n:]
