"""Cheap lookahead hints: the *set* of tokens a selector will pick, without its ordered top-k.

The layer lookahead (lookahead.py) needs, at the start of layer l, the rows layer l+1 will
select, so it can fetch the remote ones while layer l computes. Only the set matters (the
prefetch asks for each missing row once, in any order). `Selector.select` returns the
selection *ordered* (score descending, ties to the lower index: a stable lexicographic sort of
every row, `topk_select`), which on this CPU is ~95 % of its 5.6 ms per call at 4 x 2K tokens;
run once more per layer for the hint, it was the largest part of smartgen's extra CPU per step
(0.16 s at 4 x 2K, on the same 2 cores as decode and the prefill workers' replies).

`InfiniGenHint` computes InfiniGen's ranking exactly as the selector does (partial scores of
the speculative query against the partial keys, the within-alpha count, the group score, the
always-kept sink/recent tokens; InfiniGen §4.3, jkv/selection/infinigen.py) in one jit, and
takes each row's top `min(count, budget)` with `np.argpartition` (linear time, unordered; ties
at the boundary to the lower index, as `topk_select`). For the same inputs it returns exactly
the selector's set, tested against `select`; the order is not the selector's.

Why the hint cannot simply *be* the real selection (and the real `select` is still called at
layer l+1): the hint runs before layer l+1's input exists, so the current token's key at l+1
is missing from the metadata (its slot scores 0 instead of its partial score s_cur). The token
itself is always kept (recent) and local, but its score enters every other token's rank: the
group score "mass" divides each query head's weights by that head's softmax normaliser, which
includes exp(s_cur); a different normaliser per query head re-weights the G heads of a group
differently and can reorder tokens anywhere in the row, and a new maximum moves the
within-alpha count. So equality with the real selection (which attention needs bit for bit, in
its order) is not provable from the hint; only the real `select` gives it.

Selectors without a hint here (Oracle, Quest, HATA, ...) use their `select`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv.selection.base import protected_tokens, token_valid
from jkv.selection.infinigen import InfiniGen, infinigen_rank


class InfiniGenHint:
    """hint(layer, q, metadata, lengths) -> i32[B*H_kv, k_max + margin]: InfiniGen's selected set per
    row plus the next `margin` rows of its ranking (unordered, -1 after them). q: [B, H, D] (the
    speculative query), metadata: the partial keys [B, H_kv, N_cap, d_p], lengths: i32[B]."""

    # Extra rows per row beyond the selected set: the real selection differs from the hint only
    # where the current token's score re-weights the ranking, i.e. around the cut; most of these
    # rows are local already, so the margin costs few link bytes and saves synchronous fetches.
    DEFAULT_MARGIN = 8

    def __init__(self, selector, margin: int = DEFAULT_MARGIN):
        if not (isinstance(margin, int) and margin >= 0):
            raise ValueError(f"margin={margin!r} must be an int >= 0 (extra rows per hinted row)")
        self.selector, self.margin = selector, margin
        self._rank = _rank_jit(selector.config)

    def __call__(self, layer: int, q, metadata, lengths) -> np.ndarray:
        rank, keep = self._rank(self.selector.layer_state(layer), jnp.asarray(q), metadata,
                                jnp.asarray(lengths, jnp.int32))
        rank, keep = np.asarray(rank), np.asarray(keep)
        rows, capacity = rank.shape
        width = self.selector.config.budget(capacity) + self.margin
        out = np.full((rows, min(width, capacity)), -1, np.int32)
        valid = rank > -np.inf  # -inf: invalid slots
        for r in range(rows):
            c = min(int(keep[r]) + self.margin, int(valid[r].sum())) if keep[r] > 0 else 0
            if c <= 0:
                continue
            row = rank[r]
            thr = row[np.argpartition(row, capacity - c)[capacity - c]] if c < capacity else row.min()
            above = np.flatnonzero(row > thr)  # ties at the boundary go to the lower index, as in topk_select
            out[r, :c] = np.concatenate([above, np.flatnonzero(row == thr)[:c - above.size]])
        return out


@functools.lru_cache(maxsize=16)
def _rank_jit(config):
    """One jit per selector config (frozen, hashable), shared by every DecodeWorker (a benchmark
    makes one per run)."""
    return jax.jit(functools.partial(_hint_rank, config))


def _hint_rank(config, skew, q, metadata, lengths):
    """InfiniGen's ranking (`infinigen_rank`, the selector's own) without the ordered top-k:
    rank f32[B*H_kv, N_cap] (+inf kept tokens, -inf invalid) and keep i32[B*H_kv] =
    min(within-alpha count, budget)."""
    rank, count = infinigen_rank(config, skew, q, metadata, lengths)
    batch, num_kv_heads, capacity = rank.shape
    if config.keep_sinks or config.keep_recent:
        protect = protected_tokens(lengths, capacity, config.keep_sinks, config.keep_recent)
        rank = jnp.where(protect[:, None, :], jnp.inf, rank)
    rank = jnp.where(token_valid(lengths, capacity)[:, None, :], rank, -jnp.inf)
    keep = jnp.minimum(count, config.budget(lengths.astype(jnp.int32)))
    return rank.reshape(batch * num_kv_heads, capacity), jnp.repeat(keep, num_kv_heads)


def make_hint(selector, margin: int = InfiniGenHint.DEFAULT_MARGIN):
    """A cheap set-only hint for `selector`, or None (then the lookahead calls `select`)."""
    if isinstance(selector, InfiniGen):
        return InfiniGenHint(selector, margin)
    return None
