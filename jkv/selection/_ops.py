"""Device ops the selectors call, in one place.

Local shim until `pallas_kernels.dispatch` is merged; the lead swaps these imports for
`from pallas_kernels.dispatch import topk_select` (same signature and semantics).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_select(scores: jax.Array, valid_len: jax.Array, k: int) -> jax.Array:
    """Per-row top-k indices of `scores`.

    scores: f32[R, N]; valid_len: i32[R] (columns >= valid_len[r] are never chosen); k: static int.
    Returns i32[R, k]: indices by descending score, ties broken by the lower index first,
    -1 in every slot past min(k, valid_len[r]).
    """
    num_rows, n = scores.shape
    if k > n:
        raise ValueError(f"{k=} must be <= the number of columns {n}")
    columns = jnp.arange(n, dtype=jnp.int32)
    valid = columns[None, :] < valid_len[:, None]
    masked = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    # lax.top_k is stable (lower index first among equal values).
    _, index = jax.lax.top_k(masked, k)
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    return jnp.where(slot < jnp.minimum(k, valid_len)[:, None], index.astype(jnp.int32), -1)
