"""KV index splitting and reordering (SmartGen §4.2, Algorithm 1).

    split_reorder(kv_index: i32[R, k], kv_mask: i8[B, N], heads_per_batch=H_kv)
        -> reordered: i32[R, k], remote_count: i32[R], local_count: i32[R]

Row r belongs to request b = r // H_kv. Each entry's mask value is kv_mask[b, kv_index[r, j]]
(Algorithm 1 op 1): 2 = remote (still on the prefill node), 1 = local (in the decode host pool),
anything else = padding; the sentinel -1 and any index outside [0, N) also count as padding, so a
bad index is never read. Each row is stably sorted by mask value descending (ops 4-5): remote
entries first, so the remote lane receives them row-contiguously, then local entries, then
padding slots, which are written as -1.

The kernel is a counting sort (one program per row): a first pass gathers the mask values and
counts remote/local entries; a second pass places each entry at
`bucket_start + entries of its bucket before it`, computed with a forward cumsum per chunk, via an
indexed store. Both lower to Triton (no sort, no jnp gather).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import compiler_params, masked_scatter_index, plgpu

REMOTE, LOCAL, PADDING = 2, 1, 0
CHUNK = 512  # index entries per loop step
_BUCKETS = 4  # remote, local, padding (+1 unused: Triton tensors need power-of-two sizes)


def _bucket_of(index_ref, mask_ref, c):
    """Loads chunk c of a row: (live lanes, index, bucket one-hot i32[CHUNK, 4], remote, local)."""
    k = index_ref.shape[0]
    n = mask_ref.shape[0]
    slot = c * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
    live = slot < k
    index = plgpu.load(index_ref.at[pl.ds(c * CHUNK, CHUNK)], mask=live, other=-1)
    in_range = live & (index >= 0) & (index < n)
    # Algorithm 1 op 1: mask <- kv_mask[kv_index] (indexed load; out-of-range reads nothing).
    mask_val = plgpu.load(
        mask_ref.at[jnp.where(in_range, index, 0)], mask=in_range, other=0
    ).astype(jnp.int32)
    remote = live & (mask_val == REMOTE)
    local = live & (mask_val == LOCAL)
    padding = live & ~remote & ~local
    bucket = jnp.where(remote, 0, jnp.where(local, 1, 2))
    hot = ((bucket[:, None] == jnp.arange(_BUCKETS)[None, :]) & live[:, None]).astype(jnp.int32)
    index = jnp.where(padding, -1, index)
    return live, index, hot


def _split_reorder_kernel(index_ref, mask_ref, out_ref, remote_ref, local_ref):
    # index_ref: i32[k] (row r), mask_ref: i8[N] (request r // H_kv), out_ref: i32[k] (row r),
    # remote_ref / local_ref: i32[R] (whole arrays; this program writes element r).
    row = pl.program_id(0)
    k = index_ref.shape[0]
    num_chunks = pl.cdiv(k, CHUNK)

    def count(c, acc):
        return acc + jnp.sum(_bucket_of(index_ref, mask_ref, c)[2], axis=0)

    counts = lax.fori_loop(0, num_chunks, count, jnp.zeros((_BUCKETS,), jnp.int32))
    bucket_start = jnp.cumsum(counts) - counts  # remote first: mask value descending

    def place(c, bucket_next):
        live, index, hot = _bucket_of(index_ref, mask_ref, c)
        rank_in_chunk = jnp.cumsum(hot, axis=0) - hot  # stable within the bucket
        slot = jnp.sum(hot * (rank_in_chunk + bucket_next[None, :]), axis=1)
        plgpu.store(out_ref.at[masked_scatter_index(slot, live, k)], index, mask=live)
        return bucket_next + jnp.sum(hot, axis=0)

    lax.fori_loop(0, num_chunks, place, bucket_start)
    is_bucket = jnp.arange(_BUCKETS)
    remote_ref[row] = jnp.sum(jnp.where(is_bucket == 0, counts, 0))
    local_ref[row] = jnp.sum(jnp.where(is_bucket == 1, counts, 0))


def split_reorder_pallas(
    kv_index: jax.Array,  # i32[R, k]
    kv_mask: jax.Array,  # i8[B, N]
    heads_per_batch: int,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # i32[R, k], i32[R], i32[R]
    """Pallas split + reorder (see module docstring). Use `dispatch.split_reorder` unless testing."""
    rows, k = kv_index.shape
    _, n = kv_mask.shape
    count_shape = jax.ShapeDtypeStruct((rows,), jnp.int32)
    return pl.pallas_call(
        _split_reorder_kernel,
        grid=(rows,),
        in_specs=[
            pl.BlockSpec((None, k), lambda r: (r, 0)),
            pl.BlockSpec((None, n), lambda r: (r // heads_per_batch, 0)),
        ],
        out_specs=[pl.BlockSpec((None, k), lambda r: (r, 0)), pl.no_block_spec, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, k), jnp.int32), count_shape, count_shape],
        compiler_params=compiler_params(num_warps=4),
        interpret=interpret,
        name="split_reorder",
    )(kv_index.astype(jnp.int32), kv_mask)


def split_reorder_reference(
    kv_index: jax.Array,  # i32[R, k]
    kv_mask: jax.Array,  # i8[B, N]
    heads_per_batch: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Algorithm 1 with a gather and a stable argsort, same contract as the kernel."""
    rows, _ = kv_index.shape
    _, n = kv_mask.shape
    batch = jnp.arange(rows) // heads_per_batch
    in_range = (kv_index >= 0) & (kv_index < n)
    mask_val = kv_mask[batch[:, None], jnp.where(in_range, kv_index, 0)].astype(jnp.int32)
    mask_val = jnp.where(in_range & ((mask_val == REMOTE) | (mask_val == LOCAL)), mask_val, PADDING)
    order = jnp.argsort(-mask_val, axis=1, stable=True)
    reordered = jnp.take_along_axis(jnp.where(mask_val == PADDING, -1, kv_index), order, axis=1)
    remote_count = jnp.sum(mask_val == REMOTE, axis=1).astype(jnp.int32)
    local_count = jnp.sum(mask_val == LOCAL, axis=1).astype(jnp.int32)
    return reordered.astype(jnp.int32), remote_count, local_count
