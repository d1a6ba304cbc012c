"""Selectors that need no offline fitting: Dense, Oracle, StreamingLLM, Sequential, Random.

Oracle is the exact top-k of q·Kᵀ (the "optimal" bound of SmartGen §5.4); StreamingLLM keeps
attention sinks plus a recent window (SmartGen §5.4, Fig. 15/17); Sequential (first tokens
in address order) and Random are the baselines of SmartGen §5.4 for proactive block choice.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jkv.selection.base import (Selector, SelectorConfig, all_tokens_index, check_group_score, fused_sum_applies,
                                group_queries, reduce_group, scores_to_index, sum_index, token_valid, write_token)


class _LengthOnly(Selector):
    """Selectors whose choice depends only on lengths: metadata is the pair (H_kv, N_cap)."""

    ships_metadata = False  # the decode side rebuilds the shape carrier from lengths

    def _prepare(self, state, K, lengths):
        batch, num_kv_heads, capacity, _ = K.shape
        return jnp.zeros((num_kv_heads, capacity), jnp.int8)  # shape carrier only

    def _append(self, state, metadata, k_new, positions):
        return metadata

    def kv_geometry(self, metadata):
        return metadata.shape

    def _positions(self, metadata, lengths):
        num_kv_heads, capacity = metadata.shape
        pos = jnp.arange(capacity, dtype=jnp.int32)
        return jnp.broadcast_to(pos, (lengths.shape[0], num_kv_heads, capacity))


class Dense(_LengthOnly):
    """Every token, every layer: the sparse path's dense reference."""

    name = "dense"

    def __init__(self, config: SelectorConfig | None = None):
        super().__init__(config or SelectorConfig(max_ratio=1.0))

    @property
    def is_dense(self) -> bool:
        return True

    def _select(self, state, q, metadata, lengths):
        num_kv_heads, capacity = metadata.shape
        return all_tokens_index(lengths, num_kv_heads, capacity)


@dataclasses.dataclass(frozen=True)
class StreamingConfig(SelectorConfig):
    sinks: int = 4  # StreamingLLM's attention-sink tokens

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.sinks, int) and self.sinks >= 0):
            raise ValueError(f"sinks={self.sinks!r} must be an int >= 0")


class StreamingLLM(_LengthOnly):
    """The first `sinks` tokens plus the most recent (budget - sinks) tokens."""

    name = "streamingllm"

    masks_dropped = True

    def _select(self, state, q, metadata, lengths, dropped=None):
        pos = self._positions(metadata, lengths)
        capacity = metadata.shape[1]
        # Sinks outrank everything, then recency: top-k takes sinks first, then the newest.
        scores = jnp.where(pos < self.config.sinks, 2.0 * capacity, pos).astype(jnp.float32)
        return scores_to_index(scores, lengths, self.config.max_ratio,
                               min_budget=self.config.min_budget, dropped=dropped)


class Sequential(_LengthOnly):
    """The first budget tokens in address order."""

    name = "sequential"

    masks_dropped = True

    def _select(self, state, q, metadata, lengths, dropped=None):
        pos = self._positions(metadata, lengths)
        return scores_to_index(-pos.astype(jnp.float32), lengths, self.config.max_ratio,
                               min_budget=self.config.min_budget, dropped=dropped)


@dataclasses.dataclass(frozen=True)
class RandomConfig(SelectorConfig):
    seed: int = 0


class Random(_LengthOnly):
    """A uniformly random subset of budget tokens per KV head, fixed by (seed, layer, N)."""

    name = "random"

    def layer_state(self, layer):
        return jax.random.fold_in(jax.random.key(self.config.seed), layer)

    masks_dropped = True

    def _select(self, state, q, metadata, lengths, dropped=None):
        num_kv_heads, capacity = metadata.shape
        keys = jax.vmap(lambda n: jax.random.fold_in(state, n))(lengths)
        scores = jax.vmap(lambda key: jax.random.uniform(key, (num_kv_heads, capacity)))(keys)
        return scores_to_index(scores, lengths, self.config.max_ratio,
                               min_budget=self.config.min_budget, dropped=dropped)


@dataclasses.dataclass(frozen=True)
class OracleConfig(SelectorConfig):
    group_score: str = "mass"  # softmax mass summed over the group: top-k maximises the mass kept

    def __post_init__(self):
        super().__post_init__()
        check_group_score(self.group_score)


class Oracle(Selector):
    """Exact attention: per KV head, the tokens with the largest softmax mass summed over the
    group's query heads (`group_score`). Metadata is the full key cache K: [B, H_kv, N_cap, D].
    With group_score "sum" and no kept tokens, a kernel backend scores and selects in one
    dispatched op (`topk_select_fused`, base.sum_index); "xla" keeps the jnp scores + top-k."""

    name = "oracle"

    def __init__(self, config: SelectorConfig | None = None):
        config = config or OracleConfig()
        if not isinstance(config, OracleConfig):  # a plain SelectorConfig: Oracle's defaults for the rest
            config = OracleConfig(**dataclasses.asdict(config))
        super().__init__(config)

    def _prepare(self, state, K, lengths):
        return K

    def _append(self, state, metadata, k_new, positions):
        return write_token(metadata, k_new, positions)

    def kv_geometry(self, metadata):
        return metadata.shape[1], metadata.shape[2]

    def _logits(self, state, q, metadata, lengths):
        """Exact attention logits per query head: f32[B, H_kv, G, N_cap], -inf on padding."""
        del state
        K = metadata
        grouped = group_queries(q, K.shape[1])  # [B, H_kv, G, D]
        logits = jnp.einsum("bhgd,bhnd->bhgn", grouped.astype(jnp.float32), K.astype(jnp.float32))
        logits = logits / math.sqrt(K.shape[-1])
        valid = token_valid(lengths, K.shape[2])[:, None, None, :]
        return jnp.where(valid, logits, -jnp.inf)

    masks_dropped = True

    def _select(self, state, q, metadata, lengths, dropped=None):
        c = self.config
        if fused_sum_applies(c.group_score, c.keep_sinks, c.keep_recent, dropped):  # the fused top-k kernel
            return sum_index(group_queries(q, metadata.shape[1]), metadata, lengths, c.max_ratio, c.min_budget)
        scores = reduce_group(self._logits(state, q, metadata, lengths), self.config.group_score)
        return scores_to_index(scores, lengths, self.config.max_ratio, sinks=self.config.keep_sinks,
                               recent=self.config.keep_recent, min_budget=self.config.min_budget, dropped=dropped)
