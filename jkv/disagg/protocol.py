"""Control-plane messages between the decode worker and its prefill workers.

PROTOCOL_VERSION numbers this message set; the two roles compare it (with the rest of their
configuration, jkv/disagg/handshake.py) in the transport handshake before any message crosses.

Every message is a small JSON header, optionally followed by raw array bytes:

    frame = u32 header_len | header JSON | payload bytes

decode -> prefill
  notify "prefill"  {"requests": [{rid, tokens, capacity, order, kr, spec_cap, sampling}]}
                    hand-in of a batch: prompt, sampling params, decode-side capacity and the
                    block plan (order of flat block ids; the first kr go proactively)
  notify "spec"     {"rids": [...]}  speculative trigger at the start of an attention layer
  call   "fetch"    {"layer", "items": [[rid, [count per KV head]]]} + i32 positions
                    -> K rows f32[sum counts, D] then V rows (remote-first, row order);
                    packed, parsed and scattered by jkv.kvbuffers.fetch only
  call   "free"     {"rid"} -> {"bytes": {...}}  decode holds everything / finished / cancelled
prefill -> decode
  notify "meta"     {"rid", "layer", "leaves": [[shape, dtype]]} + leaf bytes (selector metadata)
  notify "handoff"  {"rid", "first_token", "t_first", "prefill_s", "bytes": {...}}
                    (+ "link": {bytes, busy_s}, "compression" when the request named a compression;
                    + "keep": [L, H_kv, N], "keep_crc" and the packed keep table bytes for a token-dropping
                    profile, jkv.compression.dropping)
  notify "ckv"      {"rid", "layer", "chunks": [[start, stop, k_len, v_len]]} + K, V containers per
                    chunk: compressed blocks (jkv.compression.kv_transfer) instead of block writes
                    for a request whose "prefill" entry carries "compression": <pipeline id>; with
                    "drop": 1 a token-dropping profile's chunks (keep bits, then per head group K, V)
  notify "failed"   {"rid", "error"}
  writes into regions "kv/<rid>" (f32[2, L, H_kv, N_cap, D]) then "mask/<rid>" (i8[L, N_cap]):
                    one write_many per (layer, KV-head slice) block of the prefill's layout, the
                    mask bytes after the last slice (jkv/disagg/head_slices.py)
"""
from __future__ import annotations

import numpy as np

from jkv.framing import pack, unpack

PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION", "kv_region", "mask_region", "pack", "unpack", "pack_leaves", "unpack_leaves"]


def kv_region(rid: str) -> str:
    return f"kv/{rid}"


def mask_region(rid: str) -> str:
    return f"mask/{rid}"


def pack_leaves(header: dict, leaves: list[np.ndarray]) -> bytes:
    header = dict(header, leaves=[[list(a.shape), a.dtype.str] for a in leaves])
    return pack(header, *leaves)


def unpack_leaves(header: dict, payload: memoryview) -> list[np.ndarray]:
    out, pos = [], 0
    for shape, dtype in header["leaves"]:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if pos + n > len(payload):
            raise ValueError("metadata payload shorter than its declared leaves")
        out.append(np.frombuffer(payload[pos:pos + n], dt).reshape(shape).copy())
        pos += n
    return out
