"""Fidelity of sparse decode to dense decode on real long text (works at any length).

A prompt of `length` tokens from the evaluation split of the local documentation corpus is
followed by a teacher-forced continuation of `continuation` real tokens. At each continuation
position both decodes give a next-token distribution; we report the mean per-token
KL(dense || sparse), top-1 agreement, and the perplexity ratio exp(mean NLL_sparse − mean NLL_dense)
over the true continuation tokens (1.0 = no loss).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from jkv.corpus import long_text


@functools.lru_cache(maxsize=4)
def _eval_tokens(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(long_text("eval")))


def fidelity_windows(tokenizer, length: int, continuation: int) -> int:
    """How many distinct samples `fidelity_sample` has at this length (windows start every half
    window; index `fidelity_windows(...)` wraps to sample 0). SmolLM2's tokenizer: 114 at 1K."""
    tokens = _eval_tokens(tokenizer)
    window = length + continuation
    if len(tokens) < window:
        raise ValueError(f"evaluation corpus has {len(tokens)} tokens < {length=} + {continuation=}")
    return max(1, (len(tokens) - window) // max(1, window // 2))


def fidelity_sample(tokenizer, length: int, continuation: int, index: int) -> tuple[list[int], np.ndarray]:
    """(prompt of `length` tokens, i32[continuation] true next tokens) starting at a window that
    depends on `index` (windows tile the corpus, then wrap: see `fidelity_windows`)."""
    tokens = _eval_tokens(tokenizer)
    window = length + continuation
    slots = fidelity_windows(tokenizer, length, continuation)
    start = (index % slots) * (window // 2)
    chunk = tokens[start:start + window]
    return list(chunk[:length]), np.asarray(chunk[length:], np.int32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def fidelity_metrics(dense_logits: np.ndarray, sparse_logits: np.ndarray,
                     targets: np.ndarray) -> dict[str, float | str]:
    """dense_logits, sparse_logits: f32[S, V]; targets: i32[S] -> {kl, top1, ppl_ratio, acc, ppl_dense,
    agree}; acc = the sparse side's next-token accuracy against targets (a task metric per token); agree is one '1'/'0' per position (top-1 agreement per token, for paired comparisons
    of two selectors on the same tokens)."""
    if dense_logits.shape != sparse_logits.shape or dense_logits.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: dense {dense_logits.shape}, sparse {sparse_logits.shape}, "
                         f"targets {targets.shape}")
    log_p, log_q = log_softmax(dense_logits), log_softmax(sparse_logits)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    same = dense_logits.argmax(-1) == sparse_logits.argmax(-1)
    top1 = float(same.mean())
    rows = np.arange(targets.shape[0])
    nll_dense, nll_sparse = -log_p[rows, targets].mean(), -log_q[rows, targets].mean()
    return {"kl": max(kl, 0.0), "top1": top1, "ppl_ratio": float(np.exp(nll_sparse - nll_dense)),
            "acc": float((sparse_logits.argmax(-1) == targets).mean()),  # next-token accuracy vs the true text
            "ppl_dense": float(np.exp(nll_dense)), "agree": "".join("1" if a else "0" for a in same)}


def generation_agreement(reference: Sequence[int], tokens: Sequence[int]) -> dict[str, float]:
    """Agreement of two greedy generations from the same prompt: prefix = how many leading tokens
    are equal (greedy decoding diverges at the first changed token and rarely re-joins), fraction =
    equal positions / the longer length (a generation that stopped early disagrees where the other
    went on; 1.0 for two empty ones)."""
    longest = max(len(reference), len(tokens))
    if longest == 0:
        return {"prefix": 0, "fraction": 1.0}
    same = [a == b for a, b in zip(reference, tokens)]
    prefix = next((i for i, s in enumerate(same) if not s), len(same))
    return {"prefix": prefix, "fraction": sum(same) / longest}
