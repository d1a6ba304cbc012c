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

Precision. bf16 / f16 inputs: 16-bit wgmma operands, f32 accumulation and softmax. f32 inputs
(head dim 64 or 128) run as "3xbf16", not TF32: Hopper's wgmma reads a 32-bit B operand only
K-major, and V's tile ([entries, D], entries the contraction axis) is N-major in SMEM; a
transpose would need a register pass anyway, and TF32 keeps 10 mantissa bits. So each f32 K or
V tile, after its TMA copy, goes through registers once and is split into bf16 hi + lo
(x = hi + lo to 2^-18 relative; V rows past `stop` are zeroed in the same pass), Q and P are
split the same way, and each product is a_hi b_hi + a_hi b_lo + a_lo b_hi (three 16-bit wgmmas,
f32 accumulation; the dropped a_lo b_lo is <= 2^-18 relative): ~16 of f32's 24 mantissa bits.
Measured on unit-normal q, K, V (D = 64, k = 200, 20 seeds, numpy emulation against an f64
reference): output error <= 7e-6 (median 2e-6) for 3xbf16, vs median 1.4e-4 (max 2.4e-4)
for TF32 and 1e-3 for bf16; the interpreted kernel is within 1e-5 and the tests check 5e-5,
which TF32 would not meet. The CPU interpreter runs the same split products, so interpret-mode
tests measure this precision (the GPU differs only in summation order and its exp). f32 costs
3x the MMA work (the kernel stays memory-bound at decode sizes) and, at D = 128, stages o in
K's slot 0 to stay within the 227 KiB of SMEM an H200 block may use.

Runs on an sm_90+ GPU, or on CPU under `plgpu.InterpretGPUParams()` (jax >= 0.11); exports for
cuda on jax 0.10-0.12.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.sparse_attention import _check_shapes, merge_splits, split_plan

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
# f32 runs as 3xbf16 (module docstring): wgmma reads a 32-bit B operand only K-major, which
# V's tile is not, and its TF32 keeps 10 mantissa bits.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _smem_transforms(dtype) -> tuple:
    # 128-byte swizzle (the widest): rows of 128 bytes tiled 8 high, as wgmma operands require.
    itemsize = jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))


def _kernel(valid_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem, *scratch,
            scale: float, split_len: int, k: int, k_rows: int):
    # valid_gmem: i32[R]; q_gmem: [R, parts, 64, D] (parts: 1, or f32's bf16 hi / lo);
    # k_gmem / v_gmem: [R, k_rows, D], the caller's k entries padded to k_rows (>= 64, a
    # multiple of 8) so tiles never read past a row; o_gmem: f32[R, S, 64, D]; m_gmem /
    # l_gmem: f32[R, S, 64].
    row, split = lax.axis_index("row"), lax.axis_index("split")
    k_smem, v_smem, k_bar, v_bar = _kv_scratch(scratch)
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
    # lengths_gmem: i32[B]; table_gmem: i32[B, max_pages]; q_gmem: [B*H_kv, parts, 64, D];
    # k_gmem / v_gmem: [num_pages, H_kv, P, D] (DESIGN.md's KV cache); o/m/l as in _kernel.
    row, split = lax.axis_index("row"), lax.axis_index("split")
    k_smem, v_smem, k_bar, v_bar = _kv_scratch(scratch)
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


def _kv_scratch(scratch) -> tuple:
    """(k_smem, v_smem, k_bar, v_bar) out of `_launch`'s scratch tuple."""
    return scratch[1], scratch[2], scratch[7], scratch[8]


def _split_bf16(x):
    """f32 x -> (hi, lo) bf16 with hi + lo = x to 2^-18 relative (hi keeps 8 significant bits,
    lo the next 8)."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _split_tile(extra, tile, keep=None):
    """f32 SMEM `tile` -> its (hi, lo) bf16 split in `extra` [2, ...], through registers (rows
    where `keep(shape)` is false become 0). wgmma reads 32-bit B operands only K-major (no
    transpose), which V (entries x D, N-major) is not, and TF32 would keep 10 mantissa bits;
    16-bit operands may be transposed."""
    x = tile[...]
    if keep is not None:
        x = jnp.where(keep(x.shape), x, jnp.zeros_like(x))
    hi, lo = _split_bf16(x)
    # `extra` is the B operand of the previous wgmma, which each warp waited for on its
    # own: a warpgroup barrier first, so no warp overwrites rows another still reads.
    plgpu.commit_smem()
    extra.at[0][...] = hi
    extra.at[1][...] = lo
    plgpu.commit_smem()  # written by threads, read by the async wgmma


def _mma3(acc_ref, a, b):
    """acc += a b for a = (a_hi, a_lo), b = (b_hi, b_lo): a_hi b_hi + a_hi b_lo + a_lo b_hi, the
    small terms first; a_lo b_lo (<= 2^-18 relative) is dropped."""
    plgpu.wgmma(acc_ref, a[0], b[1])
    plgpu.wgmma(acc_ref, a[1], b[0])
    plgpu.wgmma(acc_ref, a[0], b[0])


def _stage_p_and_v(p, p_smem, v_tile, extra, first, stop, layout, split3: bool):
    """Write the probabilities P into `p_smem` and make the V tile safe for P V: rows at or past
    `stop` become 0 (they may be garbage, and 0 x NaN must not reach the product); f32 V is
    split into `extra` (whose split of K the scores' wgmmas already read)."""
    if split3:
        p_smem.at[0][...], p_smem.at[1][...] = _split_bf16(p)

        def keep(shape):
            return first + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout) < stop

        _split_tile(extra, v_tile, keep)
        return
    p_smem.at[0][...] = p.astype(v_tile.dtype)

    @pl.when(first + BLOCK_K > stop)  # the tile runs past valid_count: zero those V rows
    def _():
        entry = first + plgpu.broadcasted_iota(jnp.int32, v_tile.shape, 0, layout=layout)
        v_tile[...] = jnp.where(entry < stop, v_tile[...], jnp.zeros_like(v_tile[...]))

    plgpu.commit_smem()  # P (and a zeroed V) written by threads, read by the async wgmma


def _flash_split(q_src, o_dst, m_dst, l_dst,
                 q_smem, k_smem, v_smem, p_smem, m_smem, l_smem, q_bar, k_bar, v_bar, extra,
                 *, valid, start, split_len: int, tile_start, fetch, scale: float):
    """Online-softmax attention of the padded query group over entries [start, min(valid,
    start + split_len)) of one row, in 64-entry tiles that `fetch(start, i, slot)` brings into
    SMEM slot `slot` (tile i's first entry is `tile_start(start, i)`, which may precede its
    nominal start start + 64 i); writes the split's unnormalised o, running max m and sum l.

    16-bit K / V: `extra` is the f32 [64, D] staging buffer of o; q_smem [1, 64, D], p_smem
    [1, 64, 64]. f32 K / V (3xbf16, see the module docstring): `extra` is the bf16 [2, 64, D]
    (hi, lo) split of the current K, then V, tile; q_smem [2, 64, D] and p_smem [2, 64, 64]
    hold (hi, lo) too, and o is staged in K's slot 0 (free once the last tile was scored)."""
    split3 = k_smem.dtype == jnp.float32
    stop = jnp.minimum(valid, start + split_len)
    num_tiles = jnp.maximum(pl.cdiv(stop - start, BLOCK_K), 0)
    for part in range(q_smem.shape[0]):
        # One TMA per part (the barrier expects each): [2, 64, 128] bf16 in one copy would need
        # a 6-dimensional TMA box once tiled, one more than TMA has.
        plgpu.copy_gmem_to_smem(q_src.at[part], q_smem.at[part], q_bar.at[0])

    @pl.when(num_tiles > 0)
    def _():
        fetch(start, 0, 0)

    plgpu.barrier_wait(q_bar.at[0])
    layout = plgpu.Layout.WGMMA
    o = plgpu.layout_cast(jnp.zeros((WGMMA_M, q_smem.shape[-1]), jnp.float32), layout)
    m = plgpu.layout_cast(jnp.full((WGMMA_M,), _M_INIT, jnp.float32), layout.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((WGMMA_M,), jnp.float32), layout.reduce(1))

    def body(i, carry):
        o, m, l = carry
        slot = lax.rem(i, NUM_SLOTS)

        # The other slot's last readers (tile i-1's wgmmas, or its split's register loads)
        # completed: their results were read.
        @pl.when(i + 1 < num_tiles)
        def _():
            fetch(start, i + 1, 1 - slot)

        first = tile_start(start, i)
        nominal = start + i * BLOCK_K
        plgpu.barrier_wait(k_bar.at[slot])
        if split3:
            _split_tile(extra, k_smem.at[slot])  # `extra` is free: tile i-1's P V wgmmas were read

        def scores(acc_ref):
            if split3:
                _mma3(acc_ref, (q_smem.at[0], q_smem.at[1]), (extra.at[0].T, extra.at[1].T))
            else:
                plgpu.wgmma(acc_ref, q_smem.at[0], k_smem.at[slot].T)
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((WGMMA_M, BLOCK_K), jnp.float32)) * scale
        pos = first + plgpu.broadcasted_iota(jnp.int32, (WGMMA_M, BLOCK_K), 1, layout=layout)
        s = jnp.where((pos >= nominal) & (pos < stop), s, -jnp.inf)
        m_next = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
        l_next = l * correction + p.sum(axis=1)
        o = o * lax.broadcast_in_dim(correction, o.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        _stage_p_and_v(p, p_smem, v_smem.at[slot], extra, first, stop, layout, split3)

        def weighted_values(acc_ref):
            if split3:
                _mma3(acc_ref, (p_smem.at[0], p_smem.at[1]), (extra.at[0], extra.at[1]))
            else:
                plgpu.wgmma(acc_ref, p_smem.at[0], v_smem.at[slot])
            return acc_ref[...]

        # A fresh accumulator, added in registers: the CPU interpreter runs wgmma only inside
        # `run_scoped` (not `run_state` with `ACC.init(o)`); the extra add is 64 x D FLOPs.
        o = o + pl.run_scoped(weighted_values, plgpu.ACC((WGMMA_M, o.shape[1]), jnp.float32))
        return o, m_next, l_next

    o, m, l = lax.fori_loop(0, num_tiles, body, (o, m, l))
    # f32: K's slot 0 stages o (SMEM is short at D = 128); every K tile fetched was waited for.
    _store_split((o, m, l), (k_smem.at[0] if split3 else extra, m_smem, l_smem), (o_dst, m_dst, l_dst))


def _store_split(values, smem, gmem):
    """Write a split's (o, m, l) registers to GMEM through their SMEM staging buffers."""
    for value, buf in zip(values, smem):
        buf[...] = value
    plgpu.commit_smem()
    for buf, dst in zip(smem, gmem):
        plgpu.copy_smem_to_gmem(buf, dst)
    plgpu.wait_smem_to_gmem(0)


def check_supported(head_dim: int, dtype, group: int = 1, interpret: bool = False) -> None:
    """Raise ValueError naming what the Mosaic kernel cannot take (dispatch then uses Triton), and
    RuntimeError when interpret=True asks for a CPU interpreter this jax does not have."""
    if not MOSAIC_AVAILABLE:
        raise ValueError(f"jax {jax.__version__} has no Mosaic GPU Pallas (plgpu.kernel)")
    if interpret and not INTERPRET_AVAILABLE:
        raise RuntimeError(
            f"jax {jax.__version__} cannot interpret Mosaic GPU kernels on CPU "
            "(plgpu.InterpretGPUParams needs jax >= 0.11)"
        )
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{dtype=} must be bf16, f16 or f32 for the Mosaic kernel")
    if jnp.dtype(dtype) == jnp.float32:
        # Its bf16 (hi, lo) tiles need 128-byte bf16 rows; at D > 128 the f32 K / V slots and
        # the split tiles overflow the 227 KiB of SMEM an H200 block may use.
        if head_dim not in (64, 128):
            raise ValueError(f"{head_dim=} must be 64 or 128 for the Mosaic kernel in f32 "
                             "(bf16 split rows of 128 bytes, SMEM)")
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
    check_supported(head_dim, k_sel.dtype, group, interpret)
    dtype = k_sel.dtype
    # One tile must fit in the row, and the clamped start of the last tile (k - 64) must be a
    # multiple of the SMEM tiling's 8 rows (Mosaic requires TMA offsets it can prove aligned).
    # Otherwise pad: a copy of k_sel / v_sel, so callers should choose k % 8 == 0, k >= 64.
    k_rows = max(BLOCK_K, pl.cdiv(k, _ROW_ALIGN) * _ROW_ALIGN)
    if k_rows != k:
        pad = ((0, 0), (0, k_rows - k), (0, 0))
        k_sel, v_sel = jnp.pad(k_sel, pad), jnp.pad(v_sel, pad)
    scale, splits, split_len = split_plan(rows, k, head_dim, scale, num_splits)
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
    q_rows = q.reshape(rows, group, head_dim).astype(jnp.float32)  # head h -> KV head h // G
    q_rows = jnp.pad(q_rows, ((0, 0), (0, WGMMA_M - group), (0, 0)))  # [R, 64, D]
    f32, bf16 = jnp.float32, jnp.bfloat16
    if jnp.dtype(dtype) == f32:  # 3xbf16: the queries' (hi, lo) split, once, here
        q_rows = jnp.stack(_split_bf16(q_rows), axis=1)  # [R, 2, 64, D] bf16
        mma_dtype, extra = bf16, plgpu.SMEM((2, BLOCK_K, head_dim), bf16,
                                            transforms=_smem_transforms(bf16))
    else:
        q_rows = q_rows.astype(dtype)[:, None]  # [R, 1, 64, D]
        mma_dtype, extra = dtype, plgpu.SMEM((WGMMA_M, head_dim), f32)  # o's staging buffer
    parts = q_rows.shape[1]
    kv_transforms, mma_transforms = _smem_transforms(dtype), _smem_transforms(mma_dtype)
    o, m, l = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M, head_dim), f32),
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M), f32),
            jax.ShapeDtypeStruct((rows, splits, WGMMA_M), f32),
        ),
        scratch_types=(
            plgpu.SMEM((parts, WGMMA_M, head_dim), mma_dtype, transforms=mma_transforms),
            plgpu.SMEM((NUM_SLOTS, BLOCK_K, head_dim), dtype, transforms=kv_transforms),
            plgpu.SMEM((NUM_SLOTS, BLOCK_K, head_dim), dtype, transforms=kv_transforms),
            plgpu.SMEM((parts, WGMMA_M, BLOCK_K), mma_dtype, transforms=mma_transforms),
            plgpu.SMEM((WGMMA_M,), f32),
            plgpu.SMEM((WGMMA_M,), f32),
            plgpu.Barrier(num_arrivals=parts, num_barriers=1),
            plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=NUM_SLOTS),
            plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=NUM_SLOTS),
            extra,
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
    check_supported(head_dim, k_pages.dtype, group, interpret)
    rows = batch * kv_heads
    capacity = page_table.shape[1] * page_size
    scale, splits, split_len = split_plan(rows, capacity, head_dim, scale, num_splits)
    body = functools.partial(_paged_kernel, scale=scale, split_len=split_len,
                             page_size=page_size, kv_heads=kv_heads)
    return _launch(body, q, group, rows, splits, k_pages.dtype, interpret,
                   lengths.astype(jnp.int32), page_table.astype(jnp.int32), k_pages, v_pages,
                   copies_per_tile=BLOCK_K // page_size)


def paged_decode_attention_partials_reference(q, k_pages, v_pages, page_table, lengths, *,
                                              scale: float | None = None):
    """Gather each request's pages into rows [B*H_kv, max_pages*P, D], then the row reference.

    The gathered rows are a copy of the requests' KV ([B*H_kv, max_pages*P, D] each for K and V,
    the pool's dtype). Were the gather to read only the page pool and the table, XLA's scheduler
    would hoist every layer's gather to the start of a whole decode step: 60 copies live at once
    (401 MB of temporaries at SmolLM2 b=8, 1K context), each read back from DRAM when its layer
    runs. So the page indices depend on q's data, each row's on its own query only (a row whose
    query is NaN reads the null page 0: its output is NaN either way; other rows are untouched), and each layer gathers just before its attention: one layer's copies
    live at a time (14 MB; docs/performance.md). `lax.optimization_barrier` does not do this:
    XLA:CPU removes it before scheduling."""
    from pallas_kernels.sparse_attention import sparse_decode_attention_partials_reference

    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    batch = q.shape[0]
    table = jnp.where(jnp.isnan(q[:, 0, :1]), 0, jnp.clip(page_table, 0, num_pages - 1))  # per row

    def rows(pages):  # [B, max_pages, H_kv, P, D] -> [B*H_kv, max_pages*P, D]
        g = pages[table].transpose(0, 2, 1, 3, 4)
        return g.reshape(batch * kv_heads, -1, head_dim)

    valid = jnp.repeat(lengths.astype(jnp.int32), kv_heads)
    return sparse_decode_attention_partials_reference(q, rows(k_pages), rows(v_pages), valid,
                                                      scale=scale)
