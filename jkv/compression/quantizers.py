"""Quantizer stage Q (KVServe §5.1 ❷): asymmetric group quantization with per-head bit widths.

One mechanism covers every quantizer of the strategy space. A `QuantPlan` fixes, for one block
`y: f32[H_kv, N, D]`, the bits of every KV head, the grouping axis and the group size:

- axis "token": each token's D channels are cut into groups of G (per-token quantization);
- axis "channel": each channel's N tokens are cut into groups of G (per-channel quantization);
- KIVI (Liu et al. 2024): keys per-channel, values per-token;
- mixed precision per layer and per KV head: any bits table [L][H_kv];
- MixHQ (§5.1): retrieval heads at `bits`, streaming heads at `low_bits` (see `heads.py`);
- bits 16 keeps a head unquantized in the block dtype;
- entropy-coded uniform quantization (`step` > 0, spec `ec<S>g<G>`): zero = mean(g), scale =
  max(step * std(g), max|g - mean| / 6.51) (fp16; the second term only for groups with outliers, so
  nothing is clipped), codes round((x - zero) / scale) in [-7, 7] stored as 4-bit
  nibbles (offset 7); the codec (zstd's Huffman literals) then spends ~entropy bits per value, so
  the rate follows the data instead of a fixed 2^b grid. This is entropy-constrained scalar
  quantization (CacheGen §5.2 arithmetic-codes its quantized deltas for the same reason): at the
  same error, a uniform step + entropy coder needs fewer bits than a fixed-rate min-max grid, whose
  range grows with the group's extremes. |x - x_hat| <= scale / 2 (+ fp16 rounding of zero and scale).

Asymmetric quantization of a group g: zero = min(g), scale = (max(g) - min(g)) / (2^b - 1), both
stored as float16 (metadata, counted in the CR) and rounded *before* computing codes so that
|x - x_hat| <= scale / 2 (+ float16 rounding of zero). Heads with equal bits are quantized together;
their sections are named `q<b>.codes|scale|zero` (or `raw`). `dequantize` writes straight into the
computation-ready layout f32[H_kv, N, D] in one jitted pass (no per-step unpacking later).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jkv.compression.heads import classify_heads
from jkv.compression.packing import pack_bits, packed_nbytes, unpack_bits
from jkv.compression.spec import HEAD_BITS, QuantizerSpec

SCALE_DTYPE = np.float16
AXES = ("token", "channel")
EC_BITS = 4  # entropy-coded plans: codes in [-EC_CLIP, EC_CLIP] stored as nibbles
EC_CLIP = 7
KINDS = ("k", "v")


@dataclass(frozen=True)
class QuantPlan:
    """Quantization of one block: `head_bits[h]` for each KV head, grouping `axis`, `group` size;
    `step` > 0 selects entropy-coded uniform quantization (step in units of the group's std; the
    quantized heads must then be 4-bit)."""

    head_bits: tuple[int, ...]
    axis: str = "token"
    group: int = 32
    step: float = 0.0

    def __post_init__(self):
        if not self.head_bits:
            raise ValueError("QuantPlan.head_bits must list one bit width per KV head")
        bad = set(self.head_bits) - set(HEAD_BITS)
        if bad:
            raise ValueError(f"head bit widths {sorted(bad)} unsupported; use {HEAD_BITS}")
        if self.axis not in AXES:
            raise ValueError(f"{self.axis=} must be one of {AXES}")
        if self.group < 1:
            raise ValueError(f"{self.group=} must be >= 1")
        if not (np.isfinite(self.step) and self.step >= 0):
            raise ValueError(f"{self.step=} must be a finite step >= 0 (0 = min-max quantization)")
        if self.step > 0 and set(self.head_bits) - {EC_BITS, 16}:
            raise ValueError(f"entropy-coded plans (step={self.step}) store {EC_BITS}-bit codes: "
                             f"head bits {self.head_bits} must be {EC_BITS} or 16")

    def head_sets(self) -> list[tuple[int, tuple[int, ...]]]:
        """[(bits, heads with those bits)] in increasing bits order."""
        return [(b, tuple(h for h, hb in enumerate(self.head_bits) if hb == b)) for b in sorted(set(self.head_bits))]

    def to_header(self) -> dict:
        out = {"head_bits": list(self.head_bits), "axis": self.axis, "group": self.group}
        if self.step:
            out["step"] = self.step  # absent for min-max plans: v1 headers stay byte-identical
        return out

    @classmethod
    def from_header(cls, obj: Mapping) -> "QuantPlan":
        return cls(tuple(int(b) for b in obj["head_bits"]), str(obj["axis"]), int(obj["group"]),
                   float(obj.get("step", 0.0)))


def make_plan(spec: QuantizerSpec, layer: int, kind: str, n_heads: int,
              retrieval_heads: np.ndarray | None = None) -> QuantPlan:
    """Plan for block (layer, K|V) with `n_heads` KV heads.

    `retrieval_heads: bool[L, H_kv]` is required by MixHQ (from `heads.classify_heads` or a
    DuoAttention-style score); other quantizers ignore it.
    """
    if kind not in KINDS:
        raise ValueError(f"{kind=} must be 'k' or 'v'")
    m = spec.method
    kivi_axis = "channel" if kind == "k" else "token"
    if m == "none":
        return QuantPlan((16,) * n_heads, "token", 1)
    if m == "ec":
        return QuantPlan((EC_BITS,) * n_heads, kivi_axis, spec.group, spec.step / 100)
    if m in ("tok", "ch", "kivi"):
        axis = {"tok": "token", "ch": "channel", "kivi": kivi_axis}[m]
        return QuantPlan((spec.bits,) * n_heads, axis, spec.group)
    if m == "mixed":
        if not 0 <= layer < len(spec.table):
            raise ValueError(f"{layer=} outside the mixed bits table of {len(spec.table)} layers")
        row = spec.table[layer]
        if len(row) != n_heads:
            raise ValueError(f"mixed bits table row {layer} has {len(row)} heads; block has H_kv={n_heads}")
        return QuantPlan(tuple(row), kivi_axis, spec.group)
    if retrieval_heads is None:
        raise ValueError("MixHQ needs retrieval_heads: bool[L, H_kv]; pass Calibration(head_scores=...) "
                         "or Calibration(retrieval_heads=...) when building the pipeline")
    retrieval = np.asarray(retrieval_heads, dtype=bool)
    if retrieval.ndim != 2 or retrieval.shape[1] != n_heads or not 0 <= layer < retrieval.shape[0]:
        raise ValueError(f"retrieval_heads shape {retrieval.shape} does not cover {layer=} with H_kv={n_heads}")
    return QuantPlan(tuple(spec.bits if r else spec.low_bits for r in retrieval[layer]), kivi_axis, spec.group)


def mixhq_retrieval_heads(spec: QuantizerSpec, head_scores: np.ndarray) -> np.ndarray:
    """bool[L, H_kv]: the top `retrieval_pct` % of heads by calibration score are retrieval heads."""
    return classify_heads(head_scores, spec.retrieval_pct / 100)


def _grouped_geometry(plan: QuantPlan, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """(other, padded grouped-axis length, effective group) for one head of a [H, N, D] block."""
    _, n, d = shape
    other, length = (n, d) if plan.axis == "token" else (d, n)
    group = min(plan.group, length)
    return other, -(-length // group) * group, group


def section_layout(plan: QuantPlan, shape: tuple[int, int, int], dtype) -> dict[str, tuple[tuple, np.dtype]]:
    """Sections the quantizer writes for a block of `shape` [H_kv, N, D]: name -> (shape, dtype)."""
    if len(plan.head_bits) != shape[0]:
        raise ValueError(f"plan covers {len(plan.head_bits)} heads; block has H_kv={shape[0]}")
    other, padded, group = _grouped_geometry(plan, shape)
    out: dict[str, tuple[tuple, np.dtype]] = {}
    for bits, heads in plan.head_sets():
        nh = len(heads)
        if bits == 16:
            out["raw"] = ((nh, shape[1], shape[2]), np.dtype(dtype))
            continue
        out[f"q{bits}.codes"] = ((packed_nbytes(nh * other * padded, bits),), np.dtype(np.uint8))
        out[f"q{bits}.scale"] = ((nh, other, padded // group), np.dtype(SCALE_DTYPE))
        out[f"q{bits}.zero"] = ((nh, other, padded // group), np.dtype(SCALE_DTYPE))
    return out


def quantize(y, plan: QuantPlan, store_dtype) -> dict:
    """y: f32[H_kv, N, D] -> sections (jnp arrays, shapes per `section_layout`). Traceable."""
    other, padded, group = _grouped_geometry(plan, y.shape)
    out = {}
    for bits, heads in plan.head_sets():
        part = y[jnp.asarray(heads)]  # [nh, N, D]
        if bits == 16:
            out["raw"] = part.astype(store_dtype)
            continue
        t = part if plan.axis == "token" else jnp.swapaxes(part, 1, 2)  # [nh, other, length]
        t = jnp.pad(t, ((0, 0), (0, 0), (0, padded - t.shape[2])), mode="edge")
        g = t.reshape(t.shape[0], other, padded // group, group)
        if plan.step > 0:  # entropy-coded uniform step (ECSQ): zero = mean, scale = step * std
            mean = g.mean(axis=-1)
            zero = mean.astype(SCALE_DTYPE)
            dev = g - mean[..., None]
            # never clip: a group whose extremes lie beyond +-7 steps gets a coarser step (at worst the
            # 15-level min-max grid), so |x - x_hat| <= scale / 2 holds for every value
            spread = jnp.max(jnp.abs(dev), axis=-1) / (EC_CLIP - 0.49)
            scale = jnp.maximum(plan.step * jnp.sqrt(jnp.mean(dev ** 2, axis=-1)), spread).astype(SCALE_DTYPE)
            zero32, scale32 = zero.astype(jnp.float32), scale.astype(jnp.float32)
            safe = jnp.where(scale32 > 0, scale32, 1.0)
            codes = (jnp.clip(jnp.round((g - zero32[..., None]) / safe[..., None]), -EC_CLIP, EC_CLIP)
                     + EC_CLIP).astype(jnp.uint8)
        else:
            qmax = (1 << bits) - 1
            lo, hi = g.min(axis=-1), g.max(axis=-1)
            zero = lo.astype(SCALE_DTYPE)
            scale = ((hi - lo) / qmax).astype(SCALE_DTYPE)
            zero32, scale32 = zero.astype(jnp.float32), scale.astype(jnp.float32)
            safe = jnp.where(scale32 > 0, scale32, 1.0)
            codes = jnp.clip(jnp.round((g - zero32[..., None]) / safe[..., None]), 0, qmax).astype(jnp.uint8)
        out[f"q{bits}.codes"] = pack_bits(codes, bits)
        out[f"q{bits}.scale"], out[f"q{bits}.zero"] = scale, zero
    return out


def dequantize(sections: Mapping, plan: QuantPlan, shape: tuple[int, int, int]):
    """Sections -> f32[H_kv, N, D] in head order (the computation-ready layout). Traceable."""
    h, n, d = shape
    other, padded, group = _grouped_geometry(plan, shape)
    parts, order = [], []
    for bits, heads in plan.head_sets():
        nh = len(heads)
        order.extend(heads)
        if bits == 16:
            parts.append(sections["raw"].astype(jnp.float32))
            continue
        codes = unpack_bits(sections[f"q{bits}.codes"], bits, nh * other * padded)
        codes = codes.reshape(nh, other, padded // group, group).astype(jnp.float32)
        if plan.step > 0:
            codes = codes - EC_CLIP
        scale = sections[f"q{bits}.scale"].astype(jnp.float32)[..., None]
        zero = sections[f"q{bits}.zero"].astype(jnp.float32)[..., None]
        t = (codes * scale + zero).reshape(nh, other, padded)[:, :, : (d if plan.axis == "token" else n)]
        parts.append(t if plan.axis == "token" else jnp.swapaxes(t, 1, 2))
    stacked = jnp.concatenate(parts, axis=0)  # heads in `order`
    if order == list(range(h)):
        return stacked
    return stacked[jnp.asarray(np.argsort(order))]
