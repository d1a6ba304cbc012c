"""Wire format of the `jkv pool` server's RPC methods (carried by `transport` CALLs/REPLYs).

Every message is `u32le header_len | header (JSON) | binary tail`. The transport already
authenticates peers and checksums RPC frames; the JSON header only names keys and metadata.

    kvpool.put       header {"key": name, "meta": ChunkMeta}        tail: payload bytes
                     reply  {"stored": bool}
    kvpool.get       header {"keys": [name], "caps": [bytes]}       tail: none
                     reply  {"metas": [ChunkMeta | null | {"too_big": nbytes}]}
                            tail: the hits' payloads, concatenated in key order
    kvpool.contains  header {"keys": [name]}  ->  {"present": [bool]}
    kvpool.delete    header {"key": name}     ->  {"deleted": bool}
    kvpool.stats     header {}                ->  PoolStats fields

`caps[i]` is the caller's buffer size for key i: the server never sends a payload that would
not fit (it answers `too_big`, and the client raises the caller's ValueError), so the reply
fits the staging buffer the client sized as `reply_bound(...)`.
"""
from __future__ import annotations

import dataclasses
import json
import struct

from jkv.kvpool.base import ChunkMeta

PUT, GET, CONTAINS, DELETE, STATS = ("kvpool.put", "kvpool.get", "kvpool.contains",
                                     "kvpool.delete", "kvpool.stats")
METHODS = (PUT, GET, CONTAINS, DELETE, STATS)
_LEN = struct.Struct("<I")
# Upper bound of one metadata entry's JSON besides its key name (nbytes, crc, shape, dtype, ...).
META_JSON_BOUND = 512


def encode(header: dict, tail=b"") -> bytes:
    """`u32 len | JSON header | tail` as one bytes object (tail copied once)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(raw)), raw, tail))


def decode(message) -> tuple[dict, memoryview]:
    """(header, tail view) of a message; ValueError if it is not one."""
    view = memoryview(message).cast("B")
    if view.nbytes < _LEN.size:
        raise ValueError(f"kvpool message of {view.nbytes} bytes is shorter than its length field")
    (n,) = _LEN.unpack_from(view)
    if _LEN.size + n > view.nbytes:
        raise ValueError(f"kvpool header claims {n} bytes but the message holds "
                         f"{view.nbytes - _LEN.size}")
    header = json.loads(bytes(view[_LEN.size:_LEN.size + n]))
    if not isinstance(header, dict):
        raise ValueError(f"kvpool header must be a JSON object, got {type(header).__name__}")
    return header, view[_LEN.size + n:]


def meta_to_dict(meta: ChunkMeta) -> dict:
    return dataclasses.asdict(meta)


def meta_from_dict(fields: dict) -> ChunkMeta:
    fields = dict(fields)
    fields["shape"] = tuple(fields["shape"])
    return ChunkMeta(**fields)


def reply_bound(names: list[str], caps: list[int]) -> int:
    """Largest `kvpool.get` reply for these keys and buffer sizes (for the staging buffer)."""
    return (_LEN.size + 64 + sum(caps)
            + sum(6 * len(n) + META_JSON_BOUND for n in names))  # \uXXXX escapes
