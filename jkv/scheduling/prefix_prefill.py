"""CALVO's compute stage on a real model: prefill the uncached suffix of a prompt on top of the
KV of its cached prefix (loaded from the pool), and the three stage functions that run a
`models.Model` inside the `LoadingPipeline` (§3.1: L3 -> L2 -> L1 -> compute).

Chunk layout (one pool entry, one L2 row, one L1 slot): `[L, 2, H_kv, C, D]` in the model's
dtype (K at [:, 0], V at [:, 1]) for C = chunk_tokens consecutive prompt tokens.

Shapes are bucketed so a handful of programs serve every request: the prefix is padded to a
multiple of `prefix_bucket` tokens (masked), the suffix to the next bucket in `suffix_buckets`
(padding rows are computed and dropped). One jitted layer program per (prefix, suffix) bucket
pair serves all L layers (their parameters have the same shapes).

Concurrency: `PrefixPrefill` is stateless after construction (jitted functions, read-only
params); `ModelStages` is called by the pipeline's three executor threads, each touching only
the L2 rows / L1 slots the pipeline reserved for its task, so no locking is needed.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv.scheduling.core import PipelineRequest

DEFAULT_SUFFIX_BUCKETS = (32, 64, 128, 256, 512, 1024, 1536, 2048)


def _layer(cfg, layer_params, x, positions, prefix_k, prefix_v, prefix_len, n_valid):
    """One decoder layer over the suffix. x: [1, S, hidden]; positions: i32[1, S];
    prefix_k/v: [1, H_kv, P, D] (first prefix_len valid). Returns x and the suffix's k, v
    as [1, H_kv, S, D]."""
    from models.transformer import DecoderLayer, attention

    layer = DecoderLayer(cfg)
    q, k, v = layer.apply({"params": layer_params}, x, positions, method=DecoderLayer.qkv)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    P, S = prefix_k.shape[2], x.shape[1]
    t = jnp.arange(S)
    prefix_ok = jnp.broadcast_to(jnp.arange(P)[None, :] < prefix_len, (S, P))
    causal = (t[None, :] <= t[:, None]) & (t[None, :] < n_valid)        # [S (query), S (key)]
    mask = jnp.concatenate([prefix_ok, causal], axis=1)[None, None]     # [1, 1, S, P + S]
    attn = attention(q, jnp.concatenate([prefix_k, k], axis=2),
                     jnp.concatenate([prefix_v, v], axis=2), mask)
    x = layer.apply({"params": layer_params}, x, attn, method=DecoderLayer.attn_out_and_mlp)
    return x, k, v


class PrefixPrefill:
    """`__call__(prefix_kv, prefix_len, suffix_tokens)` -> (logits f32[V] at the last token,
    suffix KV [L, 2, H_kv, S, D]); equals a full prefill of prefix + suffix (tested)."""

    def __init__(self, model, prefix_bucket: int = 512,
                 suffix_buckets: Sequence[int] = DEFAULT_SUFFIX_BUCKETS):
        from models.transformer import embed, final_logits

        if prefix_bucket < 1 or not suffix_buckets or min(suffix_buckets) < 1:
            raise ValueError(f"{prefix_bucket=} and {suffix_buckets=} must be positive")
        self.model = model
        self.cfg = cfg = model.cfg
        self.prefix_bucket = prefix_bucket
        self.suffix_buckets = tuple(sorted(suffix_buckets))
        self._layer = jax.jit(functools.partial(_layer, cfg))
        self._embed = jax.jit(embed)
        self._logits = jax.jit(functools.partial(final_logits, cfg))
        self.dtype = np.dtype(cfg.dtype)

    def suffix_bucket(self, n: int) -> int:
        for b in self.suffix_buckets:
            if n <= b:
                return b
        raise ValueError(f"suffix of {n} tokens exceeds the largest bucket "
                         f"{self.suffix_buckets[-1]}; pass larger suffix_buckets")

    def prefix_padded(self, n: int) -> int:
        return -(-n // self.prefix_bucket) * self.prefix_bucket

    def __call__(self, prefix_kv: np.ndarray | None, prefix_len: int, suffix_tokens: np.ndarray):
        """prefix_kv: [L, 2, H_kv, P, D] with P >= prefix_len (None when prefix_len == 0);
        suffix_tokens: i32[S], S >= 1."""
        c = self.cfg
        suffix = np.asarray(suffix_tokens, np.int32).reshape(-1)
        n = suffix.size
        if n < 1:
            raise ValueError("the suffix must hold at least one token (the last prompt token is "
                             "always recomputed to produce the first output token's logits)")
        S = self.suffix_bucket(n)
        P = self.prefix_padded(prefix_len)
        if prefix_len and (prefix_kv is None or prefix_kv.shape[3] < prefix_len):
            raise ValueError(f"prefix_kv {None if prefix_kv is None else prefix_kv.shape} holds "
                             f"fewer than {prefix_len=} tokens")
        tokens = np.zeros((1, S), np.int32)
        tokens[0, :n] = suffix
        positions = jnp.asarray(prefix_len + np.arange(S, dtype=np.int32)[None])
        x = self._embed(self.model.params, jnp.asarray(tokens))
        if P and prefix_kv.shape[3] != P:
            padded = np.zeros(prefix_kv.shape[:3] + (P, c.head_dim), self.dtype)
            padded[:, :, :, :prefix_len] = prefix_kv[:, :, :, :prefix_len]
            prefix_kv = padded
        empty = np.zeros((1, c.num_kv_heads, 0, c.head_dim), self.dtype)
        out_kv = []
        for layer, lp in enumerate(self.model.params["layers"]):
            pk = prefix_kv[layer, 0][None] if P else empty
            pv = prefix_kv[layer, 1][None] if P else empty
            x, k, v = self._layer(lp, x, positions, pk, pv, np.int32(prefix_len), np.int32(n))
            out_kv.append((k, v))
        logits = self._logits(self.model.params, x[0, n - 1])
        kv = np.stack([np.stack([np.asarray(k)[0, :, :n], np.asarray(v)[0, :, :n]])
                       for k, v in out_kv])
        return np.asarray(logits), kv


def chunk_shape(cfg, chunk_tokens: int) -> tuple[int, ...]:
    """Shape of one KV chunk: [L, 2, H_kv, C, D]."""
    return (cfg.num_layers, 2, cfg.num_kv_heads, chunk_tokens, cfg.head_dim)


def split_chunks(kv: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """KV [L, 2, H_kv, N, D] -> its full chunks [N // C, L, 2, H_kv, C, D] (contiguous)."""
    L, two, H, N, D = kv.shape
    n = N // chunk_tokens
    view = kv[:, :, :, :n * chunk_tokens].reshape(L, two, H, n, chunk_tokens, D)
    return np.ascontiguousarray(view.transpose(3, 0, 1, 2, 4, 5))


@dataclasses.dataclass
class ModelStages:
    """The pipeline's stage functions for a real model.

    host: [host_slots, L, 2, H_kv, C, D] L2 staging rows (the FETCH stage writes them);
    device: [device_slots, L, 2, H_kv, C, D] L1 slots (on this CPU build, host memory too: the
    upload is the same memcpy a host -> device copy would be).
    tokens_of(request) -> i32[n] the request's whole prompt.
    compute returns (first token id, logits f32[V]).
    """

    prefill: PrefixPrefill
    host: np.ndarray
    device: np.ndarray
    chunk_tokens: int
    tokens_of: Callable[[PipelineRequest], np.ndarray]

    def upload(self, request: PipelineRequest, chunk: int, host_slot: int, device_slot: int):
        np.copyto(self.device[device_slot], self.host[host_slot])

    def compute(self, request: PipelineRequest, loaded_chunks: int, device_slots):
        tokens = self.tokens_of(request)
        C = self.chunk_tokens
        # Always recompute at least the last prompt token (its logits give the first token).
        loaded = min(loaded_chunks, (len(tokens) - 1) // C)
        prefix = None
        if loaded:
            # Gather the prefix's L1 slots into one padded [L, 2, H_kv, P, D] array (a paged
            # attention kernel would read the slots in place; this CPU build copies once).
            L, two, H, _, D = self.device.shape[1:]
            prefix = np.zeros((L, two, H, self.prefill.prefix_padded(loaded * C), D),
                              self.device.dtype)
            for i, slot in enumerate(device_slots[:loaded]):
                prefix[:, :, :, i * C:(i + 1) * C] = self.device[slot]
        logits, _ = self.prefill(prefix, loaded * C, tokens[loaded * C:])
        return int(np.argmax(logits)), logits
