"""Transform stage T of the pipeline (KVServe §5.1 ❶): reshape the KV distribution before quantizing.

All transforms act on one block `x: f32[H_kv, N, D]` (K or V of one layer) inside jit and return
`(y: f32[H_kv, N, D], side)`, where `side` maps names to arrays that travel in the container
(anchors, affine parameters: counted in the compression ratio). Side arrays are rounded to their
storage dtype *before* use, so `inverse(y, side)` is exact in real arithmetic; in floating point
the round trip is within float32 rounding (identity: bitwise).

- identity
- delta<G> (CacheGen-style): the first token of every run of G tokens is an anchor stored at the
  block dtype; every token (the anchor too, giving 0) is replaced by its difference to its anchor.
- hadamard (QuaRot-style): y = x @ H_D with H_D the orthonormal Sylvester-Hadamard matrix; H_D is
  symmetric and orthogonal, so the inverse is y @ H_D. D must be a power of two.
- affine (AffineQuant-style, per channel): y = (x - shift) / scale with shift/scale [H_kv, D]
  fitted per (layer, K|V) on calibration KV (mean, std); stored as float16 side arrays.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jkv.compression.spec import TransformSpec

AFFINE_STORE_DTYPE = np.float16


@functools.lru_cache(maxsize=16)
def hadamard_matrix(d: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix f32[d, d] (read-only, cached: every block's encode,
    layout check and decode asks for it, and building it with np.block cost ~15 % of the codec's
    CPU on the transfer path); `d` must be a power of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two head dim; got D={d}. "
                         "Use the identity/affine/delta transform for this model.")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(d)).astype(np.float32)
    h.flags.writeable = False
    return h


def side_layout(spec: TransformSpec, shape: tuple[int, int, int], dtype: np.dtype) -> dict[str, tuple[tuple, np.dtype]]:
    """Side arrays a transform stores for a block of `shape` [H_kv, N, D]: name -> (shape, dtype)."""
    h, n, d = shape
    if spec.name == "delta":
        return {"delta.anchors": ((h, -(-n // spec.group), d), np.dtype(dtype))}
    if spec.name == "affine":
        return {"affine.shift": ((h, d), np.dtype(AFFINE_STORE_DTYPE)),
                "affine.scale": ((h, d), np.dtype(AFFINE_STORE_DTYPE))}
    if spec.name == "hadamard":
        hadamard_matrix(d)  # validates D
    return {}


def forward(spec: TransformSpec, x, inputs: Mapping, store_dtype) -> tuple:
    """x: f32[H_kv, N, D] -> (y: f32[H_kv, N, D], side arrays). `inputs`: fitted params (affine)."""
    if spec.name == "identity":
        return x, {}
    if spec.name == "hadamard":
        return x @ jnp.asarray(hadamard_matrix(x.shape[-1])), {}
    if spec.name == "delta":
        anchors = x[:, :: spec.group, :].astype(store_dtype)  # [H_kv, ceil(N/G), D]
        return x - _expand_anchors(anchors, spec.group, x.shape[1]), {"delta.anchors": anchors}
    shift, scale = inputs["affine.shift"], inputs["affine.scale"]  # f16[H_kv, D]
    y = (x - shift.astype(jnp.float32)[:, None, :]) / scale.astype(jnp.float32)[:, None, :]
    return y, {"affine.shift": shift, "affine.scale": scale}


def inverse(spec: TransformSpec, y, side: Mapping):
    """y: f32[H_kv, N, D] and the block's side arrays -> x: f32[H_kv, N, D]."""
    if spec.name == "identity":
        return y
    if spec.name == "hadamard":
        return y @ jnp.asarray(hadamard_matrix(y.shape[-1]))
    if spec.name == "delta":
        return y + _expand_anchors(side["delta.anchors"], spec.group, y.shape[1])
    shift, scale = side["affine.shift"], side["affine.scale"]
    return y * scale.astype(jnp.float32)[:, None, :] + shift.astype(jnp.float32)[:, None, :]


def _expand_anchors(anchors, group: int, n: int):
    """anchors [H_kv, ceil(N/G), D] -> f32[H_kv, N, D] (each anchor repeated over its run)."""
    return jnp.repeat(anchors.astype(jnp.float32), group, axis=1)[:, :n, :]


def fit_affine(samples: np.ndarray, eps: float = 1e-3) -> dict[str, np.ndarray]:
    """Fit per-channel shift/scale on calibration KV `samples: [H_kv, N, D]` (or [B, H_kv, N, D]).

    Returns {"affine.shift", "affine.scale"}: f16[H_kv, D] (mean and std over tokens, std floored
    at `eps` so constant channels stay invertible).
    """
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 4:
        x = np.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[3])
    if x.ndim != 3 or x.shape[1] < 2:
        raise ValueError(f"affine calibration needs KV of shape [H_kv, N>=2, D]; got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("affine calibration KV contains NaN/inf")
    shift = x.mean(axis=1)
    scale = np.maximum(x.std(axis=1), eps)
    return {"affine.shift": shift.astype(AFFINE_STORE_DTYPE), "affine.scale": scale.astype(AFFINE_STORE_DTYPE)}
