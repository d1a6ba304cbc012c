"""Colocated dense engine: batched prefill, then jitted dense decode steps with an on-device cache.

This is the single-process baseline (and the reference the disaggregated engines are checked
against). One thread; `generate()` blocks until every request in the batch has finished.

Shapes are bucketed (prompt length to a power of two / multiple of 512, cache length to a
multiple of 64) so a handful of compiled programs serve all requests.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import numpy as np

from models import Model

from .outputs import RequestMetrics, RequestOutput
from .sampling import SamplingParams, sample_or_argmax

log = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    pass


def bucket_prompt_len(n: int) -> int:
    if n <= 1024:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // 512) * 512


def bucket_cache_len(n: int) -> int:
    return -(-n // 64) * 64


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: object
    prompt_token_ids: list[int]
    params: SamplingParams


def check_context(model: Model, req: Request):
    ctx = model.cfg.max_position_embeddings
    n = len(req.prompt_token_ids)
    if n == 0:
        raise ValueError(f"request {req.request_id}: the prompt is empty (0 tokens); give at least one token")
    if n + req.params.max_tokens > ctx:
        raise PromptTooLongError(
            f"request {req.request_id}: the prompt has {n} tokens and max_tokens={req.params.max_tokens}, "
            f"together {n + req.params.max_tokens}, but the model's context length is {ctx}; "
            "shorten the prompt or lower max_tokens")


class StopChecker:
    """Incremental stop detection on decoded text (stop strings may span tokens)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: Sequence[int]):
        self.tok = tokenizer
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))

    def finish(self, ids: list[int]) -> tuple[str | None, list[int], str]:
        """Returns (finish_reason or None, kept ids, text)."""
        if ids and ids[-1] in self.stop_ids:
            kept = ids[:-1]
            return "stop", kept, self._text(kept)
        text = self._text(ids)
        for s in self.params.stop:
            i = text.find(s)
            if i >= 0:
                return "stop", ids, text[:i]
        if len(ids) >= self.params.max_tokens:
            return "length", ids, text
        return None, ids, text

    def _text(self, ids):
        return self.tok.decode(ids) if self.tok is not None else ""


class DenseEngine:
    """Static-batch dense generation on one device."""

    def __init__(self, model: Model):
        self.model = model

    def generate(self, requests: Sequence[Request], t0: float | None = None) -> list[RequestOutput]:
        m = self.model
        t0 = time.perf_counter() if t0 is None else t0
        for r in requests:
            check_context(m, r)
        B = len(requests)
        lengths = np.array([len(r.prompt_token_ids) for r in requests], np.int32)
        T = bucket_prompt_len(int(lengths.max()))
        tokens = np.zeros((B, T), np.int32)
        for b, r in enumerate(requests):
            tokens[b, :lengths[b]] = r.prompt_token_ids
        n_max = max(T, bucket_cache_len(int(max(lengths[b] + r.params.max_tokens for b, r in enumerate(requests)))))

        temperature = np.array([r.params.temperature for r in requests], np.float32)
        top_k = np.array([r.params.top_k for r in requests], np.int32)
        top_p = np.array([r.params.top_p for r in requests], np.float32)
        seeds = np.array([r.params.seed if r.params.seed is not None else np.random.randint(0, 2**31)
                          for r in requests], np.uint32)

        def pick(logits, steps):
            return sample_or_argmax(logits, temperature, top_k, top_p, seeds, steps)

        logits, kv = m.prefill(tokens, lengths)
        cache = m.cache_from_prefill(kv, n_max)
        del kv
        steps = np.zeros(B, np.int32)
        next_tok = pick(logits, steps)
        now = time.perf_counter() - t0
        gen = [[int(t)] for t in next_tok]
        times = [[now] for _ in range(B)]
        checkers = [StopChecker(m.tokenizer, r.params, m.cfg.eos_token_ids) for r in requests]
        done: list[tuple | None] = [None] * B
        for b in range(B):
            reason, ids, text = checkers[b].finish(gen[b])
            if reason:
                done[b] = (reason, ids, text)
        positions = lengths.copy()
        while not all(done):
            logits, cache = m.decode_step(cache, next_tok, positions)
            steps = steps + 1
            next_tok = pick(logits, steps)
            now = time.perf_counter() - t0
            positions = np.minimum(positions + 1, n_max - 1)  # finished rows idle at the end
            for b in range(B):
                if done[b]:
                    continue
                gen[b].append(int(next_tok[b]))
                times[b].append(now)
                reason, ids, text = checkers[b].finish(gen[b])
                if reason:
                    done[b] = (reason, ids, text)
        outs = []
        for b, r in enumerate(requests):
            reason, ids, text = done[b]
            outs.append(RequestOutput(
                request_id=r.request_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids), text=text,
                token_ids=ids, finish_reason=reason,
                metrics=RequestMetrics.from_token_times(int(lengths[b]), times[b])))
        return outs
