"""Gather of the selected KV rows from the paged cache (SmartGen §4.2, between split and attention).

    paged_gather(k_pages, v_pages: [num_pages, H_kv, P, D], page_table: i32[B, max_pages],
                 kv_index: i32[B*H_kv, k]) -> (k_sel, v_sel: [B, H_kv, k, D])

Row r = b*H_kv + h of kv_index lists token positions of request b for KV head h (what top-k and
`split_reorder` produce). Entry j of row r is token t = kv_index[r, j], read from page
page_table[b, t // P], slot t % P, head h; the output keeps selection order, so k_sel / v_sel are
the contiguous buffers the sparse attention kernels take (reshaped [B*H_kv, k, D], free).

Every slot is defined, so the kernel and the reference agree bit for bit on the whole output:
  - a negative entry (the -1 past a row's valid prefix) reads slot 0 of the null page 0 (never
    attended: the attention kernels stop at the valid count);
  - a position past the table (t // P >= max_pages) reads the table's last entry, slot t % P;
  - a table entry outside [0, num_pages) wraps once if negative, then is clamped into the cache
    (the way XLA's gather reads such an index), so no read leaves the cache.

The kernel (Pallas Triton, grid (row, block of BLOCK entries)): load BLOCK indices of the row,
look their pages up in the request's table row with an indexed load, and copy the [BLOCK, D] K
and V rows with indexed loads from the cache viewed as [num_pages*H_kv*P, D] (a free reshape)
into the row's output slots. Each copied row is D contiguous elements (128-256 bytes at D = 64 /
128 in 16 bits), so the loads coalesce per row. Triton offsets are 32-bit: a cache of 2^31
elements or more per layer is refused here (dispatch then uses the reference).

On Hopper this stays outside the Mosaic attention kernel: a per-row copy into swizzled SMEM is
rejected on sm_90 (TMA gather is sm_100), so the rows are gathered here first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import compiler_params, masked_scatter_index, next_pow2, plgpu

BLOCK = 64  # selected entries per program
NULL_PAGE = 0  # jkv.kvcache.pages.NULL_PAGE: where a -1 entry reads (pallas_kernels imports no jkv)
MAX_CACHE_ELEMENTS = 2**31 - 1  # Triton's 32-bit offsets into the flattened cache


def _cache_page(page: jax.Array, num_pages: int) -> jax.Array:
    """A table entry as a page of the cache: negative wraps once, then clamps into [0, num_pages)."""
    return jnp.clip(jnp.where(page < 0, page + num_pages, page), 0, num_pages - 1)


def _gather_kernel(index_ref, table_ref, k_ref, v_ref, k_out_ref, v_out_ref, *, kv_heads: int,
                   page_size: int, num_pages: int):
    # index_ref: i32[k] (row r), table_ref: i32[max_pages] (request r // H_kv), k_ref / v_ref:
    # [num_pages*H_kv*P, D] (the whole cache), k_out_ref / v_out_ref: [k, D] (row r). Program
    # (r, c) copies entries [c*BLOCK, (c+1)*BLOCK) of row r.
    row, block = pl.program_id(0), pl.program_id(1)
    k = index_ref.shape[0]
    max_pages = table_ref.shape[0]
    head_dim = k_ref.shape[1]
    slot = block * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    live = slot < k
    index = plgpu.load(index_ref.at[slot], mask=live, other=-1)
    safe = jnp.maximum(index, 0)
    entry = jnp.clip(safe // page_size, 0, max_pages - 1)
    page = plgpu.load(table_ref.at[entry], mask=live, other=NULL_PAGE)
    page = jnp.where(index >= 0, _cache_page(page, num_pages), NULL_PAGE)
    source = (page * kv_heads + row % kv_heads) * page_size + safe % page_size
    cols = jnp.arange(next_pow2(head_dim), dtype=jnp.int32)  # Triton tiles are powers of two
    copy = live[:, None] & (cols < head_dim)[None, :]
    target = masked_scatter_index(slot, live, k)[:, None], cols[None, :]
    for cache_ref, out_ref in ((k_ref, k_out_ref), (v_ref, v_out_ref)):
        rows = plgpu.load(cache_ref.at[source[:, None], cols[None, :]], mask=copy, other=0)
        plgpu.store(out_ref.at[target], rows, mask=copy)


def check_cache_size(k_pages: jax.Array) -> None:
    """Raise ValueError when the cache is too large for the kernel's 32-bit offsets."""
    if k_pages.size > MAX_CACHE_ELEMENTS:
        raise ValueError(f"a cache of {k_pages.size} elements per layer exceeds the Triton gather's "
                         f"32-bit offsets ({MAX_CACHE_ELEMENTS})")


def paged_gather_pallas(
    k_pages: jax.Array,  # [num_pages, H_kv, P, D]
    v_pages: jax.Array,  # [num_pages, H_kv, P, D]
    page_table: jax.Array,  # i32[B, max_pages]
    kv_index: jax.Array,  # i32[B*H_kv, k]
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # [B, H_kv, k, D] x 2
    """Pallas paged gather (see module docstring). Use `dispatch.paged_gather` unless testing."""
    check_cache_size(k_pages)
    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    batch, max_pages = page_table.shape
    rows, k = kv_index.shape
    out_shape = jax.ShapeDtypeStruct((rows, k, head_dim), k_pages.dtype)
    if k == 0:  # nothing selected: no launch (a grid axis of 0 programs)
        empty = jnp.zeros((batch, kv_heads, 0, head_dim), k_pages.dtype)
        return empty, empty
    out_spec = pl.BlockSpec((None, k, head_dim), lambda r, c: (r, 0, 0))
    k_sel, v_sel = pl.pallas_call(
        functools.partial(_gather_kernel, kv_heads=kv_heads, page_size=page_size, num_pages=num_pages),
        grid=(rows, pl.cdiv(k, BLOCK)),
        in_specs=[
            pl.BlockSpec((None, k), lambda r, c: (r, 0)),
            pl.BlockSpec((None, max_pages), lambda r, c: (r // kv_heads, 0)),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=[out_spec, out_spec],
        out_shape=[out_shape, out_shape],
        compiler_params=compiler_params(num_warps=4),
        interpret=interpret,
        name="paged_gather",
    )(
        kv_index.astype(jnp.int32),
        page_table.astype(jnp.int32),
        k_pages.reshape(-1, head_dim),
        v_pages.reshape(-1, head_dim),
    )
    return (k_sel.reshape(batch, kv_heads, k, head_dim), v_sel.reshape(batch, kv_heads, k, head_dim))


def paged_gather_reference(
    k_pages: jax.Array,  # [num_pages, H_kv, P, D]
    v_pages: jax.Array,  # [num_pages, H_kv, P, D]
    page_table: jax.Array,  # i32[B, max_pages]
    kv_index: jax.Array,  # i32[B*H_kv, k]
) -> tuple[jax.Array, jax.Array]:  # [B, H_kv, k, D] x 2
    """XLA gather with the kernel's contract (the CPU path; what jkv's decode worker ran before)."""
    num_pages, kv_heads, page_size, _ = k_pages.shape
    batch, max_pages = page_table.shape
    index = kv_index.reshape(batch, kv_heads, -1)
    safe = jnp.maximum(index, 0)
    entry = jnp.clip(safe // page_size, 0, max_pages - 1)
    page = jnp.take_along_axis(page_table[:, None, :], entry, axis=2)
    page = jnp.where(index >= 0, _cache_page(page, num_pages), NULL_PAGE)
    heads = jnp.arange(kv_heads, dtype=jnp.int32)[None, :, None]
    slot = safe % page_size
    return k_pages[page, heads, slot], v_pages[page, heads, slot]
