"""Token-dropping profiles on the serving path: streaming heads and token tiers over the wire.

Two profile families drop tokens per (layer, KV head) instead of only quantizing them:

    duo<F>s<S>w<R>:<pipeline>              DuoAttention-like (`streaming.py`): the F % of heads with the
                                           lowest observation-window retrieval score keep only S sinks
                                           + R recent tokens; the others keep every token
    tiers:hi<P>:<pipeline>:s<S>w<R>o<W>p<K> SnapKV tiers (`tokens.py`) with one kept tier: per head
                                           the sinks, the recent window and the P % most-attended
                                           middle tokens; the rest are dropped

Both decide from the prefill's own last queries (no future token), so the keep table
`keep: bool[L, H_kv, N]` is computed on the prefill side after the prefill (`DropSpec.keep_mask`,
a replay of the observation window through the model) and sent to the decode worker with the
hand-off (`pack_keep`). The decode worker marks the dropped (layer, head, token) entries DROPPED in
its device KV mask (jkv/kvcache/sparse.py) and removes them from every selection, so each head
attends to exactly its kept prompt tokens plus every generated token. RoPE was applied at the
prefill, so a kept key carries its original position and nothing is re-rotated.

Wire. A request's layer is encoded in the chunks of `kv_transfer.ChunkPlan`; per chunk the keep
bits of every head (`np.packbits` of bool[H_kv, n_chunk]) travel first, then, per *group* of heads
that keep the same number of tokens in the chunk (ascending first head; empty groups send
nothing), the K and V containers of the kept rows [heads_in_group, count, D] in ascending
position. The receiver derives the groups from the bits. Frame header (notify "ckv"):

    {"rid", "layer", "drop": 1, "chunks": [[start, stop, bits_len, bits_crc32, k_len, v_len, k_len, v_len, ...]]}

(the containers carry their own checksums; `bits_crc32` covers the keep bits, so a flipped bit
anywhere in the frame is rejected, never decoded).

The prefill side's copy becomes decode(encode(kept rows)) with the dropped rows zeroed
(`DroppingCodec.absorb`), so proactive, speculative and on-demand rows all carry the same values
and the transfer-mode invariant holds; a dropped row is never selected, so never fetched.

Not servable (refused with the reason): tiers with a lo tier (two pipelines per chunk), and
per-head bit tables (`mixed-`, `mixhq`): the containers hold head subsets. No threads.
"""
from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass

import numpy as np

from jkv.compression.kv_transfer import LOCAL, WIRE_DTYPE, WIRE_ITEMSIZE, RequestCodec
from jkv.compression.pipeline import decode_block
from jkv.compression.spec import PipelineSpec

_DUO = re.compile(r"^duo(\d+)s(\d+)w(\d+):(.+)$")
_TIERS = re.compile(r"^tiers:hi(\d+):([^:]+?)(\+lo\d+:[^:]+)?:s(\d+)w(\d+)o(\d+)p(\d+)$")


@dataclass(frozen=True)
class DropSpec:
    """A parsed token-dropping profile id (see the module docstring). kind: "duo" | "tiers";
    keep_pct: duo: % of heads streaming; tiers: % of middle tokens kept per head."""

    kind: str
    keep_pct: int
    pipeline: str  # the pipeline id of the kept rows
    sink: int
    recent: int
    window: int = 32
    pool: int = 7

    @property
    def id(self) -> str:
        if self.kind == "duo":
            return f"duo{self.keep_pct}s{self.sink}w{self.recent}:{self.pipeline}"
        return f"tiers:hi{self.keep_pct}:{self.pipeline}:s{self.sink}w{self.recent}o{self.window}p{self.pool}"

    def keep_mask(self, model, prompt, kv) -> np.ndarray:
        """bool[L, H_kv, N]: the tokens each head keeps. kv: per layer (K, V) [H_kv, N, D] of
        `prompt` (the prefill's own KV); the decision replays the last `window` prompt tokens."""
        kv16 = [(np.asarray(k, np.float16), np.asarray(v, np.float16)) for k, v in kv]  # as Table 1 scores it
        n = kv16[0][0].shape[1]
        if self.kind == "duo":
            from jkv.compression.heads import observation_scores
            from jkv.compression.streaming import StreamingPlan

            scores = observation_scores(model, prompt, kv16, self.window, self.sink, self.recent)
            return StreamingPlan.from_scores(scores, self.keep_pct / 100, self.sink, self.recent).keep_mask(n)
        from jkv.compression.tokens import TierConfig, plan_tiers, token_importance

        cfg = TierConfig(self.pipeline, None, self.keep_pct / 100, 0.0, self.sink, self.recent, self.window, self.pool)
        return plan_tiers(token_importance(model, prompt, kv16, self.window, self.pool), cfg) > 0


def parse_drop(spec_id: str | None) -> DropSpec | None:
    """The DropSpec of a token-dropping id, None for a plain pipeline id (or None). Raises
    ValueError naming the reason for a dropping id that is not servable."""
    if not spec_id:
        return None
    m = _DUO.match(spec_id)
    if m:
        fraction, sink, recent, pipe = int(m[1]), int(m[2]), int(m[3]), m[4]
        if not 0 <= fraction <= 100 or recent < 1:
            raise ValueError(f"{spec_id!r}: need 0 <= streaming % <= 100 and recent >= 1")
        spec = DropSpec("duo", fraction, pipe, sink, recent)
    elif spec_id.startswith("tiers:"):
        m = _TIERS.match(spec_id)
        if m is None:
            raise ValueError(f"{spec_id!r} is not a token-tier id tiers:hi<P>:<pipeline>:s<S>w<R>o<W>p<K>")
        if m[3]:
            raise ValueError(f"{spec_id!r}: a lo tier is not servable (two pipelines per chunk); use a "
                             "hi-only tier profile such as tiers:hi30:<pipeline>:s16w64o32p7")
        spec = DropSpec("tiers", int(m[1]), m[2], int(m[4]), int(m[5]), int(m[6]), int(m[7]))
        if not 0 <= spec.keep_pct <= 100 or spec.recent < 1 or spec.pool % 2 == 0:
            raise ValueError(f"{spec_id!r}: need 0 <= hi % <= 100, recent >= 1 and an odd pool")
    else:
        return None
    inner = PipelineSpec.parse(spec.pipeline)  # raises naming a bad pipeline id
    if inner.quantizer.method in ("mixed", "mixhq"):
        raise ValueError(f"{spec_id!r}: kept rows travel as head subsets; use a per-head-uniform quantizer "
                         "(none/tok/ch/kivi/ec), not a per-head table")
    return spec


def is_dropping_id(spec_id: str) -> bool:
    """Whether `spec_id` names a token-dropping profile (servable or not: a lo tier matches too)."""
    return bool(_DUO.match(spec_id) or _TIERS.match(spec_id))


def servable(spec_id: str) -> bool:
    """Whether a profile id can move on the serving path (plain pipelines and servable drops)."""
    try:
        parse_drop(spec_id)
    except ValueError:
        return False
    return True


def inner_pipeline(spec_id: str) -> str:
    """The pipeline id a (possibly dropping) profile encodes its kept rows with."""
    drop = parse_drop(spec_id)
    return spec_id if drop is None else drop.pipeline


def head_groups(keep_chunk: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """keep_chunk bool[H_kv, n] -> [(heads i64[h], positions i64[h, count])] per group of heads
    keeping the same count > 0 of tokens, in order of each group's first head."""
    counts = keep_chunk.sum(axis=1)
    out = []
    for count in sorted(set(counts.tolist()) - {0}, key=lambda c: int(np.flatnonzero(counts == c)[0])):
        heads = np.flatnonzero(counts == count)
        out.append((heads, np.stack([np.flatnonzero(keep_chunk[h]) for h in heads])))
    return out


def pack_keep(keep: np.ndarray) -> np.ndarray:
    """bool[L, H_kv, N] -> u8[ceil(L*H_kv*N / 8)] (the hand-off's keep table)."""
    return np.packbits(np.asarray(keep, bool).reshape(-1))


def keep_header(keep: np.ndarray) -> dict:
    """The hand-off header fields that go with `pack_keep(keep)`: its shape and crc32."""
    return {"keep": list(keep.shape), "keep_crc": zlib.crc32(pack_keep(keep).tobytes())}


def handoff_keep(codec) -> tuple[dict, list]:
    """(hand-off header fields, payload arrays) carrying a dropping request's keep table; ({}, [])
    for any other request."""
    if not isinstance(codec, DroppingCodec) or codec.keep is None:
        return {}, []
    return keep_header(codec.keep), [pack_keep(codec.keep)]


def unpack_keep(data, shape, crc: int | None = None) -> np.ndarray:
    """Inverse of `pack_keep`; raises ValueError when the bytes do not fit `shape` [L, H_kv, N] or
    fail their crc32 (when given)."""
    shape = tuple(int(s) for s in shape)
    size = int(np.prod(shape))
    raw = np.frombuffer(bytes(data), np.uint8)
    if raw.size != -(-size // 8):
        raise ValueError(f"keep table of {raw.size} bytes does not hold {shape}")
    if crc is not None and zlib.crc32(raw.tobytes()) != int(crc):
        raise ValueError("keep table fails its crc32")
    return np.unpackbits(raw, count=size).astype(bool).reshape(shape)


class DroppingCodec(RequestCodec):
    """Prefill-side state of one request moving with a token-dropping profile (module docstring).
    `set_keep` comes first (after the prefill: the decision needs the last queries), then `absorb`."""

    def __init__(self, pipeline, chunks, drop: DropSpec, spec_id: str):
        super().__init__(pipeline, chunks)
        self.drop, self._id = drop, spec_id
        self.keep: np.ndarray | None = None  # bool[L, H_kv, N]
        self.keep_s = 0.0  # seconds of the keep decision (the observation-window replay)

    @property
    def spec_id(self) -> str:
        return self._id

    def set_keep(self, keep: np.ndarray) -> None:
        keep = np.asarray(keep, bool)
        if keep.ndim != 3 or keep.shape[2] != self.chunks.num_tokens:
            raise ValueError(f"keep table {keep.shape} must be [L, H_kv, N={self.chunks.num_tokens}]")
        self.keep = keep

    def plan_keep(self, model, prompt, kv) -> np.ndarray:
        """Decide and store the keep table from the prefill's KV: per layer (K, V) [H_kv, N, D]."""
        t0 = time.perf_counter()
        self.set_keep(self.drop.keep_mask(model, prompt, kv))
        self.keep_s = time.perf_counter() - t0
        return self.keep

    def absorb_request(self, model, prompt, kv: np.ndarray) -> np.ndarray:
        """After the prefill: decide the keep table from kv f32[2, L, H_kv, N, D] (the request's
        copy), then absorb every layer in place. Returns keep bool[L, H_kv, N]."""
        self.plan_keep(model, prompt, [(kv[0, layer], kv[1, layer]) for layer in range(kv.shape[1])])
        for layer in range(kv.shape[1]):
            self.absorb(layer, kv[:, layer])
        return self.keep

    def absorb(self, layer: int, kv_layer: np.ndarray) -> None:
        """kv_layer f32[2, H_kv, N, D] becomes decode(encode(kept rows)), dropped rows 0."""
        if self.keep is None:
            raise AssertionError("DroppingCodec.absorb before set_keep")
        for c in range(self.chunks.num_chunks):
            start, stop = self.chunks.tokens(c)
            if start == stop:
                continue
            keep_c = self.keep[layer, :, start:stop]
            groups = []
            for heads, pos in head_groups(keep_c):
                parts = []
                for kind, i in (("k", 0), ("v", 1)):
                    rows = kv_layer[i, :, start:stop][heads[:, None], pos]
                    t0 = time.perf_counter()
                    data, decoded = self.pipeline.roundtrip_block(rows.astype(WIRE_DTYPE), layer=layer, kind=kind)
                    self.encode_s += time.perf_counter() - t0
                    kv_layer[i, heads[:, None], start + pos] = np.asarray(decoded, np.float32)
                    parts.append(data)
                    self.encoded_bytes += len(data)
                groups.append(tuple(parts))
            for i in (0, 1):
                kv_layer[i, :, start:stop][~keep_c] = 0.0
            bits = pack_keep(keep_c).tobytes()
            self.encoded_bytes += len(bits)
            self.raw_bytes += 2 * kv_layer[0, :, start:stop].size * WIRE_ITEMSIZE
            self._containers[(layer, c)] = (bits, groups)

    _frame_marks = {"drop": 1}

    @staticmethod
    def _chunk_wire(container) -> tuple[list[int], list[bytes]]:
        """A chunk's (keep bits, head groups' (K, V) containers) -> (header fields [len bits,
        crc32 bits, len of each container], payload parts [bits, K0, V0, K1, V1, ...])."""
        bits, groups = container
        parts = [x for kv in groups for x in kv]
        return [len(bits), zlib.crc32(bits)] + [len(x) for x in parts], [bits] + parts


def apply_dropping_frame(header: dict, payload, kv: np.ndarray, mask: np.ndarray) -> int:
    """Receive side of a dropping "ckv" frame: per chunk, decode each head group's kept rows into
    kv f32[2, L, H_kv, N_cap, D] (dropped rows 0), then set the chunk's mask bytes i8[L, N_cap] to
    LOCAL. Returns the payload bytes. Raises ValueError on a frame that does not fit the pool."""
    layer = int(header["layer"])
    _, L, H, cap, D = kv.shape
    if not 0 <= layer < L:
        raise ValueError(f"compressed KV frame for layer {layer} outside [0, {L})")
    mv, at = memoryview(payload), 0
    for entry in header["chunks"]:
        start, stop, bits_len, crc = int(entry[0]), int(entry[1]), int(entry[2]), int(entry[3])
        lens = [int(x) for x in entry[4:]]
        n = stop - start
        if not 0 <= start < stop <= cap or bits_len != -(-H * n // 8) or min(lens, default=0) < 0 \
                or at + bits_len + sum(lens) > len(mv):
            raise ValueError(f"dropping KV chunk [{start}, {stop}) with {bits_len} keep bytes and containers "
                             f"{lens} does not fit the pool (capacity {cap}, H_kv {H}) or the frame ({len(mv)} B)")
        if zlib.crc32(mv[at:at + bits_len]) != crc:
            raise ValueError(f"dropping KV chunk [{start}, {stop}): keep bits fail their crc32")
        keep_c = unpack_keep(mv[at:at + bits_len], (H, n))
        at += bits_len
        groups = head_groups(keep_c)
        if len(lens) != 2 * len(groups):
            raise ValueError(f"dropping KV chunk [{start}, {stop}): {len(lens)} containers for {len(groups)} "
                             "head groups of its keep bits")
        rows = np.zeros((2, H, n, D), np.float32)
        for g, (heads, pos) in enumerate(groups):
            for i in (0, 1):
                size = lens[2 * g + i]
                x = np.asarray(decode_block(bytes(mv[at:at + size])), np.float32)
                if x.shape != (len(heads), pos.shape[1], D):
                    raise ValueError(f"dropping KV chunk decodes to {x.shape}, expected {(len(heads), pos.shape[1], D)}")
                rows[i, heads[:, None], pos] = x
                at += size
        kv[:, layer, :, start:stop] = rows
        mask[layer, start:stop] = LOCAL
    if at != len(mv):
        raise ValueError(f"compressed KV frame has {len(mv) - at} trailing bytes")
    return len(mv)
