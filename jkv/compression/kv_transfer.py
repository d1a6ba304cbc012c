"""Compressed KV on the SmartGen block path (KVServe §4 "integration"; DESIGN.md "Later layers").

One compression choice per request, fixed for all of its KV movement. With a lossy pipeline the
transfer-mode invariant (DESIGN.md "Invariant") still holds because the prefill side replaces its
own copy of the request's KV by decode(encode(KV)) once, as each layer lands (`absorb`): proactive,
speculative and on-demand rows then all carry exactly those values, so full / partial / smartgen
generate identical tokens for the same pipeline. (On-demand replies and metadata: `paths.py`.)

Granularity. Transfer blocks are `ceil(N / M)` tokens (1 token for N <= M) and a container header
is ~300 B, so a layer is encoded once in *chunks*: runs of whole blocks of >= `min_chunk_tokens`
tokens, aligned to block ids. A push of some blocks of a layer sends the containers of every chunk
that covers one of them (K and V separately, KIVI quantizes them along different axes); the
receiver decodes each chunk into its pool, THEN flips the chunk's mask bytes to LOCAL — mask
semantics are unchanged (a block is local once decoded). The chunk's other blocks become local too
and are marked sent on the prefill side.

Wire dtype. The pool is float32; encoded blocks are float16 (as in the papers), so a profile's CR
(measured on fp16 KV) is half the ratio against the float32 bytes the uncompressed path moves
(`WIRE_ITEMSIZE` / pool itemsize); the controller works with the wire ratio.

Frame (notify kind `KIND` on the bulk connection, FIFO with metadata, writes and the hand-off):

    jkv.framing.pack({"rid", "layer", "chunks": [[start, stop, k_len, v_len], ...]}) | K container | V container | ...

Concurrency: `KVCodec` keeps a lock-guarded cache of `Pipeline`s (encode/decode are thread-safe);
`RequestCodec` is used by the prefill worker's prefill thread (`absorb`) and, after the layer has
been absorbed, by its notify thread (`frame`); `apply_frame` runs on the decode worker's notify thread.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from jkv.compression.pipeline import Calibration, Pipeline, decode_blocks
from jkv.compression.spec import UNCOMPRESSED, PipelineSpec
from jkv.framing import pack, unpack

log = logging.getLogger(__name__)

KIND = "ckv"
WIRE_DTYPE = np.float16
WIRE_ITEMSIZE = 2
LOCAL = 1  # jkv.kvbuffers.geometry.LOCAL (not imported: this package does not depend on kvbuffers)


@dataclass(frozen=True)
class ChunkPlan:
    """Chunks of one layer: `chunk_blocks` consecutive blocks of `block_tokens` tokens each.

    blocks_per_layer: M_eff; block_tokens: ceil(N / M_eff); num_tokens: N.
    """

    num_tokens: int
    blocks_per_layer: int
    block_tokens: int
    chunk_blocks: int

    @classmethod
    def for_geometry(cls, num_tokens: int, blocks_per_layer: int, block_tokens: int,
                     min_chunk_tokens: int) -> "ChunkPlan":
        return cls(num_tokens, blocks_per_layer, block_tokens, max(1, -(-min_chunk_tokens // block_tokens)))

    @property
    def num_chunks(self) -> int:
        return -(-self.blocks_per_layer // self.chunk_blocks)

    @property
    def chunk_tokens(self) -> int:
        """Tokens of every chunk but the last (which may be shorter, or empty)."""
        return self.chunk_blocks * self.block_tokens

    def chunk_of(self, m: int) -> int:
        return int(m) // self.chunk_blocks

    def blocks(self, c: int) -> range:
        return range(c * self.chunk_blocks, min((c + 1) * self.chunk_blocks, self.blocks_per_layer))

    def tokens(self, c: int) -> tuple[int, int]:
        """[start, stop) tokens of chunk c (start == stop only for a chunk of empty trailing blocks)."""
        start = min(c * self.chunk_blocks * self.block_tokens, self.num_tokens)
        return start, min((c + 1) * self.chunk_blocks * self.block_tokens, self.num_tokens)


class RequestCodec:
    """Prefill-side state of one request's compressed KV: the containers of every absorbed chunk."""

    def __init__(self, pipeline: Pipeline, chunks: ChunkPlan):
        self.pipeline, self.chunks = pipeline, chunks
        self._containers: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self.raw_bytes = 0  # fp16 bytes encoded (the CR baseline of the papers)
        self.encoded_bytes = 0
        self.encode_s = 0.0  # seconds spent in encode_block (serving's codec-time histogram)

    @property
    def spec_id(self) -> str:
        return self.pipeline.id

    def absorb(self, layer: int, kv_layer: np.ndarray) -> None:
        """kv_layer: f32[2, H_kv, N, D] (K, V of one layer, this worker's copy), overwritten in place
        by decode(encode(.)) chunk by chunk; the containers are kept for every later push.

        The layer's chunks go through `Pipeline.roundtrip_chunks` (one compiled encode and decode
        per power-of-two batch of chunks): the same containers, byte for byte, and the same values
        as `absorb_reference`'s call per chunk, at a fraction of its CPU (docs/compression.md,
        "Batched prefill-side codec")."""
        n = self.chunks.num_tokens
        parts = []
        for kind, i in (("k", 0), ("v", 1)):
            t0 = time.perf_counter()
            containers, _ = self.pipeline.roundtrip_chunks(kv_layer[i, :, :n].astype(WIRE_DTYPE), self.chunks.chunk_tokens,
                                                           layer=layer, kind=kind, out=kv_layer[i, :, :n])
            self.encode_s += time.perf_counter() - t0
            parts.append(containers)
            self.encoded_bytes += sum(len(data) for data in containers)
        self.raw_bytes += 2 * kv_layer[0, :, :n].size * WIRE_ITEMSIZE
        for c, (kb, vb) in enumerate(zip(*parts)):
            self._containers[(layer, c)] = (kb, vb)

    def cover(self, blocks) -> tuple[list[int], list[int]]:
        """Block indices m of one layer -> (chunks covering them, every block of those chunks)."""
        chunks = sorted({self.chunks.chunk_of(m) for m in blocks})
        return chunks, [m for c in chunks for m in self.chunks.blocks(c)]

    def frame(self, rid: str, layer: int, chunks) -> bytes:
        """The "ckv" notification payload carrying `chunks` of `layer` (absorbed before): a header
        with one [start, stop, *fields] entry a non-empty chunk, then each chunk's byte strings in
        order. A subclass changes what a chunk carries (`_chunk_wire`) and marks its frames
        (`_frame_marks`, e.g. drop=1), so every "ckv" frame is laid out here."""
        meta, payload = [], []
        for c in chunks:
            start, stop = self.chunks.tokens(c)
            if start == stop:
                continue
            fields, parts = self._chunk_wire(self._containers[(layer, c)])
            meta.append([start, stop, *fields])
            payload += parts
        return pack(dict(rid=rid, layer=layer, **self._frame_marks, chunks=meta)) + b"".join(payload)

    _frame_marks: dict = {}  # extra header keys that tell `apply_frame`'s callers which decoder a frame needs

    @staticmethod
    def _chunk_wire(container) -> tuple[list[int], list[bytes]]:
        """A chunk's (K, V) containers -> (header fields [len K, len V], payload parts [K, V])."""
        kb, vb = container
        return [len(kb), len(vb)], [kb, vb]

    @property
    def cr(self) -> float:
        """fp16 bytes / container bytes over everything absorbed so far."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0


def absorb_reference(state: RequestCodec, layer: int, kv_layer: np.ndarray) -> None:
    """`RequestCodec.absorb` one chunk at a time (`Pipeline.roundtrip_block` per chunk, K and V:
    a compiled call each): the path `absorb` batched, kept as the reference its tests and
    experiments/codec_batch_ab.py compare it with. Same arguments and effect as `state.absorb`."""
    for c in range(state.chunks.num_chunks):
        start, stop = state.chunks.tokens(c)
        if start == stop:
            continue
        parts = []
        for kind, i in (("k", 0), ("v", 1)):
            t0 = time.perf_counter()
            data, decoded = state.pipeline.roundtrip_block(kv_layer[i, :, start:stop].astype(WIRE_DTYPE),
                                                           layer=layer, kind=kind)
            state.encode_s += time.perf_counter() - t0
            kv_layer[i, :, start:stop] = np.asarray(decoded, np.float32)
            parts.append(data)
            state.encoded_bytes += len(data)
        state.raw_bytes += 2 * kv_layer[0, :, start:stop].size * WIRE_ITEMSIZE
        state._containers[(layer, c)] = (parts[0], parts[1])


MIN_CHUNK_TOKENS = 128  # KVCodec's default smallest container


def warm_batch_sizes(max_tokens: int, chunk_tokens: int) -> list[int]:
    """Every power-of-two batch of full-size chunks a layer of up to `max_tokens` tokens is coded in
    (`pipeline._power_of_two_batches` of its chunk count): 1, 2, 4, ... up to that count."""
    max_chunks = max(1, -(-max_tokens // chunk_tokens))
    return [1 << b for b in range(max_chunks.bit_length())]


def warm_receive(pipeline: Pipeline, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_tokens: int, min_chunk_tokens: int = MIN_CHUNK_TOKENS) -> int:
    """Compile the receive side of `pipeline` before any request needs it: `decode_blocks` of
    every power-of-two batch of full-size chunks up to a layer's chunk count at `max_tokens`, for
    each distinct container layout (K and V; a per-layer bit table gives one per layer). A "ckv"
    frame decodes its chunks in such batches on the notify thread, so a batch size first met
    mid-request compiled there, delaying every frame behind it: at 4 x 2K with importance-ordered
    proactive blocks, 1.8-2.2 s of one request's decode time went to it. Returns the number of
    programs compiled."""
    from jkv.compression.pipeline import decode_blocks, inspect_block

    x = np.random.default_rng(0).standard_normal((num_kv_heads, min_chunk_tokens, head_dim)).astype(WIRE_DTYPE)
    sizes = warm_batch_sizes(max_tokens, min_chunk_tokens)
    seen, compiled = set(), 0
    for layer in range(num_layers):
        for kind in ("k", "v"):
            block = pipeline.encode_block(x, layer=layer, kind=kind)
            info, _ = inspect_block(block)
            key = (info.transform, info.plan, tuple(info.shape), info.dtype)
            if key in seen:
                continue
            seen.add(key)
            for count in sizes:
                decode_blocks([block] * count)
                compiled += 1
    return compiled


class KVCodec:
    """Builds per-request compressed state from a pipeline id (the send side's codec object).

    calibration: state some stages need on the encode side (affine, MixHQ); a "mixed-..." spec
    names every head's bits explicitly and needs none. min_chunk_tokens: smallest container.
    """

    def __init__(self, calibration: Calibration | None = None, min_chunk_tokens: int = MIN_CHUNK_TOKENS):
        if min_chunk_tokens < 1:
            raise ValueError(f"{min_chunk_tokens=} must be >= 1 token")
        self.calibration = calibration
        self.min_chunk_tokens = min_chunk_tokens
        self._pipelines: dict[str, Pipeline] = {}
        self._lock = threading.Lock()

    def pipeline(self, spec_id: str) -> Pipeline:
        with self._lock:
            if spec_id not in self._pipelines:
                self._pipelines[spec_id] = Pipeline(PipelineSpec.parse(spec_id), self.calibration)
            return self._pipelines[spec_id]

    def warm_absorb(self, spec_id: str, num_layers: int, num_kv_heads: int, head_dim: int,
                    max_tokens: int) -> int:
        """Compile the send side of `spec_id` (a token-dropping id: its kept rows' pipeline) before a
        request needs it: `roundtrip_chunks` of every power-of-two batch of full-size chunks up to a
        layer's chunk count at `max_tokens`, for K and V (every layer for a per-layer bit table, else
        layer 0: the others share its programs). Left to the first request of a pipeline, these
        compiled inside its prefill (1.5-1.8 s more codec time for the first request per prefill
        worker at 4 x 2K). Returns the number of batch sizes x kinds x layers run."""
        from jkv.compression.dropping import inner_pipeline

        pipeline = self.pipeline(inner_pipeline(spec_id))
        chunk = self.min_chunk_tokens
        rng = np.random.default_rng(0)
        layers = range(num_layers) if pipeline.spec.id.startswith("mixed-") else (0,)
        runs = 0
        for count in warm_batch_sizes(max_tokens, chunk):
            x = rng.standard_normal((num_kv_heads, count * chunk, head_dim)).astype(WIRE_DTYPE)
            for layer in layers:
                for kind in ("k", "v"):
                    pipeline.roundtrip_chunks(x, chunk, layer=layer, kind=kind)
                    runs += 1
        return runs

    def start(self, spec_id: str | None, geometry) -> RequestCodec | None:
        """State for one request (None: uncompressed, the plain block writes; a `dropping.DroppingCodec`
        for a token-dropping profile id). geometry: BlockGeometry."""
        if spec_id is None or spec_id == UNCOMPRESSED.id:
            return None
        from jkv.compression.dropping import DroppingCodec, parse_drop

        chunks = ChunkPlan.for_geometry(geometry.num_tokens, geometry.blocks_per_layer, geometry.block_tokens,
                                        self.min_chunk_tokens)
        drop = parse_drop(spec_id)  # a token-dropping profile: its keep table comes after the prefill
        if drop is not None:
            return DroppingCodec(self.pipeline(drop.pipeline), chunks, drop, spec_id)
        return RequestCodec(self.pipeline(spec_id), chunks)


def apply_frame(header: dict, payload, kv: np.ndarray, mask: np.ndarray) -> int:
    """Receive side of a "ckv" frame: decode each chunk into kv f32[2, L, H_kv, N_cap, D], then set
    its mask bytes i8[L, N_cap] to LOCAL (after the rows, so a LOCAL byte is always safe).
    Returns the frame's payload bytes. Raises ValueError on a frame that does not fit the pool,
    before any row is written (every container is checked before the frame's chunks are decoded
    together: `decode_blocks`, bit for bit `decode_block` of each)."""
    layer = int(header["layer"])
    _, L, H, cap, D = kv.shape
    if not 0 <= layer < L:
        raise ValueError(f"compressed KV frame for layer {layer} outside [0, {L})")
    mv, pos = memoryview(payload), 0
    spans, blocks = [], []
    for start, stop, k_len, v_len in header["chunks"]:
        if not 0 <= start < stop <= cap or k_len < 0 or v_len < 0 or pos + k_len + v_len > len(mv):
            raise ValueError(f"compressed KV chunk [{start}, {stop}) of {k_len}+{v_len} bytes does not fit "
                             f"the pool (capacity {cap}) or the frame ({len(mv)} bytes)")
        spans.append((start, stop))
        blocks += [bytes(mv[pos:pos + k_len]), bytes(mv[pos + k_len:pos + k_len + v_len])]
        pos += k_len + v_len
    if pos != len(mv):
        raise ValueError(f"compressed KV frame has {len(mv) - pos} trailing bytes")
    decoded = decode_blocks(blocks)  # [K0, V0, K1, V1, ...]
    for c, (start, stop) in enumerate(spans):
        for x in decoded[2 * c:2 * c + 2]:
            if x.shape != (H, stop - start, D):
                raise ValueError(f"compressed KV chunk decodes to {x.shape}, expected {(H, stop - start, D)}")
    for c, (start, stop) in enumerate(spans):
        kv[0, layer, :, start:stop] = decoded[2 * c]
        kv[1, layer, :, start:stop] = decoded[2 * c + 1]
        mask[layer, start:stop] = LOCAL
    return len(mv)


def path_seconds(pipeline: Pipeline, kv: np.ndarray, *, min_chunk_tokens: int = 128,
                 blocks_per_layer: int | None = None) -> float:
    """Seconds one request's KV costs on the compressed transfer path, everything serialized:
    the prefill side's `absorb` (encode AND decode of every chunk: its copy becomes decode(encode(KV))),
    `frame`, and the receiver's `apply_frame` (decode into the pool). kv: f32[2, L, H_kv, N, D] — a
    copy is overwritten. blocks_per_layer: M_eff (default N: one token per block).

    This is the codec cost the controller must charge (Eq. 1's V / s_p): a profile file's s_p comes
    from one encode + one decode (KVServe §5's round trip), which misses the second decode and the
    framing — on a 2-core box where prefill and decode share the cores, ~1.5-2x of that estimate."""
    if kv.ndim != 5 or kv.shape[0] != 2:
        raise ValueError(f"kv must be f32[2, L, H_kv, N, D], got shape {kv.shape}")
    _, L, H, N, D = kv.shape
    m = N if blocks_per_layer is None else int(blocks_per_layer)
    block_tokens = -(-N // m)
    state = RequestCodec(pipeline, ChunkPlan.for_geometry(N, -(-N // block_tokens), block_tokens, min_chunk_tokens))
    prefill = np.array(kv, np.float32, copy=True)
    pool = np.zeros_like(prefill)
    mask = np.zeros((L, N), np.int8)
    t0 = time.perf_counter()
    for layer in range(L):
        state.absorb(layer, prefill[:, layer])
        header, payload = unpack(state.frame("probe", layer, range(state.chunks.num_chunks)))
        apply_frame(header, payload, pool, mask)
    return time.perf_counter() - t0


def path_throughput_Bps(pipeline: Pipeline, kv: np.ndarray, *, min_chunk_tokens: int = 128,
                        blocks_per_layer: int | None = None, repeats: int = 2) -> float:
    """Float32 bytes of `kv` per second of the whole transfer path (`path_seconds`), best of
    `repeats` timed runs after one untimed warm-up run (JIT compilation of the pipeline's shapes)."""
    if repeats < 1:
        raise ValueError(f"{repeats=} must be >= 1")
    kw = dict(min_chunk_tokens=min_chunk_tokens, blocks_per_layer=blocks_per_layer)
    path_seconds(pipeline, kv[:, :1], **kw)  # compile (every layer has the same shapes)
    best = min(path_seconds(pipeline, kv, **kw) for _ in range(repeats))
    return kv.size * 4 / max(best, 1e-12)
