"""InfiniGen: speculative selection with skewed partial keys (Lee et al., OSDI 2024).

Offline, per layer and KV head, an orthogonal skew A (right singular vectors of the
calibration queries of the head's GQA group) concentrates the q·k product in a few channels;
the `partial_ratio` (0.3) channels with the largest mean |q̃|·|k̃| are kept: A_p = A[:, idx].
Because A is orthogonal, q̃·k̃ = q·k, and the partial product approximates it.

We skew *after* RoPE (SmartGen uses RoPE models; InfiniGen's OPT has none): RoPE rotates
channel pairs by position, so a skew folded into W_q/W_k would not commute with it, while a
rotation applied to the rotated q and k preserves every dot product exactly.

Online: metadata is the partial key cache K A_p: [B, H_kv, N_cap, d_p], stored as
`metadata_dtype` (float16 by default; scores are computed in float32 after the upcast). This is
the metadata the prefill side ships (SmartGen §4.4: partial ratio 0.3 adds ~15% to the KV
transfer, with metadata and KV at the model's 16-bit precision); float16 partial keys next to
our float32 KV are ~7% (0.3 · D of 2 · D channels at half the bytes, over the sparse layers).
The query is speculated from the previous layer's input (InfiniGen §4.3: layer l's query computed from
layer l-1's attention input). Each KV head counts the tokens whose partial score is within
`alpha` (10 here, 5 in InfiniGen: see InfiniGenConfig) of the maximum (for some query head
of its group); the request's fetch count is that count averaged over its KV heads (as
InfiniGen's implementation does), capped at the max_ratio budget, and every head takes its
top tokens up to it — ranked by `group_score` (default: the group's summed softmax of the
partial scores), with `keep_sinks` / `keep_recent` tokens always first.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jkv.selection.base import (Selector, SelectorConfig, check_group_score, check_metadata_dtype, group_queries,
                                reduce_group, scores_to_index, to_metadata_dtype, token_valid, write_token)


@dataclasses.dataclass(frozen=True)
class InfiniGenConfig(SelectorConfig):
    partial_ratio: float = 0.3  # InfiniGen's partial channel ratio
    # Keep tokens with score > max - alpha (InfiniGen §4.3); the max_ratio cap still bounds it.
    # InfiniGen/SmartGen use 5 on 7B-14B models. On SmolLM2-135M, with its flatter attention,
    # 5 keeps only ~6% of the tokens at 1K (the softmax tail outside it holds ~10% of the mass)
    # and loses passkey_multi / code accuracy; 10 (weights >= e^-10 of the max) reaches the cap.
    alpha: float = 10.0
    speculate: bool = True  # query from the previous layer's input; False uses the true query
    # Storage of the partial keys. SmartGen §4.4 ships them next to the KV at the model's 16-bit
    # precision (~15% of the KV at partial ratio 0.3); float16 halves what float32 would ship.
    metadata_dtype: str = "float16"
    # Ranking of the tokens (base.reduce_group over the partial-score logits) and always-kept
    # tokens (inside the budget). Measured on SmolLM2-135M, fidelity @1K, ratio 0.2, samples 0-7
    # (248 decoded tokens; Oracle: top-1 0.956, attention mass kept 0.966): the paper's rule
    # (each token's best head, "max", no kept tokens) top-1 0.935, KL 0.0219, mass 0.9455;
    # "mass" + 4 sinks + 16 recent top-1 0.952, KL 0.0073, mass 0.9506 (32 recent: the same).
    group_score: str = "mass"
    keep_sinks: int = 4
    keep_recent: int = 16

    def __post_init__(self):
        super().__post_init__()
        check_metadata_dtype(self.metadata_dtype)
        check_group_score(self.group_score)
        if not (0.0 < self.partial_ratio <= 1.0):
            raise ValueError(f"partial_ratio={self.partial_ratio!r} must be in (0, 1]")
        if not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha!r} must be > 0 (math.inf disables the threshold)")


def fit_skew(queries: np.ndarray, keys: np.ndarray, partial_ratio: float) -> np.ndarray:
    """One layer's partial skew matrices.

    queries: f32[S, H, D] calibration queries; keys: f32[N, H_kv, D] calibration keys.
    Returns f32[H_kv, D, d_p] with d_p = ceil(partial_ratio * D): orthonormal columns.
    """
    num_samples, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    partial = max(1, math.ceil(partial_ratio * head_dim))
    skews = []
    for h in range(num_kv_heads):
        q = queries[:, h * group:(h + 1) * group].reshape(-1, head_dim).astype(np.float64)
        k = keys[:, h].astype(np.float64)
        # InfiniGen: skew by the SVD of Q. Only the right singular vectors are used: with at least
        # D rows the reduced SVD has all D of them (the full one also builds U: [S·G, S·G], minutes
        # for a pooled calibration mix of ~2400 rows per head); with fewer, the full SVD completes them.
        _, _, vt = np.linalg.svd(q, full_matrices=q.shape[0] < head_dim)
        rotation = vt.T  # [D, D], orthogonal
        importance = np.abs(q @ rotation).mean(0) * np.abs(k @ rotation).mean(0)
        channels = np.sort(np.argsort(-importance, kind="stable")[:partial])
        skews.append(rotation[:, channels])
    return np.stack(skews).astype(np.float32)


class InfiniGen(Selector):
    name = "infinigen"

    def __init__(self, config: InfiniGenConfig, skew: list[np.ndarray] | np.ndarray | None = None):
        if skew is None:
            raise ValueError(
                "InfiniGen needs per-layer skew matrices fitted on calibration data: use "
                "InfiniGen.from_calibration(config, calibration) or get_selector('infinigen', model=...)")
        self.skew = [jnp.asarray(s, jnp.float32) for s in skew]  # per layer [H_kv, D, d_p]
        super().__init__(config)

    @classmethod
    def from_calibration(cls, config: InfiniGenConfig, calibration) -> "InfiniGen":
        """calibration: a jkv.selection.calibration.Calibration (queries and keys per layer), or a
        list of them whose queries and keys are pooled per layer (a calibration mix)."""
        windows = list(calibration) if isinstance(calibration, (list, tuple)) else [calibration]
        if not windows:
            raise ValueError("calibration is an empty list: pass at least one Calibration window")
        num_layers = {len(w.queries) for w in windows}
        if len(num_layers) != 1:
            raise ValueError(f"calibration windows cover different layer counts {sorted(num_layers)}")
        skew = [fit_skew(np.concatenate([w.queries[layer] for w in windows]),
                         np.concatenate([w.keys[layer] for w in windows]), config.partial_ratio)
                for layer in range(num_layers.pop())]
        return cls(config, skew)

    def layer_state(self, layer):
        if not 0 <= layer < len(self.skew):
            raise ValueError(f"{layer=} out of range: the skew was fitted for {len(self.skew)} layers")
        return self.skew[layer]

    def decode_query(self, layer, q, speculate):
        if self.config.speculate and layer >= max(1, self.config.dense_layers):
            return speculate()
        return q

    def _prepare(self, skew, K, lengths):
        partial = jnp.einsum("bhnd,hdp->bhnp", K.astype(jnp.float32), skew)
        partial = jnp.where(token_valid(lengths, K.shape[2])[:, None, :, None], partial, 0.0)
        return to_metadata_dtype(partial, self.config.metadata_dtype)  # [B, H_kv, N_cap, d_p]

    def _append(self, skew, metadata, k_new, positions):
        partial = jnp.einsum("bhd,hdp->bhp", k_new.astype(jnp.float32), skew)
        return write_token(metadata, to_metadata_dtype(partial, self.config.metadata_dtype), positions)

    def kv_geometry(self, metadata):
        return metadata.shape[1], metadata.shape[2]

    masks_dropped = True

    def _select(self, skew, q, metadata, lengths, dropped=None):
        rank, count = infinigen_rank(self.config, skew, q, metadata, lengths)
        index = scores_to_index(rank, lengths, self.config.max_ratio, sinks=self.config.keep_sinks,
                                recent=self.config.keep_recent, min_budget=self.config.min_budget, dropped=dropped)
        slot = jnp.arange(index.shape[1], dtype=jnp.int32)[None, :]
        return jnp.where(slot < jnp.repeat(count, rank.shape[1])[:, None], index, -1)


def infinigen_rank(config: InfiniGenConfig, skew, q, metadata, lengths):
    """InfiniGen's token ranking before the top-k (traceable; also the lookahead hint's, hint.py).

    skew: f32[H_kv, D, d_p]; q: [B, H, D]; metadata: partial keys [B, H_kv, N_cap, d_p];
    lengths: i32[B]. Returns rank f32[B, H_kv, N_cap] (-inf on invalid slots for "max") and the
    fetch count i32[B] (tokens within alpha of the max, at least min(min_budget, N), before the
    budget cap).
    """
    partial_keys = metadata.astype(jnp.float32)  # [B, H_kv, N_cap, d_p], stored as metadata_dtype
    head_dim = skew.shape[1]
    partial_q = jnp.einsum("bhgd,hdp->bhgp", group_queries(q, partial_keys.shape[1]).astype(jnp.float32), skew)
    scores = jnp.einsum("bhgp,bhnp->bhgn", partial_q, partial_keys) / math.sqrt(head_dim)
    valid = token_valid(lengths, partial_keys.shape[2])[:, None, None, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    relative = (scores - scores.max(axis=-1, keepdims=True)).max(axis=2)  # [B, H_kv, N_cap], <= 0
    relative = jnp.where(valid[:, :, 0], relative, -jnp.inf)
    # InfiniGen's fetch count: tokens within alpha of the max, averaged over the request's
    # heads, so peaky heads borrow budget from flat ones; capped by the max_ratio budget.
    within = (relative > -config.alpha).sum(axis=2)  # [B, H_kv]
    count = jnp.ceil(within.mean(axis=1)).astype(jnp.int32)  # [B]
    # The budget floor holds for the fetch count too: at least min(min_budget, N) tokens per row.
    count = jnp.maximum(count, jnp.minimum(config.min_budget, lengths.astype(jnp.int32)))
    rank = relative if config.group_score == "max" else reduce_group(scores, config.group_score)
    return rank, count
