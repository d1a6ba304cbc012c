"""Sparse decode attention over the selected KV entries (SmartGen §4.2, last step of a decode layer).

    sparse_decode_attention(q: [B, H, D], k_sel: [B*H_kv, k, D], v_sel: [B*H_kv, k, D],
                            valid_count: i32[B*H_kv]) -> [B, H, D]

One query token per request. Row r = b*H_kv + h_kv holds the entries selected for KV head h_kv;
its first valid_count[r] slots are valid, the rest are never read (they may hold garbage, e.g. a
lane that has not arrived yet). The G = H/H_kv query heads of a group share row r (GQA; query
head h uses KV head h // G). Entry order does not matter: softmax(q K^T / sqrt(D)) V is invariant
to permuting K and V together (SmartGen §4.2, "Reordering-based KV gathering").

Flash-decoding: the grid is (row, split); each program runs an online softmax over its slice of
the row in chunks of `block_k` and writes an unnormalised partial output with its running max m
and sum l. The wrapper merges the splits in f32 and returns the output with its log-sum-exp
lse = m + log(l), so two lanes attended separately (remote and local entries) merge exactly with
`merge_partials`: o = sum_i o_i * exp(lse_i - lse), lse = logaddexp(lse_1, lse_2). A row with no
valid entry yields o = 0, lse = -inf, and contributes nothing to a merge.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import clamp_len, compiler_params, next_pow2, plgpu

BLOCK_K = 64  # selected entries per loop step
_MIN_GROUP = 16  # Triton dots need every dimension >= 16: the query group is padded to it
_M_INIT = -1e30  # finite start for the running max: exp(-inf - -inf) would be NaN


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    # HIGHEST: f32 operands stay IEEE f32 on the GPU (the Triton default would round them to TF32).
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _attention_kernel(
    valid_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale: float, split_len: int
):
    # valid_ref: i32[R] (whole array), q_ref: [G_pad, D] (row r), k_ref / v_ref: [k, D] (row r),
    # o_ref: f32[G_pad, D], m_ref / l_ref: f32[G_pad] (row r, split s).
    row, split = pl.program_id(0), pl.program_id(1)
    group, head_dim = q_ref.shape
    valid = jnp.clip(valid_ref[row], 0, k_ref.shape[0])
    start = split * split_len
    stop = jnp.minimum(valid, start + split_len)
    q = q_ref[...]
    lanes = jnp.arange(BLOCK_K, dtype=jnp.int32)

    def body(c, carry):
        o, m, l = carry
        first = start + c * BLOCK_K
        live = first + lanes < stop
        block = (pl.ds(first, BLOCK_K), slice(None))
        # Masked loads: slots past valid_count may hold NaN; they must not reach a dot (0 * NaN).
        keys = plgpu.load(k_ref.at[block], mask=live[:, None], other=0.0)
        values = plgpu.load(v_ref.at[block], mask=live[:, None], other=0.0)
        logits = _dot(q, keys.T) * scale  # [G_pad, BLOCK_K]
        logits = jnp.where(live[None, :], logits, -jnp.inf)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = correction * l + jnp.sum(p, axis=1)
        o_next = correction[:, None] * o + _dot(p.astype(values.dtype), values)
        return o_next, m_next, l_next

    init = (
        jnp.zeros((group, head_dim), jnp.float32),
        jnp.full((group,), _M_INIT, jnp.float32),
        jnp.zeros((group,), jnp.float32),
    )
    num_blocks = jnp.maximum(pl.cdiv(stop - start, BLOCK_K), 0)
    o, m, l = lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def split_plan(rows: int, length: int, head_dim: int, scale: float | None,
               num_splits: int | None) -> tuple[float, int, int]:
    """(scale, splits, split_len) of flash-decoding `rows` rows of `length` entries: scale defaults
    to 1/sqrt(D); split_len is a whole number of BLOCK_K tiles, and no split is empty. Both the
    Triton and the Mosaic kernels take their grid from here."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    # Enough programs to fill an H100/H200 (132 SMs) twice, never splits shorter than 4 blocks.
    splits = num_splits or max(1, min(pl.cdiv(264, rows), pl.cdiv(length, 4 * BLOCK_K)))
    split_len = pl.cdiv(pl.cdiv(length, splits), BLOCK_K) * BLOCK_K
    return scale, pl.cdiv(length, split_len), split_len


def _check_shapes(q, k_sel, v_sel, valid_count):
    if q.ndim != 3 or k_sel.ndim != 3:
        raise ValueError(f"{q.shape=} must be [B, H, D] and {k_sel.shape=} [B*H_kv, k, D]")
    batch, heads, head_dim = q.shape
    rows, k, d_k = k_sel.shape
    if k == 0 or batch == 0:
        raise ValueError(f"{k_sel.shape=} and {q.shape=} must have k >= 1 and B >= 1")
    if v_sel.shape != k_sel.shape:
        raise ValueError(f"{v_sel.shape=} must equal {k_sel.shape=}")
    if d_k != head_dim:
        raise ValueError(f"head dim of {k_sel.shape=} must match {q.shape=}")
    if rows % batch:
        raise ValueError(f"{rows=} rows of k_sel must be B*H_kv for batch {batch}")
    kv_heads = rows // batch
    if heads % kv_heads:
        raise ValueError(f"{heads=} query heads must be a multiple of H_kv={kv_heads}")
    if valid_count.shape != (rows,):
        raise ValueError(f"{valid_count.shape=} must be ({rows},) = [B*H_kv]")
    return batch, heads, head_dim, rows, k, heads // kv_heads


def sparse_decode_attention_partials_pallas(
    q: jax.Array,  # [B, H, D]
    k_sel: jax.Array,  # [B*H_kv, k, D]
    v_sel: jax.Array,  # [B*H_kv, k, D]
    valid_count: jax.Array,  # i32[B*H_kv]
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # f32[B, H, D], f32[B, H]
    """Pallas flash-decoding (see module docstring). Use `dispatch` unless testing."""
    batch, heads, head_dim, rows, k, group = _check_shapes(q, k_sel, v_sel, valid_count)
    if head_dim < 16 or head_dim != next_pow2(head_dim):
        raise ValueError(f"{head_dim=} must be a power of two >= 16 for the Pallas kernel")
    scale, splits, split_len = split_plan(rows, k, head_dim, scale, num_splits)
    group_pad = max(_MIN_GROUP, next_pow2(group))
    q_rows = q.reshape(rows, group, head_dim).astype(k_sel.dtype)  # head h -> KV head h // G
    q_rows = jnp.pad(q_rows, ((0, 0), (0, group_pad - group), (0, 0)))  # [R, G_pad, D]
    kv_spec = pl.BlockSpec((None, k, head_dim), lambda r, s: (r, 0, 0))
    o, m, l = pl.pallas_call(
        functools.partial(_attention_kernel, scale=scale, split_len=split_len),
        grid=(rows, splits),
        in_specs=[
            pl.no_block_spec,
            pl.BlockSpec((None, group_pad, head_dim), lambda r, s: (r, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, group_pad, head_dim), lambda r, s: (r, s, 0, 0)),
            pl.BlockSpec((None, None, group_pad), lambda r, s: (r, s, 0)),
            pl.BlockSpec((None, None, group_pad), lambda r, s: (r, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, splits, group_pad, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((rows, splits, group_pad), jnp.float32),
            jax.ShapeDtypeStruct((rows, splits, group_pad), jnp.float32),
        ],
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="sparse_decode_attention",
    )(valid_count.astype(jnp.int32), q_rows, k_sel, v_sel)
    out, lse = merge_splits(o[:, :, :group], m[:, :, :group], l[:, :, :group])
    return out.reshape(batch, heads, head_dim), lse.reshape(batch, heads)


def merge_splits(
    o: jax.Array,  # f32[R, S, G, D], unnormalised per split
    m: jax.Array,  # f32[R, S, G], running max per split
    l: jax.Array,  # f32[R, S, G], running sum per split
) -> tuple[jax.Array, jax.Array]:  # (f32[R, G, D], lse f32[R, G])
    """Flash-decoding's final reduction over the splits, in f32; rows with no entry give
    o = 0, lse = -inf."""
    m_max = jnp.max(m, axis=1)  # [R, G]
    weight = jnp.exp(m - m_max[:, None])
    l_sum = jnp.sum(weight * l, axis=1)
    o_sum = jnp.sum(weight[..., None] * o, axis=1)
    has_any = l_sum > 0
    out = jnp.where(has_any[..., None], o_sum / jnp.where(has_any, l_sum, 1.0)[..., None], 0.0)
    lse = jnp.where(has_any, m_max + jnp.log(jnp.where(has_any, l_sum, 1.0)), -jnp.inf)
    return out, lse


def sparse_decode_attention_partials_reference(
    q: jax.Array,  # [B, H, D]
    k_sel: jax.Array,  # [B*H_kv, k, D]
    v_sel: jax.Array,  # [B*H_kv, k, D]
    valid_count: jax.Array,  # i32[B*H_kv]
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # f32[B, H, D], f32[B, H]
    """Dense masked softmax in f32; same contract as the kernel."""
    batch, heads, head_dim, rows, k, group = _check_shapes(q, k_sel, v_sel, valid_count)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    valid = jnp.arange(k)[None, :] < clamp_len(valid_count, k)[:, None]  # [R, k]
    keys = jnp.where(valid[..., None], k_sel.astype(jnp.float32), 0.0)
    values = jnp.where(valid[..., None], v_sel.astype(jnp.float32), 0.0)
    q_rows = q.reshape(rows, group, head_dim).astype(jnp.float32)
    logits = jnp.einsum("rgd,rkd->rgk", q_rows, keys, precision=lax.Precision.HIGHEST) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # -inf for empty rows
    probs = jnp.where(valid[:, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("rgk,rkd->rgd", probs, values, precision=lax.Precision.HIGHEST)
    return out.reshape(batch, heads, head_dim), lse.reshape(batch, heads)


def merge_partials(
    first: tuple[jax.Array, jax.Array],  # (f32[B, H, D], f32[B, H])
    second: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """Exact softmax merge of two attention results over disjoint entry sets (e.g. two lanes)."""
    (o1, lse1), (o2, lse2) = first, second
    lse = jnp.logaddexp(lse1, lse2)
    finite = jnp.isfinite(lse)
    safe_lse = jnp.where(finite, lse, 0.0)
    w1 = jnp.where(finite, jnp.exp(lse1 - safe_lse), 0.0)[..., None]
    w2 = jnp.where(finite, jnp.exp(lse2 - safe_lse), 0.0)[..., None]
    return w1 * o1 + w2 * o2, lse
