"""Rows of a request's KV pool: where they live (byte layout) and how they travel on demand.

Pool layout (one request, decode side; DESIGN.md "KV geometry"):

    kv:   f32[2, L, H_kv, N_cap, D]   row (kv, layer, head, token) at byte `kv_offset(...)`
    mask: i8[L, N_cap]                 byte (layer, token) at `mask_offset(...)`

The prefill worker addresses the decode side's pool with these offsets when it pushes blocks
(it has no `RequestKV` of that capacity), and `RequestKV.offset` is the same formula. A pushed
block holds one KV-head slice [start, stop) of a layer (jkv/disagg/head_slices.py); `check_heads`
validates the range before its rows are written.

The on-demand "fetch" RPC (SmartGen §4.2, Algorithm 1), decode -> prefill:

    request  jkv.framing frame {"layer", "seq", "items": [[rid, [count per KV head]], ...]}
             + i32 positions: for each item, for each head, its `count` token positions; "seq"
             numbers the call (unique in the decode process) so the decode side can later confirm
             which replies it kept (jkv/disagg/served_rows.py)
    reply    K rows f32[sum counts, D] then V rows f32[sum counts, D], in request order
    framed   (the request's header says "framed": 1; only decode workers with compression on ask)
             jkv.framing frame {"parts": [bytes per item]} + one checksummed container per item
             (request) holding its K and V rows, each encoded as that request's on-demand path
             chose (`jkv.compression.paths`: float32, exact float16, or a row-granular pipeline)

Builders: `FetchCall` (decode worker's synchronous lane and the layer lookahead, one per owner),
`parse_fetch` + `pack_reply` (prefill worker), `reply_rows` + `keep_rows` (decode side, after the
reply). Pure numpy; no JAX, no transport.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jkv.framing import pack, unpack


def kv_offset(num_layers: int, num_kv_heads: int, capacity: int, head_dim: int, kv: int, layer: int, head: int,
              token: int, itemsize: int = 4) -> int:
    """Byte offset of pool[kv, layer, head, token, 0] in a flat [2, L, H_kv, N_cap, D] buffer."""
    return ((((kv * num_layers + layer) * num_kv_heads + head) * capacity + token) * head_dim) * itemsize


def mask_offset(capacity: int, layer: int, token: int) -> int:
    """Byte offset of mask[layer, token] in a flat i8[L, N_cap] mask."""
    return layer * capacity + token


def check_heads(heads, num_kv_heads: int) -> None:
    """A block's KV-head range [start, stop) in the model's global head order must be a non-empty
    part of [0, H_kv); raises ValueError naming it (before any of its rows is written)."""
    try:
        start, stop = (int(h) for h in heads)
    except (TypeError, ValueError):
        raise ValueError(f"KV-head range {heads!r} must be a (start, stop) pair of ints") from None
    if not 0 <= start < stop <= num_kv_heads:
        raise ValueError(f"KV-head range [{start}, {stop}) is outside the model's {num_kv_heads} KV heads: "
                         f"a slice needs 0 <= start < stop <= {num_kv_heads}")


_call_numbers = itertools.count(1)  # FetchCall.seq: next() is atomic in CPython (calls start on several threads)


@dataclasses.dataclass
class FetchCall:
    """One "fetch" RPC being built: `add` each request's per-head positions, then `payload()`.

    segments: (key, positions i32[c]) per non-empty (request, head), in the order the reply's
    rows come back; `key` is whatever the caller needs to place them (a row id, a (b, h) pair).
    """

    layer: int
    items: list = dataclasses.field(default_factory=list)  # [rid, [count per KV head]]
    segments: list = dataclasses.field(default_factory=list)
    segment_items: list = dataclasses.field(default_factory=list)  # the item index of each segment
    framed: bool = False  # ask for a framed reply (one container per item)
    seq: int = dataclasses.field(default_factory=lambda: next(_call_numbers))  # names this call in a "spec" ack

    def add(self, rid: str, per_head: list, framed: bool = False) -> None:
        """per_head: one (key, positions i32[c]) per KV head, head order (c may be 0). framed: this
        request's on-demand rows may travel compressed (the whole call then gets a framed reply)."""
        self.items.append([rid, [int(len(p)) for _, p in per_head]])
        self.segments.extend((key, p) for key, p in per_head if len(p))
        self.segment_items.extend(len(self.items) - 1 for _, p in per_head if len(p))
        self.framed = self.framed or framed

    @property
    def rows(self) -> int:
        """Positions asked for (rows of K, and as many of V, in the reply)."""
        return sum(int(len(p)) for _, p in self.segments)

    def payload(self) -> bytes:
        positions = [np.asarray(p, np.int32) for _, p in self.segments]
        return pack(dict(layer=self.layer, seq=self.seq, items=self.items, **({"framed": 1} if self.framed else {})),
                    np.concatenate(positions) if positions else np.zeros(0, np.int32))


def parse_fetch(payload) -> tuple[int, list[tuple[str, list[np.ndarray]]]]:
    """Prefill side: a "fetch" payload -> (layer, [(rid, [positions i32[c] per KV head])])."""
    layer, out, _, _ = parse_fetch_framed(payload)
    return layer, out


def parse_fetch_framed(payload) -> tuple[int, list[tuple[str, list[np.ndarray]]], bool, int | None]:
    """`parse_fetch` plus whether the caller asked for a framed reply and the call's seq (None: a
    caller that numbers no calls)."""
    header, raw = unpack(payload)
    positions = np.frombuffer(raw, np.int32)
    out, at = [], 0
    for rid, counts in header["items"]:
        heads = []
        for c in counts:
            heads.append(positions[at:at + c])
            at += c
        out.append((rid, heads))
    seq = header.get("seq")
    return int(header["layer"]), out, bool(header.get("framed")), None if seq is None else int(seq)


def pack_reply(k_rows: list[np.ndarray], v_rows: list[np.ndarray]) -> bytes:
    """Prefill side: the K rows (each f32[c, D]) then the V rows, in request order."""
    if not k_rows:
        return b""
    return np.concatenate([np.concatenate(k_rows), np.concatenate(v_rows)]).tobytes()


def reply_rows(data, rows: int, head_dim: int, source: str) -> np.ndarray:
    """Decode side: a reply of `rows` positions -> f32[2, rows, D] (K, V). source names the
    reply in the error ("fetch reply from 'prefill-0'"). Raises RuntimeError on a wrong size."""
    reply = np.frombuffer(data, np.float32)
    if reply.size != 2 * rows * head_dim:
        raise RuntimeError(f"{source} has {reply.size} floats, expected {2 * rows * head_dim}")
    return reply.reshape(2, rows, head_dim)


def read_reply(data, call: FetchCall, head_dim: int, source: str, decode_part=None) -> tuple[np.ndarray, dict]:
    """Decode side: a `call`'s reply -> (f32[2, call.rows, D], {item index: why it was rejected}).

    A plain reply is `reply_rows`. A framed one is decoded item by item with
    `decode_part(part bytes, rows, head_dim) -> f32[2, rows, D]` (`jkv.compression.paths.decode_rows`);
    an item whose part does not decode (`ValueError`: a checksum mismatch, a wrong shape) leaves its
    rows zero and is reported, so only its request fails. Raises RuntimeError on a malformed frame."""
    if not call.framed:
        return reply_rows(data, call.rows, head_dim, source), {}
    try:
        header, body = unpack(data)
        sizes = [int(n) for n in header["parts"]]
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{source}: malformed framed reply ({e})") from None
    if len(sizes) != len(call.items) or sum(sizes) != len(body) or min(sizes, default=0) < 0:
        raise RuntimeError(f"{source}: framed reply has parts {sizes} ({len(body)} bytes) for {len(call.items)} items")
    out = np.zeros((2, call.rows, head_dim), np.float32)
    failed, at, row = {}, 0, 0
    for i, ((_, counts), size) in enumerate(zip(call.items, sizes)):
        n = int(sum(counts))
        try:
            out[:, row:row + n] = decode_part(bytes(body[at:at + size]), n, head_dim)
        except ValueError as e:
            failed[i] = f"{source}: rejected on-demand rows ({e})"
        at, row = at + size, row + n
    return out, failed


def iter_reply(reply: np.ndarray, segments):
    """(key, positions, K f32[c, D], V f32[c, D]) per segment of a `FetchCall`'s reply."""
    at = 0
    for key, positions in segments:
        c = int(len(positions))
        yield key, positions, reply[0, at:at + c], reply[1, at:at + c]
        at += c


def keep_rows(request, layer: int, head: int, positions, k, v, seq: int | None = None) -> bool:
    """Store fetched rows in a decode-side request's pool and mark them fetched (KV reuse:
    identical bytes to what a later block write brings). request: has `kv` (a RequestKV: `kv`
    f32[2, L, H_kv, N_cap, D]), `fetched` bool[L, H_kv, N_cap] and a `fetch_bytes` counter.
    seq: the `FetchCall.seq` of the reply; noted in `request.kept_fetches` (when that is not None:
    a request with speculation) once the rows are written, so the next "spec" tells the owner its
    rows need no push (jkv/disagg/served_rows.py). False (nothing written, nothing noted; counted by
    the pool) when the request's buffers were freed meanwhile."""
    if not request.kv.take_write():
        return False
    request.kv.kv[0, layer, head, positions] = k
    request.kv.kv[1, layer, head, positions] = v
    request.fetched[layer, head, positions] = True
    request.fetch_bytes += 2 * int(len(positions)) * k.shape[-1] * 4
    if seq is not None and request.kept_fetches is not None:
        request.kept_fetches.add(int(seq))
    return True
