"""Continuous batching on the paged KV cache, with chunked prefill (`jkv serve --kv-layout paged`).

`PagedBatcher` keeps `ContinuousBatcher`'s interface and threading (one engine thread owns the
model and the device; `submit` / `cancel` from any thread go through the inbox queue; results
leave through each request's `emit`), and replaces its storage and schedule:

Storage. One `PagedKVCache` (jkv/kvcache/paged.py): per layer K/V pages [num_pages, H_kv, P, D]
on the default device; a request owns the pages its page table lists. A slot here is only a
seat in the batch (at most max_slots requests in flight); it holds no KV.

Page lifecycle (all on the engine thread):
    admit:   reserve pages for prompt + max_tokens (prompt only for an echo-scoring request).
             When the pool has too few free pages the request stays first in the queue (FIFO:
             a big request is not starved by small ones) and is admitted once pages come back.
             A request that could not fit even in an empty pool is rejected by `check_request`
             (HTTP 400) naming the page counts and --num-pages.
    prefill: the prompt is written into its pages in chunks (`Model.prefill_chunk`).
    decode:  one token per step per decoding request (`Model.paged_decode_step`), written at its
             position in its own pages; the batch is cut to the next power of two of the decoding
             requests and the page table to the largest reservation among them (bucketed), so a
             step costs what the running requests need, not max_slots x N_max.
    free:    on finish, cancel, error and stop (`_free`, `_fail_all`), before the request's last
             event is emitted, so a client that sees the end sees its pages back in the pool.

Prefix caching (`enable_prefix_caching`, on by default): at admission the prompt's leading full
pages whose chained hash (jkv/kvcache/prefix.py) is cached are shared, read-only, and the
request's prefill starts at its first uncached token (at least the last prompt token is always
computed: its logits give the first token). Each full page is offered to the cache as soon as its
KV is written (after a prefill chunk; during decode when a generated token fills a page), so a
request arriving while another with the same system prompt still runs already shares it. Freed
cached pages stay in the allocator's LRU and are evicted only when admission needs pages, so the
waiting / page-budget rules above count them as free. A request with `prefix_cache=False` (the
server sets it for requests that ask for log-probs, so their numbers never depend on the cache's
state) and a prompt-scoring request (`prompt_logprobs`, written whole) compute their whole prompt
and only offer their pages. With `prefix_cache_host_bytes` (L2) and/or `prefix_cache_l3` (a remote
pool, L3) an evicted page is written there in the background (jkv/kvcache/writeback.py: the engine
thread only dispatches a snapshot of the pages), and with L3 so are a finished request's cached
pages L3 is not known to hold (so another server sharing the pool hits them). A later prompt that
misses in device pages but may hit there is loaded by CALVO's loading stages
(jkv/serving/prefix_loader.py): at admission it takes all its pages (proactive allocation) but no
seat, and its pages move L3 -> L2 -> L1 on the stages' threads while the engine keeps stepping the
running requests and admitting others; when its prefix is in its pages it takes a seat and
prefills from its first page not loaded (a page both tiers miss, a failed read or one past the L3
op timeout `prefix_cache_l3_timeout` is recomputed; jkv/kvcache/remote_tier.py).

Admission order (`schedule`, jkv/serving/admission.py): the request admitted next (seated, or sent
to the loading stages, whose queues the same policy orders) is the policy's pick among the waiting
ones (fifo: the oldest; sjf / srpt / lstf by the cost model of its prefix load and prefill; edf by
its slo_ms deadline). The cost model
is loaded from `cost_model` or probed from the engine at start (jkv/serving/cost_probe.py) and
refitted from the loads and single-chunk prefills the engine measures while serving.

Schedule, per engine iteration: drain inbox → admit (reserve pages, take a seat) → prefill chunks of
up to `prefill_chunk` tokens, oldest admitted request first, until `prefill_chunk` prompt tokens are
done (a long prompt takes several iterations; several short ones share one) → one decode step for every request whose prompt is complete. So a 4K-token prompt
admitted while others stream delays each of their tokens by one chunk, not by its whole prefill.
A request's first token is sampled from the logits at the last prompt token of its last chunk.

Log-probabilities: generated-token logprobs as in `ContinuousBatcher`. A prompt_logprobs request
(echo / lm-eval scoring) is prefilled whole by `Model.prefill(all_logits=True)`, as the slot engine
does, and its KV scattered into its pages (`Model.write_prefill_pages`): a chunk step returns only
the logits at the chunk's last token.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import jax
import numpy as np

from models import Model

from ..engine import bucket_prompt_len
from ..kvcache import H2D_CAUSES, OutOfPages, PageConfig, PagedKVCache, bucket_pages, prefix_namespace
from ..sampling import sample_or_argmax
from .admission import AdmissionScheduler, Refit, SchedulingMetrics
from .batcher import (BatcherConfig, ContextLengthError, ContinuousBatcher, EngineRequest, StreamEvent, _Running,
                      logprob_rows, prompt_logprob_list)
from .text_stream import TextStream

log = logging.getLogger(__name__)


class KVCapacityError(ContextLengthError):
    """The request needs more KV pages than the whole pool holds."""


def page_config(config: BatcherConfig) -> PageConfig:
    """The pool `config` asks for: num_pages, or by default room for max_slots requests of
    max_model_len tokens each (the slot layout's KV memory), plus the null page."""
    if config.num_pages is not None:
        return PageConfig(page_size=config.page_size, num_pages=config.num_pages)
    per_request = -(-config.max_model_len // config.page_size)
    return PageConfig(page_size=config.page_size, num_pages=config.max_slots * per_request + 1)


def _bucket_rows(n: int, limit: int) -> int:
    """Decode batch rows for n decoding requests: the next power of two >= n, at most `limit`
    (max_slots), so a step's cost follows the running requests (one request reads one row's pages,
    three read four rows') and there are few programs: `row_buckets` lists them all and the warm-up
    compiles each (a shape first met while serving compiles for seconds and stalls every stream)."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


def row_buckets(limit: int) -> list[int]:
    """Every batch size `_bucket_rows` returns for 1..limit requests: 1, 2, 4, ... and limit."""
    return sorted({_bucket_rows(n, limit) for n in range(1, limit + 1)})


class _PagedRun(_Running):
    """A seated request: its cache key and how much of its prompt is in its pages."""

    def __init__(self, req: EngineRequest, stream: TextStream, seed: int, key: str):
        super().__init__(req, stream, seed)
        self.key = key
        self.prefilled = 0  # prompt tokens already in its pages (shared from the prefix cache or computed)
        self.first_chunk = 0  # where its prefill started (the tokens it found cached)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.req.prompt_token_ids)


class PagedBatcher(ContinuousBatcher):
    """ContinuousBatcher's interface over the paged KV cache, with chunked prefill."""

    def __init__(self, model: Model, config: BatcherConfig = BatcherConfig(), metrics=None):
        super().__init__(model, config, metrics)
        self.page_cfg = page_config(config)
        self.prefix_namespace = (prefix_namespace(model, model.cfg.dtype, self.page_cfg.page_size)
                                 if config.enable_prefix_caching else None)
        self.kv: PagedKVCache | None = None  # created by start(); the engine thread owns it afterwards
        self._prefilling: collections.deque[int] = collections.deque()  # seats still prefilling, oldest first
        self._next_key = 0
        self._blocked: str | None = None  # request id last logged as waiting for pages
        self.loader = None  # prefix_loader.PrefixLoader, made by start() when the prefix cache has a tier
        self._loading: dict[str, EngineRequest] = {}  # by cache key: in the loading stages (pages, no seat)
        self._ready: collections.deque = collections.deque()  # (request, key, cached tokens): loaded, wait for a seat
        self.scheduler: AdmissionScheduler | None = None  # made by start(): its cost model may need the live cache
        self._refit: Refit | None = None
        self._sched_metrics: SchedulingMetrics | None = None

    # ------------------------------------------------------------ any thread
    def check_request(self, prompt_len: int, max_tokens: int):
        """ContinuousBatcher's check, plus: the request must fit the page pool when it is empty."""
        super().check_request(prompt_len, max_tokens)
        pc = self.page_cfg
        need = pc.pages_for(prompt_len + max_tokens)
        if need > pc.usable_pages:
            raise KVCapacityError(
                f"the request needs {need} KV pages of {pc.page_size} tokens ({prompt_len} prompt + {max_tokens} "
                f"max_tokens) but the paged KV cache holds only {pc.usable_pages} pages in all; raise --num-pages "
                f"to at least {need + 1}, or shorten the prompt or lower max_tokens")

    # Read by /metrics from the HTTP thread: plain attribute reads of the allocator's counters.
    @property
    def pages_in_use(self) -> int:
        return self.kv.pages_in_use if self.kv is not None else 0

    @property
    def pages_free(self) -> int:
        return self.kv.pages_free if self.kv is not None else self.page_cfg.usable_pages

    @property
    def bytes_in_use(self) -> int:
        return self.kv.bytes_in_use if self.kv is not None else 0

    @property
    def h2d_bytes(self) -> dict[str, int]:
        """Host->device KV bytes by cause: prefix pages loaded back from L2 / L3 ("fetched"); decode
        steps compute their KV on the device and copy none."""
        return self.kv.h2d_bytes if self.kv is not None else dict.fromkeys(H2D_CAUSES, 0)

    def start(self):
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self.kv = self._new_cache(tiers=True)
        self._start_scheduler()
        if self.kv.host is not None or self.kv.remote is not None:
            from .prefix_loader import PrefixLoader

            self.loader = PrefixLoader(self.kv, self.scheduler.policy, self._inbox.put)
        if self.metrics is not None:
            self._sched_metrics = SchedulingMetrics(self.metrics.registry, self.config.schedule,
                                                    self.prefix_namespace is not None)
            self.metrics.watch_kv_cache(self)
            if self.prefix_namespace is not None:
                self.metrics.watch_prefix_cache(lambda: self.kv.stats())
        self._thread = threading.Thread(target=self._loop, name="jkv-engine", daemon=True)
        self._thread.start()

    def warmup(self):
        """Compile every decode step the engine can run (each of `row_buckets` x each page-table
        width up to max_model_len's: which requests decode together is a matter of timing, so any of
        them may come up), the shortest prefill chunk and the sampler. Longer chunks compile when a
        prompt of that size is first admitted (their shapes depend only on the prompt)."""
        kv = self._new_cache()
        T = min(bucket_prompt_len(1), self.config.prefill_chunk)
        one = np.ones(1, np.int32)
        widest = bucket_pages(self.page_cfg.pages_for(self.config.max_model_len))
        widths = sorted({bucket_pages(n) for n in range(1, widest + 1)})
        rows = row_buckets(self.config.max_slots)
        t0 = time.perf_counter()
        # one line per table width: a start-up of minutes on a loaded CPU shows where it is
        log.info("warm-up: compiling %d decode programs (rows %s x page-table widths %s)", len(rows) * len(widths),
                 rows, widths)
        for i, width in enumerate(widths):
            for B in rows:
                table = np.zeros((B, width), np.int32)  # the null page: scratch, as for an idle row
                z = np.zeros(B, np.int32)
                logits, kv.kv = self.model.paged_decode_step(kv.kv, table, z, z)
            log.info("warm-up: decode programs for %d-page tables compiled (%d/%d widths, %.0fs)", width, i + 1,
                     len(widths), time.perf_counter() - t0)
        logits, kv.kv = self.model.prefill_chunk(kv.kv, table[:1, :widths[0]], np.zeros((1, T), np.int32), z[:1], one)
        tiers = self.config.prefix_cache_host_bytes or self.config.prefix_cache_l3
        if tiers and self.prefix_namespace is not None:  # the loading stages' page write
            from ..kvcache.host_tier import scatter_pages
            from .prefix_loader import CHUNK_PAGES

            kv.kv = scatter_pages(kv.kv, np.zeros(CHUNK_PAGES, np.int32),
                                  np.zeros((CHUNK_PAGES, *kv.page_shape), kv.dtype))
        for B in rows:  # the sampler and the all-greedy argmax (`sample_or_argmax`) of every row bucket
            z = np.zeros(B, np.int32)
            for temperature in (1.0, 0.0):
                sample_or_argmax(np.zeros((B, self.model.cfg.vocab_size), np.float32),
                                 np.full(B, temperature, np.float32), z, np.ones(B, np.float32), z.astype(np.uint32), z)
        jax.block_until_ready(logits)

    def _start_scheduler(self):
        """The admission scheduler, with the cost model from the `cost_model` file or a probe of the
        engine (sjf / srpt / lstf only: fifo and edf do not read it)."""
        cfg = self.config
        cost = None
        if cfg.cost_model is not None:
            from ..scheduling import CostModel

            cost = CostModel.load(cfg.cost_model)
        elif cfg.schedule not in ("fifo", "edf"):
            from .cost_probe import probe_cost_model

            cost = probe_cost_model(self.model, self.kv)
        self.scheduler = AdmissionScheduler(cfg.schedule, cost)
        self._refit = Refit(cost) if cost is not None else None

    def _measured(self, kind: str, tokens: int, seconds: float, tier: str | None = None):
        """A load (kind "load", from `tier`) or a prefill ("compute") the engine timed: to the metrics
        and the cost model's refit."""
        if tier is not None and self._sched_metrics is not None:
            self._sched_metrics.loaded(tier, seconds)
        if self._refit is not None and tokens > 0:
            model = (self._refit.add_load if kind == "load" else self._refit.add_compute)(tokens, seconds)
            if model is not None:
                self.scheduler.set_cost_model(model)
                if self.loader is not None:
                    self.loader.set_policy(self.scheduler.policy)

    def _new_cache(self, tiers: bool = False) -> PagedKVCache:
        """The paged cache; with tiers, its host (L2) and remote (L3) tiers as configured (warm-up's
        scratch cache has none: it must not start write-back threads or connect to a pool)."""
        host = remote = None
        cfg = self.config
        if tiers and self.prefix_namespace is not None and cfg.prefix_cache_host_bytes:
            from ..kvpool import HostKVPool

            host = HostKVPool(cfg.prefix_cache_host_bytes)
        if tiers and self.prefix_namespace is not None and cfg.prefix_cache_l3:
            from ..kvcache.remote_tier import open_remote_pool

            remote = open_remote_pool(cfg.prefix_cache_l3, cfg.prefix_cache_l3_timeout,
                                      retry_after_s=max(1.0, 2 * cfg.prefix_cache_l3_timeout))
        return PagedKVCache(self.model.cfg, self.page_cfg, prefix_namespace=self.prefix_namespace, host_pool=host,
                            sharding=self.model.kv_sharding, remote_pool=remote,
                            remote_timeout_s=cfg.prefix_cache_l3_timeout)

    def stop(self, timeout: float = 30.0):
        super().stop(timeout)
        if self.loader is not None:
            self.loader.close()
        if self.kv is not None:
            self.kv.close()

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (thread-safe; pages held by running requests stay theirs)."""
        return self.kv.clear_prefix_cache() if self.kv is not None else 0

    # ------------------------------------------------------- engine thread
    def _step(self):
        self._admit()
        self._prefill_some(self.config.prefill_chunk)
        if any(r is not None and r.decoding for r in self._slots):
            self._decode_one_step()

    def _admit(self):
        """Seat loaded requests, then admit waiting ones in the policy's order: a request with a prefix
        to load from L2 / L3 takes its pages and enters the loading stages (at most max_slots at
        once), any other takes its pages and a seat. Stops at the first that cannot proceed."""
        while self._ready and None in self._slots:
            self._seat(*self._ready.popleft())
        while self._waiting:
            req = self.scheduler.pick(self._waiting, self._estimate, _not_loaded, time.perf_counter())
            n = len(req.prompt_token_ids)
            key = f"{req.request_id}#{self._next_key}"  # unique even if a client reuses request ids
            total = n if req.prompt_only else n + req.params.max_tokens
            from_cache = req.prompt_logprobs is None and req.prefix_cache  # else computed from position 0
            load = from_cache and self.loader is not None and self._has_load(req)
            full = self.loader.loading >= self.config.max_slots if load else None not in self._slots
            if full:
                return
            try:
                plan, cached = None, 0
                if load:
                    plan = self.kv.reserve_for_load(key, req.prompt_token_ids, total)
                    cached = plan.shared * self.page_cfg.page_size
                elif from_cache:
                    cached = self.kv.reserve_prefix(key, req.prompt_token_ids, total)
                else:
                    self.kv.reserve(key, total)
            except OutOfPages as e:
                self.kv.free(key)  # drop the empty entry the failed reserve left
                if self._blocked != req.request_id:  # once per request, not once per step
                    self._blocked = req.request_id
                    log.info("request %s waits for KV pages: needs %d, %d free (%d in use)", req.request_id,
                             e.needed, e.free, self.kv.pages_in_use)
                return
            self._next_key += 1
            info = self.scheduler.info(req, self._estimate) if plan is not None else None  # before forget
            self._waiting.remove(req)
            self.scheduler.forget(req)
            if self._sched_metrics is not None:
                self._sched_metrics.admitted(time.perf_counter() - req.arrival, len(self._waiting))
            if plan is not None and plan.keys:
                self._loading[key] = req
                self.loader.start(key, info, plan)
            else:
                self._seat(req, key, cached)

    def _seat(self, req: EngineRequest, key: str, cached: int):
        """Give an admitted request (its pages reserved, the first `cached` prompt tokens in them) a seat."""
        p = req.params
        seed = p.seed if p.seed is not None else int(np.random.randint(0, 2**31))
        slot = self._slots.index(None)
        run = self._slots[slot] = _PagedRun(req, TextStream(self.model.tokenizer, p, self.eos_ids), seed, key)
        run.prefilled = run.first_chunk = cached
        self._steps[slot] = 0
        self._prefilling.append(slot)
        with self._lock:
            self._n_waiting -= 1
            self._n_running += 1
        self._set_gauges()

    def _idle(self) -> bool:
        """Also idle while nothing runs and requests wait only for loads in flight (for the stages'
        room or the pages they hold): a load's events arrive through the inbox and wake the loop."""
        loading = self.loader is not None and self.loader.loading > 0
        return self._n_running == 0 and (not self._waiting or loading)

    def _has_load(self, req: EngineRequest) -> bool:
        """Shareable pages of its prompt that L1 lacks sit in L2, or may sit in L3."""
        _, l2, rest = self.kv.tier_run(req.prompt_token_ids)
        return l2 > 0 or (rest > 0 and self.kv.remote is not None)

    def _estimate(self, req: EngineRequest) -> tuple[int, int]:
        """(prompt tokens to load, to compute) for the admission policy: tokens of its shareable prefix
        in L2, and, with an L3, the rest of it (maybe there: the optimistic guess); the tail computed."""
        n = len(req.prompt_token_ids)
        if req.prompt_logprobs is not None or not req.prefix_cache:
            return 0, n
        l1, l2, rest = self.kv.tier_run(req.prompt_token_ids)
        loaded = l2 + (rest if self.kv.remote is not None else 0)
        return loaded, n - l1 - loaded

    def _apply_inbox(self, items: list[tuple[str, object]]):
        """The loading stages' events (in order: a request's pages land before it is loaded), then the
        submissions and cancels."""
        rest = []
        for item in items:
            if item[0] in ("landed", "loaded"):
                done = self.loader.apply(item)
                if done is not None:
                    if done.pages:
                        self._measured("load", done.pages * self.page_cfg.page_size, done.seconds, done.tier)
                    self._ready.append((self._loading.pop(done.key), done.key, done.cached_tokens))
            else:
                rest.append(item)
        super()._apply_inbox(rest)

    def _prefill_some(self, budget: int):
        """Prefill chunks, oldest admitted request first, while `budget` prompt tokens last.

        A chunk is min(rest of the prompt, prefill_chunk) tokens, never a leftover of the budget:
        then a prompt's chunk shapes do not depend on what else arrived with it, and the shapes the
        warm-up traffic compiled are the ones served (a new shape compiles mid-serving, for seconds).
        """
        while budget > 0 and self._prefilling:
            slot = self._prefilling[0]
            run = self._slots[slot]
            n_chunk = min(len(run.req.prompt_token_ids) - run.prefilled, self.config.prefill_chunk)
            if run.req.prompt_logprobs is not None:
                n_chunk = len(run.req.prompt_token_ids)  # scored whole: all-position logits (see _prefill_scored)
            try:
                if run.req.prompt_logprobs is not None:
                    self._prefill_scored(slot, run)
                else:
                    self._prefill_chunk(slot, run, n_chunk)
            except Exception as e:
                log.exception("prefill of %s failed", run.req.request_id)
                self._free(slot, "error", error=f"prefill failed: {e}")
            budget -= n_chunk

    def _prefill_chunk(self, slot: int, run: _PagedRun, n_chunk: int):
        """Write prompt tokens [prefilled, prefilled + n_chunk) into the request's pages."""
        ids = run.req.prompt_token_ids
        start = run.prefilled
        T = min(bucket_prompt_len(n_chunk), self.config.prefill_chunk)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n_chunk] = ids[start:start + n_chunk]
        # The whole reserved table (bucketed): every chunk of a prompt then runs one compiled program
        # instead of one per context-width bucket it passes through (an XLA compile mid-serving
        # stalls every stream for seconds); the pages past the chunk are masked.
        table = self.kv.table([run.key])
        t0 = time.perf_counter()
        logits, self.kv.kv = self.model.prefill_chunk(self.kv.kv, table, tokens, np.array([start], np.int32),
                                                      np.array([n_chunk], np.int32))
        run.prefilled += n_chunk
        self.kv.commit_pages(run.key, ids[:run.prefilled])
        if run.decoding:
            self._prefilling.popleft()
            self._prefill_done(slot, run, logits)  # blocks on the logits (the first token is sampled)
            if run.first_chunk == start:  # prefilled in one chunk: a clean compute sample
                self._measured("compute", n_chunk, time.perf_counter() - t0)

    def _prefill_scored(self, slot: int, run: _PagedRun):
        """A prompt_logprobs request is prefilled whole, as ContinuousBatcher does: its scores need
        the logits of every prompt position, which a chunk step does not return. Its KV is then
        scattered into its pages. (Scoring requests are short, lm-eval style; they do stall the
        running streams for one prefill.)"""
        ids = run.req.prompt_token_ids
        n = len(ids)
        tokens = np.zeros((1, bucket_prompt_len(n)), np.int32)
        tokens[0, :n] = ids
        logits, kv = self.model.prefill(tokens, np.array([n], np.int32), all_logits=True)
        self.kv.kv = self.model.write_prefill_pages(self.kv.kv, self.kv.table([run.key]), kv, np.array([n], np.int32))
        self.kv.commit_pages(run.key, ids)
        run.prompt_logprobs = prompt_logprob_list(logits[0], ids, run.req.prompt_logprobs)
        run.prefilled = n
        self._prefilling.remove(slot)
        self._prefill_done(slot, run, logits[:, n - 1])

    def _prefill_done(self, slot: int, run: _PagedRun, logits):
        """The whole prompt is in pages: sample the first token (or finish an echo-scoring request)."""
        req = run.req
        n = len(req.prompt_token_ids)
        if self.metrics is not None:
            self.metrics.observe_prefill(n)
        if req.prompt_only:  # scored, nothing to generate: the same single event as ContinuousBatcher's
            self._release(slot)
            if self.metrics is not None:
                self.metrics.observe_finished("length", [])
            self._send(req, StreamEvent(req.request_id, finish_reason="length", prompt_tokens=n, final_text="",
                                        logprobs=[], prompt_logprobs=run.take_prompt_logprobs()))
            self._set_gauges()
            return
        p = req.params
        first = self._pick(logits, np.array([p.temperature], np.float32), np.array([p.top_k], np.int32),
                           np.array([p.top_p], np.float32), np.array([run.seed], np.uint32), np.zeros(1, np.int32))
        self._tokens[slot] = first[0]
        self._positions[slot] = n
        if req.logprobs is not None:
            run.logprobs.extend(logprob_rows(logits, first, [req.logprobs]))
        self._emit_token(slot, int(first[0]))

    def _decode_one_step(self):
        rows = [s for s, r in enumerate(self._slots) if r is not None and r.decoding]
        B = _bucket_rows(len(rows), self.config.max_slots)
        pad = B - len(rows)
        # Width: bucket_pages of the largest reservation (prompt + max_tokens) in the batch, so the cost
        # follows the running requests' own lengths, and a request's width is fixed for its life: a
        # width that followed the live position would cross a bucket (and compile a new program, a
        # seconds-long stall of every stream) every doubling. Idle rows (None) use the null page.
        table = self.kv.table([self._slots[s].key for s in rows] + [None] * pad)
        tokens = np.pad(self._tokens[rows], (0, pad))
        positions = np.pad(self._positions[rows], (0, pad))
        logits, self.kv.kv = self.model.paged_decode_step(self.kv.kv, table, tokens, positions)
        self._steps[rows] += 1
        runs = [self._slots[s] for s in rows] + [None] * pad
        params = [r.req.params if r is not None else None for r in runs]
        temperature = np.array([p.temperature if p else 0.0 for p in params], np.float32)
        top_k = np.array([p.top_k if p else 0 for p in params], np.int32)
        top_p = np.array([p.top_p if p else 1.0 for p in params], np.float32)
        seeds = np.array([r.seed if r else 0 for r in runs], np.uint32)
        steps = np.pad(self._steps[rows], (0, pad))
        next_tok = self._pick(logits, temperature, top_k, top_p, seeds, steps)
        wanted = [i for i, r in enumerate(runs) if r is not None and r.req.logprobs is not None]
        if wanted:
            lp = logprob_rows(logits, next_tok, [runs[i].req.logprobs if i in wanted else 0 for i in range(B)])
            for i in wanted:
                runs[i].logprobs.append(lp[i])
        P = self.page_cfg.page_size
        for i, s in enumerate(rows):
            self._positions[s] += 1
            if self.prefix_namespace is not None and self._positions[s] % P == 0:  # the step filled a page
                run = runs[i]
                self.kv.commit_pages(run.key, run.req.prompt_token_ids + run.stream.ids)
            self._tokens[s] = next_tok[i]
            self._emit_token(s, int(next_tok[i]))

    def _free(self, slot: int, reason: str, delta: str = "", error: str | None = None):
        run = self._slots[slot]
        if slot in self._prefilling:
            self._prefilling.remove(slot)
        # before the last event: a client that sees the end sees the pages back; its cached pages go to L3
        self.kv.free(run.key, write_back=True)
        super()._free(slot, reason, delta, error)

    def _release(self, slot: int):
        """Give back a seat and its pages without an event (the caller sends it)."""
        self.kv.free(self._slots[slot].key)
        self._slots[slot] = None
        with self._lock:
            self._n_running -= 1

    def _cancel(self, request_id: str):
        """A loading or loaded request gives its pages back and ends at once (a load in flight ends on
        its own; what lands for it later is dropped); a waiting or seated one as ContinuousBatcher's."""
        for req, key in self._admitted_unseated():
            if req.request_id == request_id:
                self._drop_unseated(req, key)
                with self._lock:
                    self._n_waiting -= 1
                self._finish_event(req, None, "cancelled")
                self._set_gauges()
                return
        for req in self._waiting:
            if req.request_id == request_id:
                self.scheduler.forget(req)
        super()._cancel(request_id)

    def _admitted_unseated(self) -> list[tuple[EngineRequest, str]]:
        """(request, key) of the requests holding pages but no seat: loading, or loaded."""
        return [(req, key) for key, req in self._loading.items()] + [(req, key) for req, key, _ in self._ready]

    def _drop_unseated(self, req: EngineRequest, key: str):
        if key in self._loading:
            del self._loading[key]
            self.loader.cancel(key)
        else:
            self._ready = collections.deque(r for r in self._ready if r[1] != key)
        self.kv.free(key)

    def _fail_all(self, message: str):
        for req, key in self._admitted_unseated():  # back to the queue, where they fail with it
            self._drop_unseated(req, key)
            self._waiting.appendleft(req)
        for req in self._waiting:
            self.scheduler.forget(req)
        for slot, run in enumerate(self._slots):
            if run is not None:
                self.kv.free(run.key)
        self._prefilling.clear()
        super()._fail_all(message)


def _not_loaded(req: EngineRequest) -> bool:
    """A waiting request has loaded nothing yet (loads run in the loading stages, after admission)."""
    return False


__all__ = ["PagedBatcher", "KVCapacityError", "page_config", "StreamEvent"]
