"""KV-head slices: the prefill side moves each layer's K, V by the KV heads its shards hold.

A slice is a contiguous range [start, stop) of KV heads in the model's global head order (the
handshake's head_order="global", jkv/disagg/handshake.py): head h of a slice is the model's head h
on both sides, whatever their tensor-parallel degrees.

Export (`export_layer`, prefill main thread, as each layer finishes): every distinct addressable
shard of the layer's K and V (`jax.Array.addressable_shards`; a head range held by several shards,
i.e. replicated KV heads, is copied once) starts its own device-to-host copy, and each lands in its
head range of the request's host pool `f32[2, L, H_kv, N, D]`. No device gathers the layer and
no whole-layer host array is assembled first (which `np.asarray` of a sharded array does); in a
multi-process replica a process would copy only the shards it holds.

Push (`push_slices`): one block per (layer, head slice) as the prefill's layout splits the heads
(`head_slices`: one slice at TP 1 or with replicated KV heads, each head sent once), one
`write_many` each on the bulk connection. Per token run a slice's items are K rows of its heads,
then V rows; the run's mask bytes (LOCAL) ride on the last slice only, after its rows. The bulk
connection is one ordered stream, so every head of a row has landed on the decode side before its
mask byte does: a 1 still means "safe to read". A speculative push leaves out the rows the decode
side confirmed it kept from on-demand replies (jkv/disagg/served_rows.py); the run's mask bytes
still come last, alone when none of its rows is left to write. Every slice is checked against
H_kv before the first write, so a malformed head range writes nothing.

The decode side (jkv/disagg/decode_pages.py) receives the rows in its host staging buffer and lands
each into the decode shard that holds its head: a slice may span two decode shards or be part of
one, its landing program scatters by head either way.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from jkv.disagg import protocol as proto
from jkv.disagg.served_rows import missing_spans
from jkv.kvbuffers.fetch import check_heads, kv_offset, mask_offset
from jkv.kvbuffers.geometry import LOCAL
from transport import Mask, WriteItem


@dataclasses.dataclass
class ExportCounters:
    """What a prefill worker moved by slice (read by tests and observers; thread-safe to count).
    copies: device-to-host copies of K or V shards; layers: layers exported; blocks: pushed
    blocks (one write_many each) per head slice; held: pushes in which a slice wrote no KV row
    (at most the mask bytes), the decode side holding every row of it (jkv/disagg/served_rows.py)."""

    slices: tuple
    copies: int = 0
    layers: int = 0
    blocks: dict = dataclasses.field(default_factory=dict)
    held: dict = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.blocks = {heads: 0 for heads in self.slices}
        self.held = {heads: 0 for heads in self.slices}

    def exported(self, copies: int) -> None:
        with self._lock:
            self.copies += copies
            self.layers += 1

    def pushed(self, heads) -> None:
        with self._lock:
            self.blocks[heads] += 1

    def held_only(self, heads) -> None:
        with self._lock:
            self.held[heads] += 1

    def snapshot(self) -> dict:
        with self._lock:
            blocks = {f"{a}:{b}": n for (a, b), n in self.blocks.items()}
            held = {f"{a}:{b}": n for (a, b), n in self.held.items()}
            return dict(copies=self.copies, layers=self.layers, blocks=blocks, held=held)


def head_slices(sharding, num_kv_heads: int) -> tuple[tuple[int, int], ...]:
    """The distinct KV-head ranges of a KV sharding (`Model.kv_sharding`: heads on axis 1;
    None: one device), sorted: ((0, H_kv),) when the heads are not split (TP 1, replicated KV)."""
    if sharding is None:
        return ((0, num_kv_heads),)
    ranges = set()
    for index in sharding.devices_indices_map((1, num_kv_heads, 1, 1)).values():
        start, stop, _ = index[1].indices(num_kv_heads)
        ranges.add((start, stop))
    out = tuple(sorted(ranges))
    starts = [a for a, _ in out]
    assert starts == sorted(set(starts)) and out[0][0] == 0 and out[-1][1] == num_kv_heads, out
    return out


def check_slices(slices, num_kv_heads: int) -> None:
    """Each slice a valid KV-head range (`check_heads`), together covering each head once; raises
    ValueError naming them."""
    for heads in slices:
        check_heads(heads, num_kv_heads)
    if sorted(h for heads in slices for h in range(*heads)) != list(range(num_kv_heads)):
        raise ValueError(f"head slices {list(slices)} must cover each of the {num_kv_heads} KV heads once")


def format_slices(slices) -> str:
    """The handshake's kv_head_slices field, e.g. "0:1,1:2"."""
    return ",".join(f"{a}:{b}" for a, b in slices)


def parse_slices(text: str, num_kv_heads: int) -> tuple[tuple[int, int], ...]:
    """The inverse of `format_slices`, checked (`check_slices`) against num_kv_heads."""
    try:
        slices = tuple(tuple(int(x) for x in part.split(":")) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"kv_head_slices={text!r} is not a list of start:stop KV-head ranges") from None
    check_slices(slices, num_kv_heads)
    return slices


def _shards(x) -> list:
    """x's addressable shards, one per distinct index (a replicated range once)."""
    distinct = {}
    for shard in x.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        distinct.setdefault(key, shard)
    return list(distinct.values())


def export_layer(kv_pair, dests: list[np.ndarray], lengths) -> int:
    """Copy one layer's K, V into the requests' host pools, shard by shard.

    kv_pair: (K, V), each a jax.Array [B, H_kv, T, D] in any sharding; dests[b]: request b's
    layer f32[2, H_kv, N_b, D] (written in place, tokens [0, lengths[b])). Returns the number of
    device-to-host copies made (one per distinct shard of K and of V)."""
    shards = [(kv, shard) for kv, x in enumerate(kv_pair) for shard in _shards(x)]
    for _, shard in shards:  # start every copy before waiting on any
        shard.data.copy_to_host_async()
    for kv, shard in shards:
        rows = np.asarray(shard.data)  # [B_s, H_s, T_s, D] of this shard's index
        b_index, heads, t_index = shard.index[:3]
        b0, t0 = b_index.start or 0, t_index.start or 0
        for i in range(rows.shape[0]):
            stop = min(t0 + rows.shape[2], int(lengths[b0 + i]))
            if stop > t0:
                dests[b0 + i][kv, heads, t0:stop] = rows[i, :, :stop - t0]
    return len(shards)


def slice_items(rid: str, kv: np.ndarray, capacity: int, layer: int, heads: tuple[int, int], runs,
                with_mask: bool, held: np.ndarray | None = None) -> list[WriteItem]:
    """The write items of one block (layer, head slice) into the decode side's pool of `capacity`
    tokens: per token run [start, stop), K rows of heads [heads), then V rows; with_mask: the run's
    mask bytes after its last row. kv: the prefill's pool f32[2, L, H_kv, N, D]. held: bool[H_kv, N]
    rows of `layer` the decode side confirmed it keeps (jkv/disagg/served_rows.py): left out; a
    run with none of this slice's rows to write still gets its mask bytes (alone)."""
    _, L, H, _, D = kv.shape
    check_heads(heads, H)
    region, mregion = proto.kv_region(rid), proto.mask_region(rid)
    items = []
    for start, stop in runs:
        spans = [(k, head, a, b) for k in (0, 1) for head in range(*heads)
                 for a, b in missing_spans(held, head, start, stop)]
        mask = Mask(mregion, mask_offset(capacity, layer, start), bytes([LOCAL]) * (stop - start)) if with_mask else None
        for i, (k, head, a, b) in enumerate(spans):
            items.append(WriteItem(region, kv_offset(L, H, capacity, D, k, layer, head, a), kv[k, layer, head, a:b],
                                   mask if i == len(spans) - 1 else None))
        if mask is not None and not spans:  # every row is held: the ordered stream puts the byte after them
            items.append(WriteItem(mregion, mask.offset, np.full(stop - start, LOCAL, np.int8)))
    return items


def push_slices(peer, rid: str, kv: np.ndarray, capacity: int, layer: int, runs, slices, held=None) -> list:
    """One write_many per head slice of `slices` (see the module docstring); every slice is
    validated before the first write. held: see `slice_items`. Returns [(heads, Transfer, KV row
    bytes)] in send order (a mask byte written alone is not KV)."""
    blocks = [(heads, slice_items(rid, kv, capacity, layer, heads, runs, i == len(slices) - 1, held))
              for i, heads in enumerate(slices)]
    check_slices(slices, kv.shape[2])
    region = proto.kv_region(rid)
    return [(heads, peer.write_many(items), sum(item.data.nbytes for item in items if item.region == region))
            for heads, items in blocks if items]
