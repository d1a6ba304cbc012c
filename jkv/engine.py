"""Colocated dense engine: batched prefill into the paged KV cache, then jitted paged decode steps.

This is the single-process baseline (and the reference the disaggregated engines are checked
against). One thread; `generate()` blocks until every request in the batch has finished.

KV lives in one `jkv.kvcache.PagedKVCache` per engine: a prompt is prefilled whole (or in
chunks of `prefill_chunk` tokens when it is longer) into its pages, each decode step attends over
a page table as wide as the batch's longest live request (bucketed), and a request's pages go
back to the pool as soon as it finishes. Shapes are bucketed (prompt length to a power of two /
multiple of 512, table width by `kvcache.bucket_pages`) so a handful of compiled programs serve
all requests.

With `enable_prefix_caching` (off by default: `LLM` is the reference every other path is checked
against) the engine keeps finished requests' full pages in the cache's prefix LRU
(`jkv.kvcache.prefix`): a later prompt sharing leading full pages reuses them and its prefill starts
at its first uncached token (a chunked prefill with a per-row start), as the serve batcher does.
Without a fixed `num_pages` the pool grows when a batch needs more pages, and a new pool starts
with an empty prefix cache.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import numpy as np

from models import Model

from .kvcache import OutOfPages, PageConfig, PagedKVCache, prefix_namespace
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


DEFAULT_PREFILL_CHUNK = 4096


class DenseEngine:
    """Static-batch dense generation on one device, over a paged KV cache.

    page_size: tokens per KV page. num_pages: a fixed pool size (including the null page);
    None sizes the pool to the largest batch seen (grown, never shrunk). prefill_chunk: prompts
    longer than this many tokens are prefilled in chunks of it (bounds prefill memory).
    enable_prefix_caching: reuse cached full pages of earlier requests' prompts and outputs.
    """

    def __init__(self, model: Model, *, page_size: int = 16, num_pages: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, enable_prefix_caching: bool = False):
        if prefill_chunk < 1:
            raise ValueError(f"{prefill_chunk=} must be >= 1 (tokens per prefill chunk)")
        self.model = model
        self.page_size = page_size
        self.num_pages = num_pages
        self.prefill_chunk = prefill_chunk
        self.prefix_namespace = prefix_namespace(model, model.cfg.dtype, page_size) if enable_prefix_caching else None
        self.kv_cache: PagedKVCache | None = None
        if num_pages is not None:
            self.kv_cache = self._new_cache(num_pages)

    def _new_cache(self, num_pages: int) -> PagedKVCache:
        return PagedKVCache(self.model.cfg, PageConfig(self.page_size, num_pages),
                            prefix_namespace=self.prefix_namespace, sharding=self.model.kv_sharding)

    def _cache_for(self, pages_needed: int) -> PagedKVCache:
        if self.num_pages is None and (self.kv_cache is None or self.kv_cache.allocator.capacity < pages_needed):
            num_pages = 1 << pages_needed.bit_length()  # >= pages_needed + 1 (the null page)
            self.kv_cache = self._new_cache(num_pages)
        if pages_needed > self.kv_cache.pages_free:  # fail before prefill, not mid-decode
            raise OutOfPages(pages_needed, self.kv_cache.pages_free, self.kv_cache.allocator.capacity)
        return self.kv_cache

    def generate(self, requests: Sequence[Request], t0: float | None = None) -> list[RequestOutput]:
        m = self.model
        t0 = time.perf_counter() if t0 is None else t0
        for r in requests:
            check_context(m, r)
        B = len(requests)
        lengths = np.array([len(r.prompt_token_ids) for r in requests], np.int32)
        # Room for prompt + max_tokens per request, whole pages each: decode never runs out.
        cache = self._cache_for(sum(-(-(int(lengths[b]) + r.params.max_tokens) // self.page_size)
                                    for b, r in enumerate(requests)))
        rows = list(range(B))  # cache keys: batch rows (request ids need not be unique)
        try:
            cached = np.array([cache.reserve_prefix(b, r.prompt_token_ids, int(lengths[b]))
                               for b, r in enumerate(requests)], np.int32)
            if cached.any():
                logits = self._prefill_chunks(cache, requests, lengths, cached)
            else:
                logits = self._prefill(cache, requests, lengths)
            for b, r in enumerate(requests):
                cache.commit_pages(b, r.prompt_token_ids)
            return self._decode(cache, requests, lengths, logits, t0)
        finally:
            for b in rows:
                cache.free(b)

    def _prefill(self, cache: PagedKVCache, requests: Sequence[Request], lengths: np.ndarray):
        """Prompts into pages; returns logits f32[B, V] at each prompt's last token."""
        m, B, C = self.model, len(requests), self.prefill_chunk
        rows = list(range(B))
        if int(lengths.max()) <= C:
            T = bucket_prompt_len(int(lengths.max()))
            tokens = np.zeros((B, T), np.int32)
            for b, r in enumerate(requests):
                tokens[b, :lengths[b]] = r.prompt_token_ids
            logits, kv = m.prefill(tokens, lengths)
            cache.kv = m.write_prefill_pages(cache.kv, cache.table(rows), kv, lengths)
            return logits
        return self._prefill_chunks(cache, requests, lengths, np.zeros(B, np.int32))

    def _prefill_chunks(self, cache: PagedKVCache, requests: Sequence[Request], lengths: np.ndarray,
                        cached: np.ndarray):
        """Prompts into pages in chunks of prefill_chunk tokens, row b starting at position cached[b]
        (i32[B]: its leading tokens already in shared pages); returns logits f32[B, V] at each
        prompt's last token."""
        m, B, C = self.model, len(requests), self.prefill_chunk
        rows = list(range(B))
        todo = lengths - cached  # >= 1 per row: the last prompt token is never cached
        n_chunks = -(-int(todo.max()) // C)
        tokens = np.zeros((B, n_chunks * C), np.int32)
        for b, r in enumerate(requests):
            tokens[b, :todo[b]] = r.prompt_token_ids[cached[b]:]
        last = None
        for i in range(n_chunks):
            s = i * C
            # The chunk reads the pages before it and writes its own: the table spans both.
            table = cache.table(rows, max_pages=-(-(int(cached.max()) + s + C) // cache.page_size))
            chunk_len = np.clip(todo - s, 0, C).astype(np.int32)
            logits, cache.kv = m.prefill_chunk(cache.kv, table, tokens[:, s:s + C], (cached + s).astype(np.int32),
                                               chunk_len)
            ends_here = ((todo - 1) // C == i)[:, None]
            last = np.where(ends_here, np.asarray(logits), 0.0 if last is None else last)
        return last

    def _decode(self, cache: PagedKVCache, requests: Sequence[Request], lengths: np.ndarray, logits,
                t0: float) -> list[RequestOutput]:
        m, B = self.model, len(requests)
        temperature = np.array([r.params.temperature for r in requests], np.float32)
        top_k = np.array([r.params.top_k for r in requests], np.int32)
        top_p = np.array([r.params.top_p for r in requests], np.float32)
        seeds = np.array([r.params.seed if r.params.seed is not None else np.random.randint(0, 2**31)
                          for r in requests], np.uint32)

        def pick(logits, steps):
            return sample_or_argmax(logits, temperature, top_k, top_p, seeds, steps)

        steps = np.zeros(B, np.int32)
        next_tok = pick(logits, steps)
        now = time.perf_counter() - t0
        gen = [[int(t)] for t in next_tok]
        times = [[now] for _ in range(B)]
        checkers = [StopChecker(m.tokenizer, r.params, m.cfg.eos_token_ids) for r in requests]
        done: list[tuple | None] = [checkers[b].finish(gen[b]) for b in range(B)]
        done = [d if d[0] else None for d in done]
        positions = lengths.copy()
        while not all(done):
            for b in range(B):
                if done[b]:
                    if b in cache:  # its prompt and the generated tokens whose KV is written
                        cache.commit_pages(b, list(requests[b].prompt_token_ids) + gen[b][:positions[b] - lengths[b]])
                    cache.free(b)  # pages back to the pool as soon as a request finishes
                    positions[b] = 0  # an idle row: all-null table row, attends to nothing cached
                else:
                    cache.reserve(b, int(positions[b]) + 1)
            table = cache.table([None if done[b] else b for b in range(B)])
            logits, cache.kv = m.paged_decode_step(cache.kv, table, next_tok, positions)
            steps = steps + 1
            next_tok = pick(logits, steps)
            now = time.perf_counter() - t0
            for b in range(B):
                if done[b]:
                    continue
                positions[b] += 1
                gen[b].append(int(next_tok[b]))
                times[b].append(now)
                reason, ids, text = checkers[b].finish(gen[b])
                if reason:
                    done[b] = (reason, ids, text)
        for b, r in enumerate(requests):  # rows that finished at the last step
            if b in cache:
                cache.commit_pages(b, list(r.prompt_token_ids) + gen[b][:positions[b] - lengths[b]])
        return [RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
            text=done[b][2], token_ids=done[b][1], finish_reason=done[b][0],
            metrics=RequestMetrics.from_token_times(int(lengths[b]), times[b]))
            for b, r in enumerate(requests)]
