"""Sampling parameters and the batched, jitted token sampler (greedy, temperature, top-k, top-p)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options (vLLM/OpenAI semantics).

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters. `seed` makes a
    sampled request reproducible regardless of what it is batched with. Generation stops at an
    EOS token (unless ignore_eos), at any of `stop` (the stop string is not returned) or after
    max_tokens.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 or -1 disables it)")
        if self.seed is not None and not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@functools.partial(jax.jit, static_argnames=())
def sample_tokens(logits, temperature, top_k, top_p, seeds, steps):
    """logits: f32[B, V]; temperature, top_p: f32[B]; top_k, steps: i32[B]; seeds: u32[B] -> i32[B].

    Each row draws from its own stream `fold_in(PRNGKey(seed), step)`, so results do not depend
    on batch composition. Rows with temperature 0 take the argmax.
    """
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    sorted_desc = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_desc, -jnp.inf)
    cum = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
    # The smallest prefix whose mass reaches top_p (always at least one token).
    cutoff = jnp.argmax(cum >= top_p[:, None] - 1e-7, axis=-1)
    p_thresh = jnp.take_along_axis(sorted_desc, cutoff[:, None], axis=-1)
    masked = jnp.where((scaled >= kth) & (scaled >= p_thresh), scaled, -jnp.inf)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return jax.random.categorical(key, row)

    sampled = jax.vmap(draw)(seeds, steps, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample_or_argmax(logits, temperature, top_k, top_p, seeds, steps) -> np.ndarray:
    """`sample_tokens` (same arguments) -> i32[B] on the host; a batch where every row is greedy
    takes the argmax without the sampler's sort."""
    if not (np.asarray(temperature) > 0).any():
        return np.asarray(jnp.argmax(logits, -1), np.int32)
    return np.asarray(sample_tokens(logits, temperature, top_k, top_p, seeds, steps))
