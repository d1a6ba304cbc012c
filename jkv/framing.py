"""One framing for every small control message: a JSON header, then raw array bytes.

    frame = u32 header_len (little endian) | header JSON | payload bytes

The SmartGen control plane (`jkv.disagg.protocol`), its on-demand row fetch
(`jkv.kvbuffers.fetch`) and the compressed-KV frames (`jkv.compression.kv_transfer`) all use it;
it depends on nothing in jkv so none of them has to import another's package for it.
"""
from __future__ import annotations

import json
import struct

import numpy as np


def pack(header: dict, *arrays: np.ndarray) -> bytes:
    raw = json.dumps(header).encode()
    return b"".join([struct.pack("<I", len(raw)), raw] + [np.ascontiguousarray(a).tobytes() for a in arrays])


def unpack(data) -> tuple[dict, memoryview]:
    """frame -> (header, payload). Raises ValueError on a frame shorter than its header."""
    mv = memoryview(data).cast("B")
    if len(mv) < 4:
        raise ValueError(f"control message of {len(mv)} bytes is too short")
    (n,) = struct.unpack_from("<I", mv)
    if 4 + n > len(mv):
        raise ValueError(f"control message header length {n} exceeds the message ({len(mv)} bytes)")
    return json.loads(bytes(mv[4:4 + n])), mv[4 + n:]
