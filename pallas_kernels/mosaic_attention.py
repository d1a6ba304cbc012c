"""Sparse decode attention as a Mosaic GPU kernel for Hopper (sm_90a): TMA, wgmma, online softmax.

    sparse_decode_attention_partials_mosaic(q: [B, H, D], k_sel, v_sel: [B*H_kv, k, D],
                                            valid_count: i32[B*H_kv]) -> (f32[B, H, D], f32[B, H])

Same contract as `sparse_attention.sparse_decode_attention_partials_pallas` (the Triton kernel)
and its reference: row r = b*H_kv + h_kv, its first valid_count[r] entries are attended, slots
past it may hold garbage (NaN) and never reach the output; an empty row gives o = 0, lse = -inf.

Design (one warpgroup = 128 threads per program, grid (row, split) as flash-decoding):
  - the G query heads of a KV group are padded to M = 64, the wgmma tile height, so one
    S = Q K^T wgmma scores all heads of the group against a tile of 64 entries;
  - K / V tiles of 64 entries go HBM -> swizzled SMEM by TMA, double-buffered: tile i+1 is in
    flight while tile i is computed on;
  - online softmax in f32 registers (WGMMA layout); P goes through SMEM to the P V wgmma (the
    CPU interpreter has no rule for a register-operand wgmma, and an SMEM operand costs 8 KiB);
  - the last tile of a split may start before its nominal start (clamped to k - 64, so no tile
    reads past the row and k need not be a multiple of 64): entries outside [nominal start,
    stop) are masked out of the softmax, and V rows past `stop` are zeroed in SMEM so garbage
    (0 x NaN) never reaches P V;
  - each split writes its unnormalised output, running max and sum; the wrapper merges splits
    in f32 as the Triton kernel does.

Selected-row gathers stay outside this kernel on Hopper (a per-row copy into swizzled SMEM is
rejected on sm_90; TMA gather is sm_100): callers pass the gathered k_sel / v_sel.
bf16 / f16 only (wgmma transposes only 16-bit operands); `dispatch` sends f32 to Triton.

Runs on an sm_90+ GPU, or on CPU under `plgpu.InterpretGPUParams()` (jax >= 0.11); exports for
cuda on jax 0.10-0.12.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.sparse_attention import _check_shapes, _default_splits, merge_splits

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    MOSAIC_AVAILABLE = hasattr(plgpu, "kernel")
except ImportError:  # pragma: no cover - depends on the installed JAX
    plgpu = None
    MOSAIC_AVAILABLE = False

# Interpreting Mosaic GPU kernels on CPU needs jax >= 0.11 (InterpretGPUParams).
INTERPRET_AVAILABLE = MOSAIC_AVAILABLE and hasattr(plgpu, "InterpretGPUParams")

WGMMA_M = 64  # rows of one warpgroup MMA: the padded query group
BLOCK_K = 64  # entries per K/V tile
_ROW_ALIGN = 8  # rows of one SMEM tile: TMA row offsets must be multiples of it
NUM_SLOTS = 2  # K/V tiles in SMEM at once (double buffering)
_M_INIT = -1e30  # finite start for the running max: exp(-inf - -inf) would be NaN
# 16-bit only: S = Q K^T reads K transposed from SMEM, which wgmma allows for 16-bit types only
# ("Only f16 WGMMA supports transposes" for f32/TF32); f32 inputs go to the Triton kernel.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _smem_transforms(dtype) -> tuple:
    # 128-byte swizzle (the widest): rows of 128 bytes tiled 8 high, as wgmma operands require.
    itemsize = jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))


def _kernel(valid_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem,
            q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_bar, k_bar, v_bar,
            *, scale: float, split_len: int, k: int, k_rows: int):
    # valid_gmem: i32[R]; q_gmem: [R, 64, D]; k_gmem / v_gmem: [R, k_rows, D], the caller's k
    # entries padded to k_rows (>= 64, a multiple of 8) so tiles never read past a row;
    # o_gmem: f32[R, S, 64, D]; m_gmem / l_gmem: f32[R, S, 64].
    row, split = lax.axis_index("row"), lax.axis_index("split")
    dtype = k_smem.dtype
    valid = jnp.clip(valid_gmem[row], 0, k)  # the caller's k: padding is never valid
    start = split * split_len
    stop = jnp.minimum(valid, start + split_len)
    num_tiles = jnp.maximum(pl.cdiv(stop - start, BLOCK_K), 0)

    def tile_start(i):  # clamped so a tile never reads past the row's k entries
        return jnp.minimum(start + i * BLOCK_K, k_rows - BLOCK_K)

    def fetch(i, slot):
        rows = (row, pl.ds(tile_start(i), BLOCK_K))
        plgpu.copy_gmem_to_smem(k_gmem.at[rows], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[rows], v_smem.at[slot], v_bar.at[slot])

    plgpu.copy_gmem_to_smem(q_gmem.at[row], q_smem, q_bar.at[0])

    @pl.when(num_tiles > 0)
    def _():
        fetch(0, 0)

    plgpu.barrier_wait(q_bar.at[0])
    layout = plgpu.Layout.WGMMA
    o = plgpu.layout_cast(jnp.zeros((WGMMA_M, o_smem.shape[1]), jnp.float32), layout)
    m = plgpu.layout_cast(jnp.full((WGMMA_M,), _M_INIT, jnp.float32), layout.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((WGMMA_M,), jnp.float32), layout.reduce(1))

    def body(i, carry):
        o, m, l = carry
        slot = lax.rem(i, NUM_SLOTS)

        # The other slot's last readers (tile i-1's wgmmas) completed: their results were read.
        @pl.when(i + 1 < num_tiles)
        def _():
            fetch(i + 1, 1 - slot)

        first = tile_start(i)
        nominal = start + i * BLOCK_K
        plgpu.barrier_wait(k_bar.at[slot])

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((WGMMA_M, BLOCK_K), jnp.float32)) * scale
        pos = first + plgpu.broadcasted_iota(jnp.int32, (WGMMA_M, BLOCK_K), 1, layout=layout)
        s = jnp.where((pos >= nominal) & (pos < stop), s, -jnp.inf)
        m_next = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
        l_next = l * correction + p.sum(axis=1)
        o = o * lax.broadcast_in_dim(correction, o.shape, [0])
        p_smem[...] = p.astype(dtype)
        plgpu.barrier_wait(v_bar.at[slot])

        @pl.when(first + BLOCK_K > stop)  # the tile runs past valid_count: zero those V rows
        def _():
            v_tile = v_smem.at[slot]
            entry = first + plgpu.broadcasted_iota(jnp.int32, v_tile.shape, 0, layout=layout)
            v_tile[...] = jnp.where(entry < stop, v_tile[...], jnp.zeros_like(v_tile[...]))

        plgpu.commit_smem()  # P (and a zeroed V) written by threads, read by the async wgmma

        def weighted_values(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        # A fresh accumulator, added in registers: the CPU interpreter runs wgmma only inside
        # `run_scoped` (not `run_state` with `ACC.init(o)`); the extra add is 64 x D FLOPs.
        o = o + pl.run_scoped(weighted_values, plgpu.ACC((WGMMA_M, o.shape[1]), jnp.float32))
        return o, m_next, l_next

    o, m, l = lax.fori_loop(0, num_tiles, body, (o, m, l))
    o_smem[...] = o
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[row, split])
    plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[row, split])
    plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[row, split])
    plgpu.wait_smem_to_gmem(0)


def check_supported(head_dim: int, dtype, group: int = 1) -> None:
    """Raise ValueError naming what the Mosaic kernel cannot take (dispatch then uses Triton)."""
    if not MOSAIC_AVAILABLE:
        raise ValueError(f"jax {jax.__version__} has no Mosaic GPU Pallas (plgpu.kernel)")
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{dtype=} must be bf16 or f16 for the Mosaic kernel (f32: use Triton)")
    row_bytes = head_dim * jnp.dtype(dtype).itemsize
    if head_dim % 16 or row_bytes % 128 or head_dim > 256:
        raise ValueError(
            f"{head_dim=} ({row_bytes} bytes a row) must be a multiple of 16, at most 256, with "
            "rows a multiple of 128 bytes (the SMEM swizzle) for the Mosaic kernel"
        )
    if group > WGMMA_M:
        raise ValueError(f"query group {group=} must be <= {WGMMA_M} (one wgmma tile)")


def sparse_decode_attention_partials_mosaic(
    q: jax.Array,  # [B, H, D]
    k_sel: jax.Array,  # [B*H_kv, k, D]
    v_sel: jax.Array,  # [B*H_kv, k, D]
    valid_count: jax.Array,  # i32[B*H_kv]
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # f32[B, H, D], f32[B, H]
    """Mosaic GPU flash-decoding (see module docstring). Use `dispatch` unless testing;
    interpret=True runs it on CPU (jax >= 0.11)."""
    batch, heads, head_dim, rows, k, group = _check_shapes(q, k_sel, v_sel, valid_count)
    check_supported(head_dim, k_sel.dtype, group)
    if interpret and not INTERPRET_AVAILABLE:
        raise RuntimeError(
            f"jax {jax.__version__} cannot interpret Mosaic GPU kernels on CPU "
            "(plgpu.InterpretGPUParams needs jax >= 0.11)"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dtype = k_sel.dtype
    # One tile must fit in the row, and the clamped start of the last tile (k - 64) must be a
    # multiple of the SMEM tiling's 8 rows (Mosaic requires TMA offsets it can prove aligned).
    # Otherwise pad: a copy of k_sel / v_sel, so callers should choose k % 8 == 0, k >= 64.
    k_rows = max(BLOCK_K, pl.cdiv(k, _ROW_ALIGN) * _ROW_ALIGN)
    if k_rows != k:
        pad = ((0, 0), (0, k_rows - k), (0, 0))
        k_sel, v_sel = jnp.pad(k_sel, pad), jnp.pad(v_sel, pad)
    splits = num_splits or _default_splits(rows, k)
    split_len = pl.cdiv(pl.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = pl.cdiv(k, split_len)
    q_rows = q.reshape(rows, group, head_dim).astype(dtype)  # head h -> KV head h // G
    q_rows = jnp.pad(q_rows, ((0, 0), (0, WGMMA_M - group), (0, 0)))  # [R, 64, D]
    transforms = _smem_transforms(dtype)
    f32 = jnp.float32
    o, m, l = plgpu.kernel(
        functools.partial(_kernel, scale=scale, split_len=split_len, k=k, k_rows=k_rows),
        out_type=(
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M, head_dim), f32),
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M), f32),
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M), f32),
        ),
        scratch_types=(
            plgpu.SMEM((WGMMA_M, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((NUM_SLOTS, BLOCK_K, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((NUM_SLOTS, BLOCK_K, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((WGMMA_M, BLOCK_K), dtype, transforms=_smem_transforms(dtype)),
            plgpu.SMEM((WGMMA_M, head_dim), f32),
            plgpu.SMEM((WGMMA_M,), f32),
            plgpu.SMEM((WGMMA_M,), f32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_barriers=NUM_SLOTS),
        ),
        grid=(rows, splits),
        grid_names=("row", "split"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(valid_count.astype(jnp.int32), q_rows, k_sel, v_sel)
    out, lse = merge_splits(o[:, :, :group], m[:, :, :group], l[:, :, :group])
    return out.reshape(batch, heads, head_dim), lse.reshape(batch, heads)
