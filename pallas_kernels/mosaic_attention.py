"""Sparse decode attention as a Mosaic GPU kernel for Hopper (sm_90a): TMA, wgmma, online softmax.

    sparse_decode_attention_partials_mosaic(q: [B, H, D], k_sel, v_sel: [B*H_kv, k, D],
                                            valid_count: i32[B*H_kv]) -> (f32[B, H, D], f32[B, H])
    paged_decode_attention_partials_mosaic(q: [B, H, D], k_pages, v_pages: [num_pages, H_kv, P, D],
                                           page_table: i32[B, max_pages], lengths: i32[B])
                                           -> (f32[B, H, D], f32[B, H])

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

The paged variant is the same loop; a tile is 64 / P whole pages, one TMA copy each (the slot's
barrier expects that many arrivals), looked up in the page table (DESIGN.md's KV cache layout).

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


def _kernel(valid_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem, *scratch,
            scale: float, split_len: int, k: int, k_rows: int):
    # valid_gmem: i32[R]; q_gmem: [R, 64, D]; k_gmem / v_gmem: [R, k_rows, D], the caller's k
    # entries padded to k_rows (>= 64, a multiple of 8) so tiles never read past a row;
    # o_gmem: f32[R, S, 64, D]; m_gmem / l_gmem: f32[R, S, 64].
    row, split = lax.axis_index("row"), lax.axis_index("split")
    k_smem, v_smem, k_bar, v_bar = scratch[1], scratch[2], scratch[8], scratch[9]
    valid = jnp.clip(valid_gmem[row], 0, k)  # the caller's k: padding is never valid

    def tile_start(start, i):  # clamped so a tile never reads past the row's k entries
        return jnp.minimum(start + i * BLOCK_K, k_rows - BLOCK_K)

    def fetch(start, i, slot):
        rows = (row, pl.ds(tile_start(start, i), BLOCK_K))
        plgpu.copy_gmem_to_smem(k_gmem.at[rows], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[rows], v_smem.at[slot], v_bar.at[slot])

    _flash_split(q_gmem.at[row], o_gmem.at[row, split], m_gmem.at[row, split],
                 l_gmem.at[row, split], *scratch, valid=valid, start=split * split_len,
                 split_len=split_len, tile_start=tile_start, fetch=fetch, scale=scale)


def _paged_kernel(lengths_gmem, table_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem,
                  *scratch, scale: float, split_len: int, page_size: int, kv_heads: int):
    # lengths_gmem: i32[B]; table_gmem: i32[B, max_pages]; q_gmem: [B*H_kv, 64, D];
    # k_gmem / v_gmem: [num_pages, H_kv, P, D] (DESIGN.md's KV cache); o/m/l as in _kernel.
    row, split = lax.axis_index("row"), lax.axis_index("split")
    k_smem, v_smem, k_bar, v_bar = scratch[1], scratch[2], scratch[8], scratch[9]
    batch, head = lax.div(row, kv_heads), lax.rem(row, kv_heads)
    max_pages = table_gmem.shape[1]
    valid = jnp.clip(lengths_gmem[batch], 0, max_pages * page_size)
    num_pages = k_gmem.shape[0]

    def tile_start(start, i):  # pages are whole: a tile is 64 // P pages, never clamped
        return start + i * BLOCK_K

    def fetch(start, i, slot):
        first_page = lax.div(tile_start(start, i), page_size)
        for j in range(BLOCK_K // page_size):  # one TMA per page, all on the slot's barrier
            # Slots past the request's pages are masked out; clamp their ids into the cache.
            entry = table_gmem[batch, jnp.minimum(first_page + j, max_pages - 1)]
            page = jnp.clip(entry, 0, num_pages - 1)
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_gmem.at[page, head], k_smem.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[page, head], v_smem.at[slot, rows], v_bar.at[slot])

    _flash_split(q_gmem.at[row], o_gmem.at[row, split], m_gmem.at[row, split],
                 l_gmem.at[row, split], *scratch, valid=valid, start=split * split_len,
                 split_len=split_len, tile_start=tile_start, fetch=fetch, scale=scale)


def _flash_split(q_src, o_dst, m_dst, l_dst,
                 q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem, q_bar, k_bar, v_bar,
                 *, valid, start, split_len: int, tile_start, fetch, scale: float):
    """Online-softmax attention of the padded query group over entries [start, min(valid,
    start + split_len)) of one row, in 64-entry tiles that `fetch(start, i, slot)` brings into
    SMEM slot `slot` (tile i's first entry is `tile_start(start, i)`, which may precede its
    nominal start start + 64 i); writes the split's unnormalised o, running max m and sum l."""
    dtype = k_smem.dtype
    stop = jnp.minimum(valid, start + split_len)
    num_tiles = jnp.maximum(pl.cdiv(stop - start, BLOCK_K), 0)
    plgpu.copy_gmem_to_smem(q_src, q_smem, q_bar.at[0])

    @pl.when(num_tiles > 0)
    def _():
        fetch(start, 0, 0)

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
            fetch(start, i + 1, 1 - slot)

        first = tile_start(start, i)
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
    plgpu.copy_smem_to_gmem(o_smem, o_dst)
    plgpu.copy_smem_to_gmem(m_smem, m_dst)
    plgpu.copy_smem_to_gmem(l_smem, l_dst)
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
    body = functools.partial(_kernel, scale=scale, split_len=split_len, k=k, k_rows=k_rows)
    return _launch(body, q, group, rows, splits, dtype, interpret,
                   valid_count.astype(jnp.int32), k_sel, v_sel)


def _launch(body, q, group: int, rows: int, splits: int, dtype, interpret: bool, *operands,
            copies_per_tile: int = 1):
    """Run `body` on grid (row, split) with the shared scratch; operands = (leading int inputs...,
    keys, values), the padded queries inserted before the keys. A K (V) tile arrives in
    `copies_per_tile` TMA copies, each arriving once on the slot's barrier. Returns merged
    (out, lse)."""
    batch, heads, head_dim = q.shape
    q_rows = q.reshape(rows, group, head_dim).astype(dtype)  # head h -> KV head h // G
    q_rows = jnp.pad(q_rows, ((0, 0), (0, WGMMA_M - group), (0, 0)))  # [R, 64, D]
    transforms = _smem_transforms(dtype)
    f32 = jnp.float32
    o, m, l = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M, head_dim), f32),
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M), f32),
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M), f32),
        ),
        scratch_types=(
            plgpu.SMEM((WGMMA_M, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((NUM_SLOTS, BLOCK_K, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((NUM_SLOTS, BLOCK_K, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((WGMMA_M, BLOCK_K), dtype, transforms=transforms),
            plgpu.SMEM((WGMMA_M, head_dim), f32),
            plgpu.SMEM((WGMMA_M,), f32),
            plgpu.SMEM((WGMMA_M,), f32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=NUM_SLOTS),
        ),
        grid=(rows, splits),
        grid_names=("row", "split"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*operands[:-2], q_rows, *operands[-2:])
    out, lse = merge_splits(o[:, :, :group], m[:, :, :group], l[:, :, :group])
    return out.reshape(batch, heads, head_dim), lse.reshape(batch, heads)


def paged_decode_attention_partials_mosaic(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [num_pages, H_kv, P, D]
    v_pages: jax.Array,  # [num_pages, H_kv, P, D]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # f32[B, H, D], f32[B, H]
    """Decode attention of request b over its first lengths[b] cached tokens, read from the
    paged KV cache (DESIGN.md: token t of request b is slot t % P of page
    page_table[b, t // P]). Same kernel as the selected-row version; each 64-entry tile is
    64 / P page copies (TMA) into one SMEM slot. P must be 8, 16, 32 or 64. Table entries past
    a request's pages are never attended (their ids are clamped into the cache, then masked)."""
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"{q.shape=} must be [B, H, D], {k_pages.shape=} = {v_pages.shape=} "
                         "[num_pages, H_kv, P, D]")
    batch, heads, head_dim = q.shape
    _, kv_heads, page_size, d_k = k_pages.shape
    if d_k != head_dim or heads % kv_heads:
        raise ValueError(f"{k_pages.shape=} must have D = {head_dim} and divide H = {heads}")
    if page_size not in (8, 16, 32, 64):
        raise ValueError(f"page size P={page_size} must be 8, 16, 32 or 64 (whole pages per tile)")
    if page_table.ndim != 2 or page_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"{page_table.shape=} must be [B={batch}, max_pages], "
                         f"{lengths.shape=} ({batch},)")
    group = heads // kv_heads
    check_supported(head_dim, k_pages.dtype, group)
    if interpret and not INTERPRET_AVAILABLE:
        raise RuntimeError(
            f"jax {jax.__version__} cannot interpret Mosaic GPU kernels on CPU "
            "(plgpu.InterpretGPUParams needs jax >= 0.11)"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    rows = batch * kv_heads
    capacity = page_table.shape[1] * page_size
    splits = num_splits or _default_splits(rows, capacity)
    split_len = pl.cdiv(pl.cdiv(capacity, splits), BLOCK_K) * BLOCK_K
    splits = pl.cdiv(capacity, split_len)
    body = functools.partial(_paged_kernel, scale=scale, split_len=split_len,
                             page_size=page_size, kv_heads=kv_heads)
    return _launch(body, q, group, rows, splits, k_pages.dtype, interpret,
                   lengths.astype(jnp.int32), page_table.astype(jnp.int32), k_pages, v_pages,
                   copies_per_tile=BLOCK_K // page_size)


def paged_decode_attention_partials_reference(q, k_pages, v_pages, page_table, lengths, *,
                                              scale: float | None = None):
    """Gather each request's pages into rows [B*H_kv, max_pages*P, D], then the row reference."""
    from pallas_kernels.sparse_attention import sparse_decode_attention_partials_reference

    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    batch = q.shape[0]
    table = jnp.clip(page_table, 0, num_pages - 1)

    def rows(pages):  # [B, max_pages, H_kv, P, D] -> [B*H_kv, max_pages*P, D]
        g = pages[table].transpose(0, 2, 1, 3, 4)
        return g.reshape(batch * kv_heads, -1, head_dim)

    valid = jnp.repeat(lengths.astype(jnp.int32), kv_heads)
    return sparse_decode_attention_partials_reference(q, rows(k_pages), rows(v_pages), valid,
                                                      scale=scale)
