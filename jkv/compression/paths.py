"""Compression on every path a request's KV crosses (DESIGN.md "KVServe": target of [compose]).

A request's KV reaches the decode side on four paths: proactive pushes (during the prefill),
speculative pushes (between decode steps), on-demand replies (rows a decode step needs now,
SmartGen §4.2) and the selector metadata. Each path gets its own choice, made once per request
with the push pipeline (`policy.CompressionPolicy.choose` -> `PathChoice`):

- **pushes** (proactive and speculative): the request's pipeline (`kv_transfer`), chunked; the
  prefill side keeps decode(encode(KV)) as its copy, so every row value is fixed by this choice.
- **on-demand replies**: a *row-granular* pipeline: any subset of rows decodes on its own (one
  container per request of the reply, K and V rows as a `[2, n, D]` block). It never changes a
  value, so it is a pure speed choice and the transfer-mode invariant does not depend on it:
    * `identity` transform + `tok<b>g<G>` / `none` quantizer (per-token groups along D: a row's
      codes depend on that row only) — the push pipeline itself is row-granular: the reply uses
      the same transform and quantizer with codec `none` (the faster, lower-ratio variant: no
      entropy coder on the critical path), encoded from the original fp16 rows the prefill side
      keeps, so a row decodes to exactly what its chunk decodes to (elementwise dequantization;
      `test_row_replies_decode_to_the_chunk_values`);
    * any other lossy push pipeline (KIVI, Hadamard, delta, MixHQ ...) quantizes across rows, but
      its decoded values are float16 numbers: `F16` replies carry them exactly at half the
      float32 bytes.
- **metadata**: lossless (byte-shuffled, `zstd1`), which changes nothing but bytes, or lossy
  `q8+zstd1`: every float row (the last axis, e.g. InfiniGen's partial key of one token of one
  head, [d_p]) as int8 codes with a float16 absmax scale per row, then zstd-1. It changes which
  rows a selector ranks first, not any KV value: `experiments/metadata_q8_probe.py` measured 1.79x
  fewer bytes than `zstd1` on SmolLM2's InfiniGen metadata of a 2,048-token text with 0.993 of the
  top-20% selection unchanged. Decoding is deterministic, so every transfer mode of a request with
  this choice selects from the same values (the invariant holds per choice). "auto" offers it only
  for a request whose push is already lossy (its quality was accepted against the floor) — a
  request that moves its KV exactly keeps exact metadata.

How "auto" picks the on-demand and metadata codecs (KVServe §6.1 per path): each option is a line
T(x) = 1/s + x/cr over x = 1/B (Eq. 6); the uncompressed line (cr 1, s = inf) is one of them, and
the option with the lowest T at the live bandwidth wins (Theorem 6.2's envelope; an option with
B >= B*_p = (1 - 1/cr) s never wins, Theorem 6.1). The on-demand replies are not hidden behind the
prefill, so unlike the push there is no overlap term. `PathCosts` holds the (cr, s) of each option
(nominal defaults, override with measured ones). A fixed pipeline id compresses every path.

Every compressed frame is a checksummed `container` (crc32 over header and payload): a flipped bit
is rejected with a `ContainerError` before any section is decoded.

Concurrency: pure functions and frozen dataclasses; `Pipeline`s come from the caller's `KVCodec`
(thread-safe).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jkv.compression.container import ContainerError, pack_container, unpack_container
from jkv.compression.pipeline import decode_block
from jkv.compression.spec import UNCOMPRESSED, CodecSpec, PipelineSpec, QuantizerSpec
from jkv.framing import pack

F16 = "f16"  # on-demand rows as their exact float16 values (a container of identity+none+none at fp16)
METADATA_CODEC = "zstd1"  # lossless: byte-shuffled leaves, zstd level 1
METADATA_Q8 = "q8+zstd1"  # lossy: float rows as int8 codes + a float16 absmax scale per row, zstd level 1
METADATA_CODECS = (METADATA_CODEC, METADATA_Q8)
REPLY_MIN_ROWS = 16  # replies are padded to a power of two >= this many rows: one jit per bucket


def row_granular(spec: PipelineSpec) -> bool:
    """Any subset of rows (one token of one head, [D]) decodes on its own to the value the whole
    block decodes to: identity transform and a per-token (or no) quantizer."""
    return spec.transform.name == "identity" and spec.quantizer.method in ("none", "tok")


def exact_row_option(push_id: str | None) -> str | None:
    """The on-demand option that reproduces the values of a request pushed with `push_id` exactly
    (None: the push is uncompressed, rows stay float32)."""
    if push_id is None or push_id == UNCOMPRESSED.id:
        return None
    from jkv.compression.dropping import inner_pipeline

    spec = PipelineSpec.parse(inner_pipeline(push_id))  # a dropping profile: its kept rows' pipeline
    if row_granular(spec) and spec.quantizer.method == "tok":
        return PipelineSpec(spec.transform, spec.quantizer, CodecSpec("none")).id
    return F16


@dataclass(frozen=True)
class PathCosts:
    """(cr, s) per path option, cr against the float32 rows, s in float32 bytes per second of
    encode + decode. The defaults are nominal (fp16 cast; per-token codes + fp16 scale/zero per
    group; zstd-1 on byte-shuffled float32 metadata); measured values can replace them."""

    head_dim: int = 64
    f16_Bps: float = 2e9
    row_Bps: float = 300e6
    metadata_cr: float = 1.15
    metadata_Bps: float = 300e6
    metadata_q8_cr: float = 2.06  # 1.15 x the probe's 1.79x (experiments/results/metadata_q8_probe.csv)
    metadata_q8_Bps: float = 300e6

    def metadata_line(self, codec: str | None) -> tuple[float, float]:
        """(cr, s) of a metadata codec (None: uncompressed leaves)."""
        if codec is None:
            return 1.0, math.inf
        if codec == METADATA_Q8:
            return self.metadata_q8_cr, self.metadata_q8_Bps
        return self.metadata_cr, self.metadata_Bps

    def on_demand_line(self, option: str | None) -> tuple[float, float]:
        """(cr, s) of an on-demand option."""
        if option is None:
            return 1.0, math.inf
        if option == F16:
            return 2.0, self.f16_Bps
        q = PipelineSpec.parse(option).quantizer
        return row_cr(q, self.head_dim), self.row_Bps


def row_cr(q: QuantizerSpec, head_dim: int) -> float:
    """float32 bytes / reply bytes of per-token codes (b bits) + fp16 scale and zero per group."""
    if q.method == "none":
        return 2.0
    groups = -(-head_dim // q.group)
    return head_dim * 4 / (head_dim * q.bits / 8 + groups * 4)


def line_seconds(cr: float, s: float, bandwidth_Bps: float) -> float:
    """Eq. 6 per float32 byte: 1/s + (1/B)/cr."""
    return (0.0 if math.isinf(s) else 1.0 / s) + 1.0 / (bandwidth_Bps * cr)


@dataclass(frozen=True)
class PathChoice:
    """What each path of one request uses. push: pipeline id (None: plain float32 writes);
    on_demand: None | F16 | a row-granular pipeline id; metadata: None | a lossless codec id;
    reasons: why, per path ("fixed", "envelope", "uncompressed push")."""

    push: str | None
    on_demand: str | None
    metadata: str | None
    reasons: tuple[tuple[str, str], ...] = ()

    def labels(self) -> dict[str, str]:
        """{path: codec label} for results and the labelled counter ("none" = uncompressed)."""
        return {"push": self.push or "none", "on_demand": self.on_demand or "none", "metadata": self.metadata or "none"}


def choose_paths(push_id: str | None, bandwidth_Bps: float | None, costs: PathCosts = PathCosts(),
                 fixed: bool = False, metadata: str = "auto") -> PathChoice:
    """The on-demand and metadata choice that goes with a push choice (module docstring).
    fixed: a configured pipeline (every path compressed, metadata lossless); else the per-path
    envelope at B, with the lossy metadata codec among the options only when the push is lossy.
    metadata: "auto" (as just said) or the codec to use whatever the push: "none" or one of
    METADATA_CODECS."""
    check_metadata_option(metadata)
    push = None if push_id in (None, UNCOMPRESSED.id) else push_id
    exact = exact_row_option(push)
    forced = None if metadata == "none" else metadata
    if fixed:
        meta = METADATA_CODEC if metadata == "auto" else forced
        return PathChoice(push, exact, meta, (("on_demand", "fixed"), ("metadata", "fixed")))
    if bandwidth_Bps is None or not bandwidth_Bps > 0:
        meta, why = (None, "no_estimate") if metadata == "auto" else (forced, "fixed")
        return PathChoice(push, None, meta, (("on_demand", "no_estimate"), ("metadata", why)))
    options = [None] + ([exact] if exact is not None else [])
    on_demand = min(options, key=lambda o: line_seconds(*costs.on_demand_line(o), bandwidth_Bps))
    why = "uncompressed push" if exact is None else "envelope"
    if metadata != "auto":
        return PathChoice(push, on_demand, forced, (("on_demand", why), ("metadata", "fixed")))
    meta_options = [None, METADATA_CODEC] + ([METADATA_Q8] if push is not None else [])
    meta = min(meta_options, key=lambda c: line_seconds(*costs.metadata_line(c), bandwidth_Bps))
    return PathChoice(push, on_demand, meta, (("on_demand", why), ("metadata", "envelope")))


def check_metadata_option(metadata: str) -> None:
    """Raises ValueError naming the choices unless `metadata` is "auto", "none" or a metadata codec."""
    if metadata not in ("auto", "none", *METADATA_CODECS):
        raise ValueError(f"metadata codec {metadata!r}: use 'auto', 'none' or one of {list(METADATA_CODECS)}")


# ---------------------------------------------------------------------------- on-demand replies
def padded_rows(n: int) -> int:
    """Rows a row-pipeline reply part is padded to: 16 * 2^k or 24 * 2^k (at most 1.5x n, two jit
    compilations per octave of reply sizes)."""
    size = REPLY_MIN_ROWS
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def encode_rows(pipeline, option: str | None, k_rows: np.ndarray, v_rows: np.ndarray, layer: int) -> bytes:
    """One request's part of an on-demand reply: its K and V rows (each [n, D]) as one container.

    option None: float32 rows; F16: the rows' float16 values (exact for a compressed request: its
    copy holds decoded float16 numbers) — both a plain checksummed section [2, n, D], no padding;
    a row pipeline: `k_rows`, `v_rows` must be the request's *original* float16 rows (what its
    chunks were encoded from), encoded by `pipeline` as one block [2, padded_rows(n), D]."""
    n, d = k_rows.shape
    if option in (None, F16):
        rows = np.stack([k_rows, v_rows]).astype(np.float32 if option is None else np.float16)
        return pack_container({"kind": "rows"}, [("rows", rows)], CodecSpec("none"))
    block = np.zeros((2, padded_rows(n), d), np.float16)
    block[0, :n], block[1, :n] = k_rows, v_rows
    return pipeline.encode_block(block, layer=int(layer), kind="v")


def decode_rows(data, n: int, head_dim: int) -> np.ndarray:
    """A reply part -> f32[2, n, D]. Raises ContainerError (a flipped bit, a wrong shape)."""
    header, sections = unpack_container(data)
    if header.get("kind") == "rows":
        x = sections.get("rows")
        if x is None or x.shape != (2, n, head_dim):
            raise ContainerError(f"on-demand rows are {None if x is None else x.shape}, expected {(2, n, head_dim)}")
        return x.astype(np.float32)
    x = np.asarray(decode_block(data), np.float32)
    if x.ndim != 3 or x.shape[0] != 2 or x.shape[1] < n or x.shape[2] != head_dim:
        raise ContainerError(f"on-demand rows decode to {x.shape}, expected [2, >= {n}, {head_dim}]")
    return x[:, :n]


def pack_framed_reply(parts: list[bytes]) -> bytes:
    """A framed "fetch" reply: one container per item of the request, in order."""
    return pack(dict(parts=[len(p) for p in parts])) + b"".join(parts)


# ---------------------------------------------------------------------------- metadata
def _shuffled(a: np.ndarray) -> np.ndarray:
    """The bytes of equal significance of every element together (float exponents compress,
    mantissas do not), flat uint8."""
    a = np.ascontiguousarray(a)
    return np.ascontiguousarray(a.reshape(-1).view(np.uint8).reshape(-1, a.dtype.itemsize).T).reshape(-1)


def _unshuffled(raw: np.ndarray, dt: np.dtype, shape) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    return np.ascontiguousarray(raw.reshape(dt.itemsize, count).T).reshape(-1).view(dt).reshape(shape).copy()


def quantize_rows_q8(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., d] -> (int8 codes [..., d], float16 scale [..., 1]): per row absmax / 127 (a row
    of zeros gets scale 1)."""
    f = np.asarray(a, np.float32)
    scale = (np.abs(f).max(-1, keepdims=True) / 127.0).astype(np.float16)
    scale = np.where(scale == 0, np.float16(1), scale)
    codes = np.clip(np.rint(f / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return codes, scale


def dequantize_rows_q8(codes: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """codes * scale in float32, cast to `dtype` (deterministic: both sides compute the same)."""
    return (codes.astype(np.float32) * scale.astype(np.float32)).astype(dtype)


def _q8_leaf(a) -> bool:
    a = np.asarray(a)
    return a.ndim >= 1 and a.shape[-1] > 0 and np.issubdtype(a.dtype, np.floating)


def q8_metadata_values(leaves: list[np.ndarray]) -> list[np.ndarray]:
    """What the decode side reads from `pack_metadata(..., METADATA_Q8)`: every float leaf with a
    row axis dequantized, the other leaves unchanged."""
    return [dequantize_rows_q8(*quantize_rows_q8(a), np.asarray(a).dtype) if _q8_leaf(a) else np.asarray(a)
            for a in leaves]


def pack_metadata(header: dict, leaves: list[np.ndarray], codec: str) -> bytes:
    """A "meta" payload whose leaves travel in one checksummed container: byte-shuffled for the
    lossless codec; with `METADATA_Q8` every float leaf as int8 codes (one section) and its per-row
    float16 scales (byte-shuffled, a second section). Compressed by the codec after the "+"."""
    if codec not in METADATA_CODECS:
        raise ValueError(f"metadata codec {codec!r}: one of {list(METADATA_CODECS)}")
    lossy = codec == METADATA_Q8
    sections, desc = [], []
    for i, a in enumerate(leaves):
        a = np.ascontiguousarray(a)
        if lossy and _q8_leaf(a):
            codes, scale = quantize_rows_q8(a)
            sections += [(f"leaf{i}", codes.reshape(-1).view(np.uint8)), (f"leaf{i}s", _shuffled(scale))]
            desc.append([list(a.shape), a.dtype.str, "q8"])
        else:
            sections.append((f"leaf{i}", _shuffled(a)))
            desc.append([list(a.shape), a.dtype.str])
    entropy = CodecSpec.parse(codec.split("+")[-1])
    container = pack_container({"kind": "metadata", "leaves": desc}, sections, entropy)
    return pack(dict(header, cmeta=1)) + container


def unpack_metadata(payload) -> list[np.ndarray]:
    """Leaves of a `pack_metadata` container. Raises ContainerError on any corruption."""
    header, sections = unpack_container(bytes(payload))
    desc = header.get("leaves")
    if (header.get("kind") != "metadata" or not isinstance(desc, list)
            or not all(isinstance(d, list) and len(d) in (2, 3) for d in desc)):
        raise ContainerError("metadata container: header does not describe its sections")
    q8 = [len(d) == 3 and d[2] == "q8" for d in desc]
    if len(sections) != len(desc) + sum(q8):
        raise ContainerError("metadata container: header does not describe its sections")
    out = []
    for i, d in enumerate(desc):
        try:
            dt = np.dtype(d[1])
            shape = tuple(int(x) for x in d[0])
            count = int(np.prod(shape, dtype=np.int64))
        except (TypeError, ValueError) as e:
            raise ContainerError(f"metadata leaf {i}: bad shape/dtype ({e})") from None
        raw = sections.get(f"leaf{i}")
        if not q8[i]:
            if raw is None or raw.size != count * dt.itemsize:
                raise ContainerError(f"metadata leaf {i}: {None if raw is None else raw.size} bytes for {shape} {dt}")
            out.append(_unshuffled(raw, dt, shape))
            continue
        scales = sections.get(f"leaf{i}s")
        rows = count // shape[-1] if shape and shape[-1] > 0 else -1
        if (not np.issubdtype(dt, np.floating) or rows < 0 or raw is None or raw.size != count
                or scales is None or scales.size != rows * 2):
            raise ContainerError(f"metadata leaf {i}: its q8 sections do not fit {shape} {dt}")
        codes = np.asarray(raw).view(np.int8).reshape(shape)
        out.append(dequantize_rows_q8(codes, _unshuffled(scales, np.dtype(np.float16), (*shape[:-1], 1)), dt))
    return out
