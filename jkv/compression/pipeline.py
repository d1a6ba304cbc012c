"""The compression pipeline BS = C(Q(T(X))) over KV blocks (KVServe §5.1, Fig. 7).

    pipe = Pipeline(PipelineSpec.parse("hadamard+kivi4g32+zstd3"), calibration)
    data = pipe.encode_block(K_block, layer=l, kind="k")   # K_block: [H_kv, Nb, D] -> bytes
    K_hat = decode_block(data)                              # bytes -> jnp [H_kv, Nb, D], block dtype

K and V are separate blocks (KIVI quantizes them along different axes). Transform + quantize +
bit packing run in one jitted function per (spec, plan, shape, dtype); the host then concatenates
the sections and applies the codec. Decoding is the mirror image and needs nothing but the bytes:
the container header names the transform, the quantization plan (bits per head, axis, group) and
every section, so a decode node needs no calibration state. Decoding validates the header against
the layout the plan implies before any array is built (`ContainerError` otherwise), and
dequantizes straight into the computation-ready layout [H_kv, Nb, D].

Many blocks of one layout (a layer's chunks on the transfer path) go through one compiled loop
over a leading chunk axis (`Pipeline.roundtrip_chunks`, `decode_blocks`): each block is still
encoded and decoded on its own, by the single-block program, to the same bytes and values as one
call per block, with one dispatch per power-of-two batch instead of one per block.

`Pipeline` objects are immutable after construction apart from a cache of fitted affine
parameters guarded by a lock; encode/decode may be called from several threads.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jkv.compression import quantizers, transforms
from jkv.compression.container import ContainerError, SECTION_DTYPES, pack_container, unpack_container
from jkv.compression.spec import PipelineSpec, TransformSpec

BLOCK_DTYPES = ("float16", "bfloat16", "float32")
FP16_MAX = 65504.0


@dataclass(frozen=True)
class Calibration:
    """Calibration state some stages need (fitted offline, applied on the encode side only).

    kv: {(layer, "k"|"v"): [H_kv, N, D] or [B, H_kv, N, D]} calibration KV (affine transform).
    head_scores: f32[L, H_kv] retrieval scores (`heads.retrieval_scores`) for MixHQ, or
    retrieval_heads: bool[L, H_kv] given directly.
    """

    kv: Mapping[tuple[int, str], np.ndarray] | None = None
    head_scores: np.ndarray | None = None
    retrieval_heads: np.ndarray | None = None


@dataclass(frozen=True)
class BlockInfo:
    """What a container says about its block (from the validated header)."""

    spec_id: str
    layer: int
    kind: str
    shape: tuple[int, int, int]
    dtype: str
    transform: TransformSpec
    plan: quantizers.QuantPlan
    nbytes: int  # the whole container

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the uncompressed block."""
        return int(np.prod(self.shape)) * SECTION_DTYPES[self.dtype].itemsize


class Pipeline:
    """Encoder for one `PipelineSpec` (plus the calibration its stages need)."""

    def __init__(self, spec: PipelineSpec, calibration: Calibration | None = None):
        self.spec = spec
        self._calibration = calibration or Calibration()
        self._affine: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()
        if spec.transform.name == "affine" and self._calibration.kv is None:
            raise ValueError(f"{spec.id}: the affine transform needs Calibration(kv={{(layer, kind): KV}})")
        self._retrieval = None
        if spec.quantizer.method == "mixhq":
            if self._calibration.retrieval_heads is not None:
                self._retrieval = np.asarray(self._calibration.retrieval_heads, dtype=bool)
            elif self._calibration.head_scores is not None:
                self._retrieval = quantizers.mixhq_retrieval_heads(spec.quantizer, self._calibration.head_scores)
            else:
                raise ValueError(f"{spec.id}: MixHQ needs Calibration(head_scores=...) or (retrieval_heads=...)")

    @property
    def id(self) -> str:
        return self.spec.id

    def plan(self, layer: int, kind: str, n_heads: int) -> quantizers.QuantPlan:
        return quantizers.make_plan(self.spec.quantizer, layer, kind, n_heads, self._retrieval)

    def _transform_inputs(self, layer: int, kind: str) -> dict[str, np.ndarray]:
        if self.spec.transform.name != "affine":
            return {}
        with self._lock:
            if (layer, kind) not in self._affine:
                samples = self._calibration.kv.get((layer, kind))
                if samples is None:
                    raise ValueError(f"{self.spec.id}: no affine calibration KV for (layer={layer}, kind={kind!r})")
                self._affine[(layer, kind)] = transforms.fit_affine(samples)
            return self._affine[(layer, kind)]

    def encode_block(self, x, *, layer: int, kind: str) -> bytes:
        """x: [H_kv, Nb, D] float16/bfloat16/float32 (K or V of one layer block) -> container bytes."""
        header, sections = self._encode(x, layer, kind)
        return pack_container(header, sections, self.spec.codec)

    def roundtrip_block(self, x, *, layer: int, kind: str) -> tuple[bytes, jax.Array]:
        """(encode_block(x), decode_block of those bytes) without parsing the bytes back: the same
        compiled decode runs on the sections before the (lossless) codec, so the values are bit for
        bit what any receiver decodes. The prefill side's decode(encode(KV)) copy (`kv_transfer`)."""
        header, sections = self._encode(x, layer, kind)
        data = pack_container(header, sections, self.spec.codec)
        shape = tuple(header["shape"])
        plan = quantizers.QuantPlan.from_header(header["plan"])
        return data, _decode_fn(self.spec.transform, plan, shape, header["dtype"])(dict(sections))

    def roundtrip_chunks(self, x, chunk_tokens: int, *, layer: int, kind: str,
                         out: np.ndarray | None = None) -> tuple[list[bytes], np.ndarray]:
        """x: [H_kv, N, D] (K or V of a whole layer) cut into chunks of `chunk_tokens` tokens (the
        last one shorter when chunk_tokens does not divide N) -> (one container per chunk, the
        decoded chunks side by side in `out` [H_kv, N, D]: x's dtype unless given, e.g. the float32
        rows x came from, which they then replace).

        Byte for byte the containers, and bit for bit the values, of `roundtrip_block` on each
        chunk: each chunk is still encoded on its own (its groups, padding and scales never see
        another chunk's tokens), but the full-size chunks go through one compiled encode loop and
        one decode loop per power-of-two batch instead of a dispatch each (per-call dispatch was
        most of the prefill-side codec's CPU at 128-token chunks); only the lossless codec and the
        container framing stay per chunk, on the host. A shorter last chunk takes `roundtrip_block`."""
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"{chunk_tokens=} must be an int >= 1")
        x = np.asarray(x)
        if x.ndim != 3 or min(x.shape) < 1:
            raise ValueError(f"a KV block must be [H_kv, N, D] with positive sizes; got shape {x.shape}")
        h, n, d = x.shape
        out = np.empty_like(x) if out is None else out
        if out.shape != x.shape:
            raise ValueError(f"out {out.shape} must have x's shape {x.shape}")
        containers: list[bytes] = []
        done = 0
        for count in _power_of_two_batches(n // chunk_tokens):
            stop = done + count * chunk_tokens
            # Splitting the token axis never copies: both are views, [H_kv, count, Nc, D].
            chunks, dest = (a[:, done:stop].reshape(h, count, chunk_tokens, d) for a in (x, out))
            assert np.may_share_memory(dest, out), "the decoded chunks must land in out"
            header, sections = self._encode_batch(chunks, layer, kind)
            containers += [pack_container(header, [(name, a[c]) for name, a in sections], self.spec.codec)
                           for c in range(count)]
            plan = quantizers.QuantPlan.from_header(header["plan"])
            decoded = _decode_batch_fn(self.spec.transform, plan, tuple(header["shape"]), header["dtype"])(
                dict(sections))  # [count, H_kv, Nc, D]
            dest[...] = np.asarray(decoded).swapaxes(0, 1)
            done = stop
        if done < n:
            data, decoded = self.roundtrip_block(x[:, done:], layer=layer, kind=kind)
            containers.append(data)
            out[:, done:] = np.asarray(decoded)
        return containers, out

    def _prepare(self, x, layer: int, kind: str) -> tuple[quantizers.QuantPlan, dict[str, np.ndarray], dict, dict]:
        """Validate one block x [H_kv, Nb, D] -> (plan, transform inputs, container header, layout)."""
        if kind not in quantizers.KINDS:
            raise ValueError(f"{kind=} must be 'k' or 'v'")
        if not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{layer=} must be an int >= 0")
        if x.ndim != 3 or min(x.shape) < 1:
            raise ValueError(f"a KV block must be [H_kv, Nb, D] with positive sizes; got shape {x.shape}")
        dtype = np.dtype(x.dtype).name
        if dtype not in BLOCK_DTYPES:
            raise ValueError(f"KV block dtype {dtype} unsupported; use one of {BLOCK_DTYPES}")
        shape = tuple(int(s) for s in x.shape)
        plan = self.plan(layer, kind, shape[0])
        inputs = self._transform_inputs(layer, kind)
        if inputs and inputs["affine.shift"].shape != (shape[0], shape[2]):
            raise ValueError(f"affine calibration for layer {layer} is {inputs['affine.shift'].shape}, block is {shape}")
        header = {"spec": self.spec.id, "layer": layer, "kind": kind, "shape": list(shape), "dtype": dtype,
                  "transform": self.spec.transform.id, "plan": plan.to_header()}
        return plan, inputs, header, _layout(self.spec.transform, plan, shape, dtype)

    @staticmethod
    def _check_range(max_abs, plan: quantizers.QuantPlan, layer: int, kind: str) -> None:
        """max_abs: the largest |value| after the transform, of one block or f32[C] of C blocks."""
        worst = float(np.max(np.asarray(max_abs)))
        if not np.isfinite(worst) or (any(b != 16 for b in plan.head_bits) and worst > FP16_MAX):
            raise ValueError(f"KV block (layer {layer}, {kind}) has |value| up to {worst} after the transform; "
                             f"quantizer scales are float16, so values must be finite and <= {FP16_MAX}")

    def _encode(self, x, layer: int, kind: str) -> tuple[dict, list[tuple[str, np.ndarray]]]:
        """x -> (container header, [(section name, host array)]) in the layout's order."""
        x = jnp.asarray(x)
        plan, inputs, header, layout = self._prepare(x, layer, kind)
        sections, max_abs = _encode_fn(self.spec.transform, plan, tuple(header["shape"]), header["dtype"])(x, inputs)
        self._check_range(max_abs, plan, layer, kind)
        return header, [(name, np.asarray(sections[name])) for name in layout]

    def _encode_batch(self, chunks: np.ndarray, layer: int, kind: str) -> tuple[dict, list[tuple[str, np.ndarray]]]:
        """chunks: [H_kv, C, Nb, D], C blocks of one layer and kind (a layer's rows, chunk axis
        split off) -> (the header each block's container carries, [(section name, host array
        [C, *section shape])]) in the layout's order."""
        plan, inputs, header, layout = self._prepare(chunks[:, 0], layer, kind)
        sections, max_abs = _encode_batch_fn(self.spec.transform, plan, tuple(header["shape"]), header["dtype"])(
            chunks, inputs)
        self._check_range(max_abs, plan, layer, kind)
        return header, [(name, np.asarray(sections[name])) for name in layout]

    def encode_kv(self, k, v, *, layer: int) -> tuple[bytes, bytes]:
        """K, V: [H_kv, Nb, D] of one layer block -> (k_bytes, v_bytes)."""
        return self.encode_block(k, layer=layer, kind="k"), self.encode_block(v, layer=layer, kind="v")


def inspect_block(data: bytes) -> tuple[BlockInfo, dict[str, np.ndarray]]:
    """Validate a container fully (header semantics included): (info, host sections)."""
    header, sections = unpack_container(data)
    try:
        shape = header["shape"]
        if not (isinstance(shape, list) and len(shape) == 3
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
            raise ValueError(f"shape {shape!r} must be three positive ints [H_kv, Nb, D]")
        dtype, kind, layer = header["dtype"], header["kind"], header["layer"]
        if dtype not in BLOCK_DTYPES:
            raise ValueError(f"block dtype {dtype!r} must be one of {BLOCK_DTYPES}")
        if kind not in quantizers.KINDS:
            raise ValueError(f"kind {kind!r} must be 'k' or 'v'")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"layer {layer!r} must be an int >= 0")
        if not isinstance(header["transform"], str) or not isinstance(header["plan"], dict):
            raise ValueError("transform must be an id string and plan an object")
        transform = TransformSpec.parse(header["transform"])
        plan = quantizers.QuantPlan.from_header(header["plan"])
        shape = tuple(shape)
        expected = _layout(transform, plan, shape, dtype)
        spec_id = str(header["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise ContainerError(f"invalid block header: {e!s}") from None
    got = {name: (arr.shape, arr.dtype) for name, arr in sections.items()}
    if got != expected:
        raise ContainerError(f"block sections {sorted(got)} do not match the layout its header implies {sorted(expected)} "
                             f"(or their shapes/dtypes differ)")
    return BlockInfo(spec_id, layer, kind, shape, dtype, transform, plan, len(data)), sections


def decode_block(data: bytes) -> jax.Array:
    """Container bytes -> the block as jnp [H_kv, Nb, D] in its original dtype (computation-ready)."""
    info, sections = inspect_block(data)
    return _decode_fn(info.transform, info.plan, info.shape, info.dtype)(sections)


def decode_blocks(blocks: Sequence[bytes]) -> list[np.ndarray]:
    """Containers -> each block as np [H_kv, Nb, D] in its original dtype, bit for bit what
    `decode_block` gives for each. Every container is validated on its own (`inspect_block`,
    `ContainerError` before anything is decoded); blocks of one layout (transform, plan, shape,
    dtype: a layer's full-size chunks) are then decoded together, one compiled loop per
    power-of-two batch (`Pipeline.roundtrip_chunks`'s decode: the receiver's side of it)."""
    inspected = [inspect_block(data) for data in blocks]
    by_layout: dict[tuple, list[int]] = {}
    for i, (info, _) in enumerate(inspected):
        by_layout.setdefault((info.transform, info.plan, info.shape, info.dtype), []).append(i)
    out: list[np.ndarray | None] = [None] * len(inspected)
    for key, indices in by_layout.items():
        done = 0
        for count in _power_of_two_batches(len(indices)):
            batch = indices[done:done + count]
            if count == 1:
                out[batch[0]] = np.asarray(_decode_fn(*key)(inspected[batch[0]][1]))
            else:
                stacked = {name: np.stack([inspected[i][1][name] for i in batch]) for name in inspected[batch[0]][1]}
                decoded = np.asarray(_decode_batch_fn(*key)(stacked))
                for j, i in enumerate(batch):
                    out[i] = decoded[j]
            done += count
    return out


def _power_of_two_batches(count: int) -> list[int]:
    """count -> powers of two adding up to it, largest first (9 -> [8, 1]): batched calls compile
    once per power of two, not once per chunk count a request's length gives."""
    return [1 << b for b in reversed(range(count.bit_length())) if count >> b & 1]


def _layout(transform: TransformSpec, plan: quantizers.QuantPlan, shape, dtype: str) -> dict[str, tuple]:
    store = SECTION_DTYPES[dtype]
    layout = transforms.side_layout(transform, shape, store)
    layout.update(quantizers.section_layout(plan, shape, store))
    return layout


def _encode_body(transform: TransformSpec, plan: quantizers.QuantPlan, store):
    """x [H_kv, Nb, D], inputs -> (sections, max |value| after the transform): traceable."""

    def encode(x, inputs):
        y, side = transforms.forward(transform, x.astype(jnp.float32), inputs, store)
        max_abs = jnp.where(jnp.all(jnp.isfinite(y)), jnp.max(jnp.abs(y)), jnp.inf)  # XLA's max may drop NaN
        return {**side, **quantizers.quantize(y, plan, store)}, max_abs

    return encode


def _decode_body(transform: TransformSpec, plan: quantizers.QuantPlan, shape, store):
    """sections -> [H_kv, Nb, D] in the block dtype: traceable."""

    def decode(sections):
        y = quantizers.dequantize(sections, plan, shape)
        return transforms.inverse(transform, y, sections).astype(store)

    return decode


@functools.lru_cache(maxsize=256)
def _encode_fn(transform: TransformSpec, plan: quantizers.QuantPlan, shape, dtype: str):
    return jax.jit(_encode_body(transform, plan, SECTION_DTYPES[dtype]))


@functools.lru_cache(maxsize=256)
def _decode_fn(transform: TransformSpec, plan: quantizers.QuantPlan, shape, dtype: str):
    return jax.jit(_decode_body(transform, plan, shape, SECTION_DTYPES[dtype]))


# The batched functions loop over the blocks inside one compiled program (`lax.map`) rather than
# vmapping them: each iteration runs the single-block program on the single block's shapes. vmap
# would fold the blocks into bigger ops (one [C*H_kv*Nb, D] Hadamard matmul), whose float sums a
# backend may order by size; on this CPU it was as exact and ~10 % faster, not a guarantee elsewhere.
@functools.lru_cache(maxsize=256)
def _encode_batch_fn(transform: TransformSpec, plan: quantizers.QuantPlan, shape, dtype: str):
    """`_encode_fn` over chunks [H_kv, C, Nb, D] (C blocks, the transform inputs shared): sections
    [C, *section shape], max_abs f32[C]."""
    encode = _encode_body(transform, plan, SECTION_DTYPES[dtype])
    return jax.jit(lambda chunks, inputs: jax.lax.map(lambda x: encode(x, inputs), jnp.swapaxes(chunks, 0, 1)))


@functools.lru_cache(maxsize=256)
def _decode_batch_fn(transform: TransformSpec, plan: quantizers.QuantPlan, shape, dtype: str):
    """`_decode_fn` over sections [C, *section shape] -> [C, H_kv, Nb, D]."""
    return jax.jit(functools.partial(jax.lax.map, _decode_body(transform, plan, shape, SECTION_DTYPES[dtype])))


@dataclass(frozen=True)
class PipelineReport:
    """Compression ratio (all container bytes counted) and throughput of one spec on given blocks."""

    spec_id: str
    raw_bytes: int
    encoded_bytes: int
    encode_s: float
    decode_s: float

    @property
    def cr(self) -> float:
        return self.raw_bytes / self.encoded_bytes

    @property
    def encode_Bps(self) -> float:
        return self.raw_bytes / self.encode_s

    @property
    def decode_Bps(self) -> float:
        return self.raw_bytes / self.decode_s

    @property
    def throughput_Bps(self) -> float:
        """s_p: harmonic combination of encode and decode throughput (KVServe §3.1)."""
        return self.raw_bytes / (self.encode_s + self.decode_s)


def compression_ratio(blocks: Sequence[bytes]) -> float:
    """Uncompressed bytes of the blocks (from their headers) / total container bytes."""
    infos = [inspect_block(b)[0] for b in blocks]
    return sum(i.raw_nbytes for i in infos) / sum(i.nbytes for i in infos)


def measure(pipeline: Pipeline, blocks: Sequence[tuple[int, str, object]], repeats: int = 3) -> PipelineReport:
    """Encode + decode `blocks` [(layer, kind, x [H_kv, Nb, D])]: CR and best-of-`repeats` times.

    The first pass (which compiles) is not timed.
    """
    if repeats < 1:
        raise ValueError(f"{repeats=} must be >= 1")
    if not blocks:
        raise ValueError("measure needs at least one block")
    arrays = [(layer, kind, jnp.asarray(x)) for layer, kind, x in blocks]
    raw = sum(x.size * x.dtype.itemsize for _, _, x in arrays)
    encoded = [pipeline.encode_block(x, layer=layer, kind=kind) for layer, kind, x in arrays]
    jax.block_until_ready([decode_block(b) for b in encoded])
    enc_best = dec_best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        encoded = [pipeline.encode_block(x, layer=layer, kind=kind) for layer, kind, x in arrays]
        t1 = time.perf_counter()
        jax.block_until_ready([decode_block(b) for b in encoded])
        t2 = time.perf_counter()
        enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
    return PipelineReport(pipeline.id, int(raw), sum(len(b) for b in encoded), enc_best, dec_best)
