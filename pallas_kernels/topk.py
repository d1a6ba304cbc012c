"""Per-row top-k selection of approximate attention scores (SmartGen §4.2, the KV selection step).

    topk_select(scores: f32|bf16[R, N], valid_len: i32[R], k) -> kv_index: i32[R, k]

R = B*H_kv rows. Row r keeps the k largest scores among positions < valid_len[r], sorted by score
descending, ties broken by lower position first; slots past min(k, valid_len[r]) hold -1. Scores
compare as floats with -0.0 == +0.0; a NaN inside the valid range ranks below -inf.

The Triton lowering has no sort/top_k/gather, so the kernel is a radix *threshold* select:

1. `_select_kernel` (one program per row, chunk loops so rows of 128K tokens work): map each score
   to an order-preserving int32 key, find the k-th largest key T digit by digit (4 bits per pass,
   counting `key >= candidate` for the 16 candidates of a digit at once), then compact the selected
   positions (key > T, plus the lowest-index ties key == T) in position order with a forward cumsum
   and an indexed store.
2. `_sort_pass_kernel` (launched once per 4-bit digit): a stable counting sort of the k selected
   entries by key descending (LSD radix); stability keeps ties in position order. Each pass is its
   own launch because a program must never read back what its own threads scattered.

bf16 scores have 16 significant key bits, so they need half the passes of f32.

`topk_scores_kernel` computes InfiniGen-style scores (sum over the G query heads of q_p · K_p^T)
for `topk_select_fused`; its output feeds the select. It is a separate launch because the select
reads each row 6-10 times: recomputing q·K_p in every pass would re-read d_p times more bytes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    INT32_MIN,
    clamp_len,
    compiler_params,
    masked_scatter_index,
    next_pow2,
    plgpu,
)

RADIX_BITS = 4
NUM_BUCKETS = 1 << RADIX_BITS
ROW_CHUNK = 1024  # positions of a score row per loop step
SEL_CHUNK = 512  # selected entries per loop step in the sort passes
SCORE_CHUNK = 256  # positions per program of the fused score kernel


def _low_bits(dtype) -> int:
    """Key bits that are always zero for this score dtype (bf16 -> f32 keeps 16 mantissa zeros)."""
    return 16 if jnp.dtype(dtype) == jnp.bfloat16 else 0


def orderable_key(scores: jax.Array, valid: jax.Array, low_bits: int) -> jax.Array:
    """i32 keys with key(a) > key(b) iff a > b; invalid -> INT32_MIN, NaN -> just above it.

    scores: f32[...] (bf16 upcast), valid: bool[...]. Used inside the kernels (Triton-safe ops).
    """
    scores = jnp.where(scores == 0.0, 0.0, scores)  # -0.0 and +0.0 tie
    bits = lax.bitcast_convert_type(scores, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    key = jnp.where(scores != scores, jnp.int32(INT32_MIN + (1 << low_bits)), key)
    return jnp.where(valid, key, jnp.int32(INT32_MIN))


def _select_kernel(valid_ref, scores_ref, idx_out_ref, key_out_ref, *, k: int, low_bits: int):
    # valid_ref: i32[R] (whole array), scores_ref: [N] (row r), idx_out_ref / key_out_ref: i32[k].
    row = pl.program_id(0)
    n = scores_ref.shape[0]
    valid_len = jnp.clip(valid_ref[row], 0, n)
    take = jnp.minimum(valid_len, k)  # entries this row outputs
    lanes = jnp.arange(ROW_CHUNK, dtype=jnp.int32)
    num_chunks = pl.cdiv(valid_len, ROW_CHUNK)

    def load_keys(c):
        pos = c * ROW_CHUNK + lanes
        in_row = pos < valid_len
        x = plgpu.load(scores_ref.at[pl.ds(c * ROW_CHUNK, ROW_CHUNK)], mask=in_row, other=0.0)
        return pos, in_row, orderable_key(x.astype(jnp.float32), in_row, low_bits)

    # Radix threshold search: largest T with count(key >= T) >= take, one 4-bit digit per pass.
    # Candidates are built in the unsigned order of (key ^ INT32_MIN); int32 adds wrap, so
    # `prefix + (j << shift)` walks that order for prefix = INT32_MIN (unsigned 0).
    digits = jnp.arange(NUM_BUCKETS, dtype=jnp.int32)
    num_passes = (32 - low_bits) // RADIX_BITS

    def digit_pass(p, prefix):
        shift = 32 - RADIX_BITS * (p + 1)
        candidates = prefix + (digits << shift)

        def count(c, acc):
            _, _, key = load_keys(c)
            ge = key[:, None] >= candidates[None, :]
            return acc + jnp.sum(ge.astype(jnp.int32), axis=0)

        counts = lax.fori_loop(0, num_chunks, count, jnp.zeros((NUM_BUCKETS,), jnp.int32))
        best = jnp.sum((counts >= take).astype(jnp.int32)) - 1  # counts[0] >= take always
        return prefix + (best << shift)

    threshold = lax.fori_loop(0, num_passes, digit_pass, jnp.int32(INT32_MIN))

    def count_above(c, acc):
        _, _, key = load_keys(c)
        return acc + jnp.sum((key > threshold).astype(jnp.int32))

    num_above = lax.fori_loop(0, num_chunks, count_above, jnp.int32(0))
    ties_needed = take - num_above

    # Compaction in position order: slot = number of selected entries before this one.
    def compact(c, carry):
        written, ties_seen = carry
        pos, _, key = load_keys(c)
        tie = key == threshold
        tie_rank = ties_seen + jnp.cumsum(tie.astype(jnp.int32)) - tie.astype(jnp.int32)
        selected = (key > threshold) | (tie & (tie_rank < ties_needed))
        sel_i32 = selected.astype(jnp.int32)
        slot = masked_scatter_index(written + jnp.cumsum(sel_i32) - sel_i32, selected, k)
        plgpu.store(idx_out_ref.at[slot], pos, mask=selected)
        plgpu.store(key_out_ref.at[slot], key, mask=selected)
        return written + jnp.sum(sel_i32), ties_seen + jnp.sum(tie.astype(jnp.int32))

    lax.fori_loop(0, num_chunks, compact, (jnp.int32(0), jnp.int32(0)))

    # Slots past `take` get the sentinel; a disjoint set of slots from the scatter above.
    sel_lanes = jnp.arange(SEL_CHUNK, dtype=jnp.int32)

    def fill(c, _):
        slot = c * SEL_CHUNK + sel_lanes
        pad = (slot >= take) & (slot < k)
        block = pl.ds(c * SEL_CHUNK, SEL_CHUNK)
        plgpu.store(idx_out_ref.at[block], jnp.full_like(slot, -1), mask=pad)
        plgpu.store(key_out_ref.at[block], jnp.full_like(slot, INT32_MIN), mask=pad)
        return _

    lax.fori_loop(take // SEL_CHUNK, pl.cdiv(k, SEL_CHUNK), fill, 0)


def _sort_pass_kernel(shift_ref, idx_ref, key_ref, idx_out_ref, key_out_ref):
    # shift_ref: i32[1] (the digit's bit offset), idx_ref / key_ref / outs: i32[k] (row r).
    # Stable counting sort by one digit of the key, descending: digit of ~key in unsigned order.
    k = idx_ref.shape[0]
    shift = shift_ref[0]
    lanes = jnp.arange(SEL_CHUNK, dtype=jnp.int32)
    digits = jnp.arange(NUM_BUCKETS, dtype=jnp.int32)
    num_chunks = pl.cdiv(k, SEL_CHUNK)

    def one_hot(c):
        slot = c * SEL_CHUNK + lanes
        live = slot < k
        block = pl.ds(c * SEL_CHUNK, SEL_CHUNK)
        key = plgpu.load(key_ref.at[block], mask=live, other=INT32_MIN)
        idx = plgpu.load(idx_ref.at[block], mask=live, other=-1)
        digit = (((~key) ^ jnp.int32(INT32_MIN)) >> shift) & (NUM_BUCKETS - 1)
        hot = ((digit[:, None] == digits[None, :]) & live[:, None]).astype(jnp.int32)
        return live, key, idx, hot

    def histogram(c, acc):
        return acc + jnp.sum(one_hot(c)[3], axis=0)

    counts = lax.fori_loop(0, num_chunks, histogram, jnp.zeros((NUM_BUCKETS,), jnp.int32))
    bucket_start = jnp.cumsum(counts) - counts

    def scatter(c, bucket_next):
        live, key, idx, hot = one_hot(c)
        rank_in_chunk = jnp.cumsum(hot, axis=0) - hot
        slot = jnp.sum(hot * (rank_in_chunk + bucket_next[None, :]), axis=1)
        slot = masked_scatter_index(slot, live, k)
        plgpu.store(idx_out_ref.at[slot], idx, mask=live)
        plgpu.store(key_out_ref.at[slot], key, mask=live)
        return bucket_next + jnp.sum(hot, axis=0)

    lax.fori_loop(0, num_chunks, scatter, bucket_start)


def topk_select_pallas(
    scores: jax.Array,  # f32|bf16[R, N]
    valid_len: jax.Array,  # i32[R]
    k: int,
    *,
    interpret: bool = False,
) -> jax.Array:  # i32[R, k]
    """Pallas top-k (see module docstring). Use `dispatch.topk_select` unless testing."""
    rows, n = scores.shape
    low_bits = _low_bits(scores.dtype)
    if scores.dtype != jnp.bfloat16:
        scores = scores.astype(jnp.float32)
    valid_len = valid_len.astype(jnp.int32)
    row_spec = pl.BlockSpec((None, k), lambda r: (r, 0))
    sel_shape = jax.ShapeDtypeStruct((rows, k), jnp.int32)
    idx, key = pl.pallas_call(
        functools.partial(_select_kernel, k=k, low_bits=low_bits),
        grid=(rows,),
        in_specs=[pl.no_block_spec, pl.BlockSpec((None, n), lambda r: (r, 0))],
        out_specs=[row_spec, row_spec],
        out_shape=[sel_shape, sel_shape],
        compiler_params=compiler_params(num_warps=8),  # [ROW_CHUNK, 16] compare tiles
        interpret=interpret,
        name="topk_select",
    )(valid_len, scores)
    sort_pass = pl.pallas_call(
        _sort_pass_kernel,
        grid=(rows,),
        in_specs=[pl.no_block_spec, row_spec, row_spec],
        out_specs=[row_spec, row_spec],
        out_shape=[sel_shape, sel_shape],
        compiler_params=compiler_params(num_warps=4),
        interpret=interpret,
        name="topk_sort_pass",
    )
    shifts = range(low_bits, 32, RADIX_BITS)
    if interpret:  # one traced pass in a loop: interpret-mode compile time grows per launch
        def body(p, carry):
            shift = jnp.full((1,), low_bits + RADIX_BITS * p, jnp.int32)
            return tuple(sort_pass(shift, *carry))

        idx, key = lax.fori_loop(0, len(shifts), body, (idx, key))
    else:  # unrolled launches: a device while loop would sync with the host every pass
        for shift in shifts:
            idx, key = sort_pass(jnp.full((1,), shift, jnp.int32), idx, key)
    return idx


def topk_scores_kernel(q_ref, k_ref, out_ref, *, head_dim: int):
    # q_ref: f32[d_pp] (row r, summed over the G query heads), k_ref: [N, d_p] (row r),
    # out_ref: f32[N] (row r). Program (r, c) scores positions [c*SCORE_CHUNK, +SCORE_CHUNK).
    chunk = pl.program_id(1)
    n = k_ref.shape[0]
    d_pp = q_ref.shape[0]
    pos = chunk * SCORE_CHUNK + jnp.arange(SCORE_CHUNK, dtype=jnp.int32)
    cols = jnp.arange(d_pp, dtype=jnp.int32)
    live = (pos < n)[:, None] & (cols < head_dim)[None, :]
    # Indexed (pointer) load, not a static `pl.ds(0, d_pp)`: d_pp (a power of two for Triton) may
    # exceed the ref's d_p columns, and JAX 0.12 rejects a static slice past a ref's end even
    # when the lanes beyond it are masked. The Triton code is the same masked pointer load.
    keys = plgpu.load(k_ref.at[pos[:, None], cols[None, :]], mask=live, other=0.0)
    q = q_ref[...]
    scores = jnp.sum(keys.astype(jnp.float32) * q[None, :], axis=1)
    plgpu.store(out_ref.at[pl.ds(chunk * SCORE_CHUNK, SCORE_CHUNK)], scores, mask=pos < n)


def partial_scores_pallas(
    q_partial: jax.Array,  # [R, G, d_p]
    k_partial: jax.Array,  # [R, N, d_p]
    *,
    interpret: bool = False,
) -> jax.Array:  # f32[R, N]
    """InfiniGen approximate scores, GQA group aggregated: sum_g q_p[r, g] · k_p[r, n]."""
    rows, n, d_p = k_partial.shape
    d_pp = max(16, next_pow2(d_p))
    # Sum over the group first: sum_g (q_g · k) == (sum_g q_g) · k, one dot per position.
    q_sum = jnp.sum(q_partial.astype(jnp.float32), axis=1)
    q_sum = jnp.pad(q_sum, ((0, 0), (0, d_pp - d_p)))  # [R, d_pp]
    return pl.pallas_call(
        functools.partial(topk_scores_kernel, head_dim=d_p),
        grid=(rows, pl.cdiv(n, SCORE_CHUNK)),
        in_specs=[
            pl.BlockSpec((None, d_pp), lambda r, c: (r, 0)),
            pl.BlockSpec((None, n, d_p), lambda r, c: (r, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, n), lambda r, c: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        compiler_params=compiler_params(num_warps=4),
        interpret=interpret,
        name="topk_partial_scores",
    )(q_sum, k_partial)


def topk_select_fused_pallas(
    q_partial: jax.Array,  # [R, G, d_p]
    k_partial: jax.Array,  # [R, N, d_p]
    valid_len: jax.Array,  # i32[R]
    k: int,
    *,
    interpret: bool = False,
) -> jax.Array:  # i32[R, k]
    scores = partial_scores_pallas(q_partial, k_partial, interpret=interpret)
    return topk_select_pallas(scores, valid_len, k, interpret=interpret)


def topk_select_reference(
    scores: jax.Array,  # f32|bf16[R, N]
    valid_len: jax.Array,  # i32[R]
    k: int,
) -> jax.Array:  # i32[R, k]
    """Pure-jnp top-k with the same contract: a stable lexicographic sort, no bit tricks."""
    rows, n = scores.shape
    x = scores.astype(jnp.float32)
    x = jnp.where(x == 0.0, 0.0, x)
    valid_len = clamp_len(valid_len, n)
    pos = jnp.arange(n, dtype=jnp.int32)[None, :]
    valid = pos < valid_len[:, None]
    # Primary: valid numbers, then valid NaN, then invalid; secondary: score descending.
    rank_class = jnp.where(valid, jnp.where(jnp.isnan(x), 1, 0), 2)
    neg = jnp.where(jnp.isnan(x), 0.0, -x)
    order = jnp.lexsort((neg, rank_class), axis=-1).astype(jnp.int32)  # stable: ties by position
    if k > n:
        order = jnp.pad(order, ((0, 0), (0, k - n)))
    order = order[:, :k]
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    return jnp.where(slot < jnp.minimum(valid_len, k)[:, None], order, -1)


def topk_select_xla(
    scores: jax.Array,  # f32|bf16[R, N]
    valid_len: jax.Array,  # i32[R]
    k: int,
) -> jax.Array:  # i32[R, k]
    """`topk_select_reference`'s contract on XLA's own partial selection (`lax.top_k`), what the
    "xla" backend runs: a full sort of every row costs ~7x more on XLA:CPU (12 rows of 2,112
    scores, k = 423: 10.4 ms vs 1.5 ms; f32 `top_k` is a native partial sort there, an i32 one a
    full sort). `lax.top_k` keeps ties in position order, so every slot below -inf's class keeps
    the reference's order: valid numbers score themselves, invalid positions -inf (they sit past
    every valid one, so a tie puts them after a valid -inf, and the -1 tail hides them). Only a
    NaN inside the valid range has no f32 key between -inf and the invalid class: a batch with one
    takes the reference (`lax.cond`, a branch XLA runs only when taken)."""
    rows, n = scores.shape
    x = scores.astype(jnp.float32)
    valid_len = clamp_len(valid_len, n)
    valid = jnp.arange(n, dtype=jnp.int32)[None, :] < valid_len[:, None]
    nan = jnp.isnan(x)

    def selected(x, valid_len):
        key = jnp.where(valid & ~nan, jnp.where(x == 0.0, 0.0, x), -jnp.inf)  # -0.0 ties +0.0
        _, order = lax.top_k(key, min(k, n))
        if k > n:
            order = jnp.pad(order, ((0, 0), (0, k - n)))
        slot = jnp.arange(k, dtype=jnp.int32)[None, :]
        return jnp.where(slot < jnp.minimum(valid_len, k)[:, None], order.astype(jnp.int32), -1)

    return lax.cond(jnp.any(valid & nan), functools.partial(topk_select_reference, k=k), selected, x, valid_len)


def topk_select_fused_xla(q_partial, k_partial, valid_len, k: int) -> jax.Array:
    return topk_select_xla(partial_scores_reference(q_partial, k_partial), valid_len, k)


def partial_scores_reference(q_partial: jax.Array, k_partial: jax.Array) -> jax.Array:
    """f32[R, N] = sum over the G query heads of q_partial[r, g] · k_partial[r, n]."""
    return jnp.einsum(
        "rgd,rnd->rn",
        q_partial.astype(jnp.float32),
        k_partial.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )


def topk_select_fused_reference(q_partial, k_partial, valid_len, k: int) -> jax.Array:
    return topk_select_reference(partial_scores_reference(q_partial, k_partial), valid_len, k)
