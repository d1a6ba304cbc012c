"""Retrieval vs streaming head classification for MixHQ (KVServe §5.1, after DuoAttention).

DuoAttention calls a head a *streaming* head when attending only to the attention sinks and a
recent window changes its output little, and a *retrieval* head otherwise. Here the score of a
KV head is the attention mass its queries put on the *middle* keys — neither sinks nor recent —
averaged over calibration queries (and over the query heads of its GQA group): exactly the mass a
streaming approximation would drop. MixHQ keeps high-score heads at high precision and quantizes
the rest to ultra-low bits instead of discarding them.

Everything but `observation_queries` / `observation_scores` takes plain arrays; those two replay
a request's last prompt tokens through the model to get its real queries (SnapKV's observation
window), which is what `streaming.StreamingPlan` classifies heads from, per request.

    probs:  f32[L, H, Tq, Tk]   softmax attention of Tq calibration queries over Tk keys
    q_pos:  i32[Tq]             absolute position of each query (causal: key j visible iff j <= q_pos)
    scores: f32[L, H_kv]
"""
from __future__ import annotations

import numpy as np


def attention_probs(q: np.ndarray, k: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
    """Causal softmax(q K^T / sqrt(D)) with GQA: q f32[H, Tq, D], k f32[H_kv, Tk, D] -> f32[H, Tq, Tk]."""
    q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)
    h, h_kv = q.shape[0], k.shape[0]
    if q.ndim != 3 or k.ndim != 3 or h % h_kv or q.shape[2] != k.shape[2]:
        raise ValueError(f"need q [H, Tq, D] and k [H_kv, Tk, D] with H % H_kv == 0; got {q.shape}, {k.shape}")
    k_full = np.repeat(k, h // h_kv, axis=0)  # [H, Tk, D]
    logits = q @ np.swapaxes(k_full, 1, 2) / np.sqrt(q.shape[2])  # [H, Tq, Tk]
    visible = np.arange(k.shape[1])[None, :] <= np.asarray(q_pos)[:, None]  # [Tq, Tk]
    logits = np.where(visible[None], logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=-1, keepdims=True)


def retrieval_scores(probs: np.ndarray, q_pos: np.ndarray, n_kv_heads: int,
                     sink: int = 4, recent: int = 64) -> np.ndarray:
    """DuoAttention-style retrieval score f32[L, H_kv]: attention mass outside sinks + recent window."""
    probs = np.asarray(probs, dtype=np.float32)
    if probs.ndim != 4:
        raise ValueError(f"probs must be [L, H, Tq, Tk]; got shape {probs.shape}")
    n_layers, h, tq, tk = probs.shape
    q_pos = np.asarray(q_pos)
    if q_pos.shape != (tq,):
        raise ValueError(f"q_pos must be i32[Tq={tq}]; got shape {q_pos.shape}")
    if n_kv_heads < 1 or h % n_kv_heads:
        raise ValueError(f"{n_kv_heads=} must divide the {h} query heads")
    if sink < 0 or recent < 1:
        raise ValueError(f"{sink=} must be >= 0 and {recent=} >= 1")
    j = np.arange(tk)[None, :]
    middle = (j >= sink) & (j <= q_pos[:, None] - recent)  # [Tq, Tk]
    mass = (probs * middle).sum(axis=-1).mean(axis=-1)  # [L, H]
    return mass.reshape(n_layers, n_kv_heads, h // n_kv_heads).mean(axis=-1)


def classify_heads(scores: np.ndarray, retrieval_fraction: float) -> np.ndarray:
    """bool[L, H_kv]: the top `retrieval_fraction` of all heads by score (ties: lower index first)."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"head scores must be a non-empty [L, H_kv] array; got shape {scores.shape}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("head scores contain NaN/inf")
    if not 0.0 <= retrieval_fraction <= 1.0:
        raise ValueError(f"{retrieval_fraction=} must be in [0, 1]")
    n_retrieval = int(round(retrieval_fraction * scores.size))
    order = np.argsort(-scores.reshape(-1), kind="stable")
    retrieval = np.zeros(scores.size, dtype=bool)
    retrieval[order[:n_retrieval]] = True
    return retrieval.reshape(scores.shape)


def observation_queries(model, prompt, kv, window: int = 32) -> np.ndarray:
    """f32[L, H, W, D]: the real (RoPE'd) queries of the prompt's last W tokens (SnapKV's observation
    window), recomputed on the prefill's own KV: per layer (K, V) [H_kv, N, D] of `prompt` (N tokens).

    Each of the W tokens is replayed through the model's per-layer decode entry points
    (`qkv` / `attend_and_mlp`) attending to the exact prefix KV, so these are the queries the prefill
    computed — the prefill side has them, no future token is used.
    """
    import jax.numpy as jnp

    n = kv[0][0].shape[1]
    if len(prompt) != n:
        raise ValueError(f"prompt has {len(prompt)} tokens; the KV has N={n}")
    window = min(window, n)
    h_kv = kv[0][0].shape[0]
    K = [jnp.asarray(np.asarray(k, np.float32)[None], model.cfg.dtype) for k, _ in kv]
    V = [jnp.asarray(np.asarray(v, np.float32)[None], model.cfg.dtype) for _, v in kv]
    out = np.zeros((len(kv), model.cfg.num_heads, window, kv[0][0].shape[2]), np.float32)
    for i, pos in enumerate(range(n - window, n)):
        x = model.embed(jnp.asarray([int(prompt[pos])]))
        for layer in range(len(kv)):
            q, _, _ = model.qkv(layer, x, jnp.asarray([pos]))
            out[layer, :, i] = np.asarray(q[0], np.float32)
            x = model.attend_and_mlp(layer, x, q, K[layer], V[layer], jnp.full((1, h_kv), pos + 1, jnp.int32))
    return out


def observation_scores(model, prompt, kv, window: int = 32, sink: int = 16, recent: int = 64) -> np.ndarray:
    """f32[L, H_kv] retrieval scores of one request from its own observation-window queries: the
    attention mass outside the sinks + recent window (`retrieval_scores`)."""
    q = observation_queries(model, prompt, kv, window)
    n = kv[0][0].shape[1]
    q_pos = np.arange(n - q.shape[2], n)
    probs = np.stack([attention_probs(q[layer], np.asarray(k, np.float32), q_pos) for layer, (k, _) in enumerate(kv)])
    return retrieval_scores(probs, q_pos, kv[0][0].shape[0], sink=sink, recent=min(recent, n))
