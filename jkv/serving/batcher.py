"""Continuous-batching engine: fixed decode slots, per-request prefill + insert, one decode batch.

Interface (JetStream-style): `submit(request)` → the engine thread runs `prefill` (a batch of
its own), `insert`s the request's KV into a free slot of the on-device decode cache, and from
the next step on the request is one row of the running `decode_step`. `cancel(request_id)`
frees its slot. Results leave through the request's `emit(event)` callback.

Device state (owned by the engine thread only):
    cache:     tuple over layers of (K, V), each [B_slots, H_kv, N_max, D]
    tokens:    i32[B_slots]  the token each slot feeds to the next decode step
    positions: i32[B_slots]  the cache index that token is written to (= tokens already cached)
Idle slots decode a dummy token at position 0; their rows are never read, and `insert`
overwrites the slot's cache (positions < prompt length) before reuse. Decode attends only to
indices <= positions[b], so stale entries beyond a new request's prompt are never seen.

Concurrency. Exactly one thread (the engine thread, started by `start()`) touches the model
and the device. Other threads — the HTTP server's event loop, tests — only call `submit()`
and `cancel()`, which put items on a thread-safe `queue.SimpleQueue`; the engine thread drains
it between decode steps. Each request carries `emit`, called on the engine thread with every
`StreamEvent`; the server passes `AsyncSink(loop, asyncio_queue).emit`, which hands the event
to the event loop with `loop.call_soon_threadsafe`, so per-request queues are only touched
by their loop. `stop()` asks the loop to finish, fails requests still queued or running with
an error event, and joins the thread. Order per iteration: drain inbox (new requests,
cancellations) → admit waiting requests into free slots (prefill + insert + first token) →
one decode step for all running slots → emit deltas, free finished slots.

Log-probabilities (`EngineRequest.logprobs` / `prompt_logprobs`) are of the model's own
distribution, log_softmax of the raw logits, before temperature, top-k and top-p. They are
computed on the engine thread only for steps where some running request asked for them.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models import Model

from ..engine import bucket_cache_len, bucket_prompt_len
from ..sampling import SamplingParams, sample_or_argmax, sample_tokens
from .text_stream import TextStream

log = logging.getLogger(__name__)


KV_LAYOUTS = ("paged", "slots")


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    """max_slots: requests in flight at once (the decode batch size B_slots); max_model_len: prompt +
    generated tokens per request. kv_layout picks the engine (`create_batcher`): "paged" = the paged
    KV cache with chunked prefill (`paged_batcher.PagedBatcher`), "slots" = one N_max cache per slot
    (`ContinuousBatcher`, kept for comparison). Paged only: page_size tokens per page; num_pages in
    the pool including the null page (None: enough for max_slots requests of max_model_len tokens);
    prefill_chunk prompt tokens prefilled per engine iteration between decode steps;
    enable_prefix_caching: share cached full pages of equal leading tokens between requests and
    skip their prefill (the slot layout ignores it); prefix_cache_host_bytes: with prefix caching,
    keep evicted cached pages in a host-memory LRU of this many bytes and load them back on a hit
    (0: no host tier); prefix_cache_l3: with prefix caching, URL of a remote pool (redis://host:port
    or jkvpool://ADDRESS) that evicted pages are written to and missing ones read from, every
    operation bounded by prefix_cache_l3_timeout seconds (None: no remote tier). Paged only:
    schedule orders admission of waiting requests (jkv/serving/admission.py: fifo, sjf, srpt, edf,
    lstf) by the cost model in the cost_model file (None: probed from the engine at start)."""

    max_slots: int = 8
    max_model_len: int = 1024
    kv_layout: str = "paged"
    page_size: int = 16
    num_pages: int | None = None
    prefill_chunk: int = 512
    enable_prefix_caching: bool = True
    prefix_cache_host_bytes: int = 0
    prefix_cache_l3: str | None = None
    prefix_cache_l3_timeout: float = 0.5
    schedule: str = "srpt"
    cost_model: str | None = None

    def __post_init__(self):
        from .admission import check_schedule

        check_schedule(self.schedule)
        if not self.prefix_cache_l3_timeout > 0:
            raise ValueError(f"prefix_cache_l3_timeout={self.prefix_cache_l3_timeout} must be > 0 seconds")
        if self.prefix_cache_l3 is not None:
            from ..kvcache.remote_tier import SCHEMES

            if not self.prefix_cache_l3.startswith(SCHEMES):
                raise ValueError(f"prefix_cache_l3={self.prefix_cache_l3!r} must start with one of "
                                 f"{', '.join(SCHEMES)} (e.g. redis://127.0.0.1:6379/0)")
        if self.prefix_cache_host_bytes < 0:
            raise ValueError(f"prefix_cache_host_bytes={self.prefix_cache_host_bytes} must be >= 0 (0: no host tier)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        if self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r} must be one of {KV_LAYOUTS}")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1 (tokens per KV page; 16 is usual)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is the reserved null page)")
        if self.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 16 prompt tokens")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely alternatives at its position,
    as ((token_id, logprob), ...) best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class StreamEvent:
    """One update for a request. `finish_reason` is set on the last event ("stop", "length",
    "cancelled" or "error" — then `error` says why). `logprobs` (when the request asked for them)
    is aligned with `token_ids`; `prompt_logprobs` comes once, on the request's first event, one
    entry per prompt token (None for the first, which has no context)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    final_text: str | None = None  # the whole output on the last event
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class EngineRequest:
    """logprobs / prompt_logprobs: None (not wanted) or the number of top alternatives to return
    with each generated / prompt token's log-probability. prompt_only: score the prompt and
    generate nothing (OpenAI's echo with max_tokens 0); params.max_tokens is then unused.
    prefix_cache: the request may start from cached prefix pages (paged engine with prefix caching);
    False computes its whole prompt (it still offers its pages to the cache). slo_ms: its
    time-to-first-token target, for the paged engine's edf / lstf admission (None: none)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[StreamEvent], None]
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    kv_owner: str | None = None  # disaggregated: transport address of the prefill worker to own the KV
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_only: bool = False
    prefix_cache: bool = True
    slo_ms: float | None = None


class ContextLengthError(ValueError):
    """The prompt plus max_tokens does not fit max_model_len."""


@functools.partial(jax.jit, donate_argnums=(0,))
def insert_kv(cache, kv, slot):
    """JetStream `insert`: write one request's prefill KV into decode slot `slot`.

    cache: tuple over layers of (K, V) [B_slots, H_kv, N_max, D]; kv: same with [1, H_kv, T, D],
    T <= N_max; slot: i32[] . Returns the updated cache (the input cache is donated).
    """
    zero = jnp.zeros((), jnp.int32)
    return tuple((jax.lax.dynamic_update_slice(K, k.astype(K.dtype), (slot, zero, zero, zero)),
                  jax.lax.dynamic_update_slice(V, v.astype(V.dtype), (slot, zero, zero, zero)))
                 for (K, V), (k, v) in zip(cache, kv))


LOGPROB_TOP_BUCKETS = (1, 5, 20)  # top-N is computed at the next bucket, so few programs compile


@functools.partial(jax.jit, static_argnames=("top",))
def token_logprobs(logits, chosen, top: int):
    """logits: f32[R, V]; chosen: i32[R] -> (chosen_logprob f32[R], top_logprob f32[R, top],
    top_id i32[R, top]) of log_softmax(logits): the model's distribution before temperature/top-p."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen_lp = jnp.take_along_axis(lp, chosen[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_id = jax.lax.top_k(lp, top)
    return chosen_lp, top_lp, top_id.astype(jnp.int32)


def logprob_rows(logits, chosen, top_n: list[int]) -> list[TokenLogprob]:
    """TokenLogprob per row of logits f32[R, V] for the tokens chosen i32[R], with top_n[r] alternatives."""
    want = max(top_n)
    bucket = next((b for b in LOGPROB_TOP_BUCKETS if b >= want), want)
    chosen_lp, top_lp, top_id = (np.asarray(x) for x in token_logprobs(logits, jnp.asarray(chosen, jnp.int32),
                                                                       bucket))
    return [TokenLogprob(int(chosen[r]), float(chosen_lp[r]),
                         tuple((int(top_id[r, j]), float(top_lp[r, j])) for j in range(top_n[r])))
            for r in range(len(top_n))]


def prompt_logprob_list(logits, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Prompt token log-probs from all-position prefill logits f32[T, V] (T >= len(ids)):
    token i is scored by the logits at position i - 1; the first token has none."""
    n = len(ids)
    if n == 1:
        return [None]
    chosen = np.zeros(logits.shape[0], np.int32)  # the whole bucketed row set, so shapes stay bucketed
    chosen[:n - 1] = ids[1:]
    return [None] + logprob_rows(logits, chosen, [top] * (n - 1))


class _Running:
    """Engine-thread bookkeeping for one admitted request."""

    def __init__(self, req: EngineRequest, stream: TextStream, seed: int):
        self.req = req
        self.stream = stream
        self.seed = seed
        self.token_times: list[float] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # sent with the first event

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out


def push_token(run, token_id: int, metrics) -> str:
    """One generated token of `run` (a running request: .req, .stream, .token_times): its time since
    arrival (and the TTFT / TTST / TBT histograms of `metrics`, if any), then its text delta from
    run.stream, whose finish_reason says whether it ended the request. Engine thread only."""
    run.token_times.append(time.perf_counter() - run.req.arrival)
    if metrics is not None:
        metrics.observe_token(run.token_times)
    return run.stream.push(token_id)


def token_event(run, token_id: int, delta: str, **extra) -> StreamEvent:
    """The StreamEvent carrying one token of a request that goes on (extra: its logprobs fields)."""
    return StreamEvent(run.req.request_id, text=delta, token_ids=[token_id],
                       prompt_tokens=len(run.req.prompt_token_ids), completion_tokens=len(run.stream.ids), **extra)


class ContinuousBatcher:
    """A model, B_slots decode slots and the engine thread that runs them."""

    supports_logprobs = True  # EngineRequest.logprobs / prompt_logprobs / prompt_only

    def __init__(self, model: Model, config: BatcherConfig = BatcherConfig(), metrics=None):
        ctx = model.cfg.max_position_embeddings
        if config.max_model_len > ctx:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {ctx}; "
                             f"use --max-model-len <= {ctx}")
        self.model = model
        self.config = config
        self.metrics = metrics
        self.n_max = bucket_cache_len(config.max_model_len)
        self.eos_ids = tuple(model.cfg.eos_token_ids)
        B = config.max_slots
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._slots: list[_Running | None] = [None] * B
        self._tokens = np.zeros(B, np.int32)
        self._positions = np.zeros(B, np.int32)
        self._steps = np.zeros(B, np.int32)
        self._cache = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the counters read by other threads
        self._n_waiting = 0
        self._n_running = 0
        self._dead: str | None = None  # why the engine thread died; submit refuses from then on

    # ------------------------------------------------------------ any thread
    def check_request(self, prompt_len: int, max_tokens: int):
        """Raises ContextLengthError naming both lengths when the request cannot fit."""
        if prompt_len == 0:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        limit = self.config.max_model_len
        if prompt_len + max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion "
                f"(max_tokens)). Shorten the prompt or lower max_tokens.")

    def submit(self, req: EngineRequest):
        """Queue a request (thread-safe). Raises ContextLengthError if it cannot fit."""
        self.check_request(len(req.prompt_token_ids), req.params.max_tokens)
        if self._stop.is_set():
            raise RuntimeError("the engine is shutting down; no new requests are accepted")
        with self._lock:  # with the crash handler's drain: a request is either failed by it or refused here
            if self._dead is not None:
                raise RuntimeError(self._dead)
            self._n_waiting += 1
            self._inbox.put(("submit", req))  # the engine thread publishes the gauges (one writer, no stale values)

    def cancel(self, request_id: str):
        """Cancel a waiting or running request (thread-safe); its slot is freed before the next step."""
        self._inbox.put(("cancel", request_id))

    @property
    def num_waiting(self) -> int:
        return self._n_waiting

    @property
    def num_running(self) -> int:
        return self._n_running

    def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not) for /ready: the engine thread must be running."""
        if self._thread is None or not self._thread.is_alive():
            return False, "the engine thread is not running (stopped or crashed; see the server log)"
        return True, None

    def start(self):
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._cache = self.model.init_cache(self.config.max_slots, self.n_max)
        self._thread = threading.Thread(target=self._loop, name="jkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0):
        """Stop the engine thread; requests still queued or running end with an error event."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine thread did not stop within %.0fs", timeout)
            self._thread = None

    def warmup(self):
        """Compile prefill (shortest bucket), insert, decode and the sampler before serving."""
        m = self.model
        logits, kv = m.prefill(np.zeros((1, bucket_prompt_len(1)), np.int32), np.ones(1, np.int32))
        cache = m.init_cache(self.config.max_slots, self.n_max)
        cache = insert_kv(cache, tuple(kv), jnp.int32(0))
        B = self.config.max_slots
        z = np.zeros(B, np.int32)
        logits, cache = m.decode_step(cache, z, z)
        sample_tokens(logits, np.ones(B, np.float32), z, np.ones(B, np.float32), z.astype(np.uint32), z)
        jax.block_until_ready(logits)

    # ------------------------------------------------------- engine thread
    def _set_gauges(self):
        if self.metrics is not None:
            self.metrics.set_engine_state(waiting=self._n_waiting, running=self._n_running,
                                          slots=self.config.max_slots)

    def _loop(self):
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=self._idle())
                self._step()
        except Exception as e:  # the engine is dead: fail everything loudly rather than hang clients
            log.exception("engine thread crashed")
            message = self._crash_message(e)
            with self._lock:
                self._dead = f"{message} (the engine thread has stopped; restart the server)"
            self._fail_all(message)
            raise
        self._fail_all("the server is shutting down")

    def _idle(self) -> bool:
        """Nothing to step until the inbox brings something: the loop may wait on it."""
        return self._n_running == 0 and not self._waiting

    def _crash_message(self, e: Exception) -> str:
        """The error every open request gets when the engine thread dies of `e`."""
        return f"engine error: {e}"

    def _step(self):
        """One engine iteration after the inbox is drained: admit, then one decode step."""
        self._admit()
        if self._n_running:
            self._decode_one_step()

    def _drain_inbox(self, block: bool):
        items = self._take_inbox(block)
        if items:
            self._apply_inbox(items)

    def _take_inbox(self, block: bool) -> list[tuple[str, object]]:
        """Everything queued now; when `block` (idle), wait up to 0.5 s for the first item."""
        items = []
        try:
            items.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            return items

    def _apply_inbox(self, items: list[tuple[str, object]]):
        """Queue the submitted requests and apply the cancellations, in arrival order."""
        for kind, payload in items:
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "cancel":
                self._cancel(payload)
        self._set_gauges()

    def _cancel(self, request_id: str):
        for req in list(self._waiting):
            if req.request_id == request_id:
                self._waiting.remove(req)
                with self._lock:
                    self._n_waiting -= 1
                self._finish_event(req, None, "cancelled")
                self._set_gauges()
                return
        for s, run in enumerate(self._slots):
            if run is not None and run.req.request_id == request_id:
                self._free(s, "cancelled")
                return

    def _admit(self):
        while self._waiting and None in self._slots:
            req = self._waiting.popleft()
            with self._lock:
                self._n_waiting -= 1
            slot = self._slots.index(None)
            try:
                self._prefill_insert(req, slot)
            except Exception as e:
                log.exception("prefill of %s failed", req.request_id)
                self._finish_event(req, None, "error", error=f"prefill failed: {e}")
            self._set_gauges()

    def _prefill_insert(self, req: EngineRequest, slot: int):
        m = self.model
        n = len(req.prompt_token_ids)
        T = bucket_prompt_len(n)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = req.prompt_token_ids
        scored = req.prompt_logprobs is not None
        logits, kv = m.prefill(tokens, np.array([n], np.int32), all_logits=scored)
        prompt_lp = None
        if scored:
            prompt_lp = prompt_logprob_list(logits[0], req.prompt_token_ids, req.prompt_logprobs)
            logits = logits[:, n - 1]
        if self.metrics is not None:
            self.metrics.observe_prefill(n)
        if req.prompt_only:  # scored, nothing to generate: the request never takes the slot
            if self.metrics is not None:
                self.metrics.observe_finished("length", [])
            self._send(req, StreamEvent(req.request_id, finish_reason="length", prompt_tokens=n, final_text="",
                                        logprobs=[], prompt_logprobs=prompt_lp))
            return
        if T > self.n_max:  # only padding lies beyond n_max (n <= max_model_len <= n_max)
            kv = [(K[:, :, :self.n_max], V[:, :, :self.n_max]) for K, V in kv]
        self._cache = insert_kv(self._cache, tuple(kv), jnp.int32(slot))
        p = req.params
        seed = p.seed if p.seed is not None else int(np.random.randint(0, 2**31))
        run = _Running(req, TextStream(m.tokenizer, p, self.eos_ids), seed)
        run.prompt_logprobs = prompt_lp
        first = self._pick(logits, np.array([p.temperature], np.float32), np.array([p.top_k], np.int32),
                           np.array([p.top_p], np.float32), np.array([seed], np.uint32), np.zeros(1, np.int32))
        self._slots[slot] = run
        with self._lock:
            self._n_running += 1
        self._tokens[slot] = first[0]
        self._positions[slot] = n
        self._steps[slot] = 0
        if req.logprobs is not None:
            run.logprobs.extend(logprob_rows(logits, first, [req.logprobs]))
        self._emit_token(slot, int(first[0]))

    @staticmethod
    def _pick(logits, temperature, top_k, top_p, seeds, steps) -> np.ndarray:
        return sample_or_argmax(logits, temperature, top_k, top_p, seeds, steps)

    def _decode_one_step(self):
        logits, self._cache = self.model.decode_step(self._cache, self._tokens, self._positions)
        active = [s for s, r in enumerate(self._slots) if r is not None]
        self._steps[active] += 1
        params = [r.req.params if r is not None else None for r in self._slots]
        temperature = np.array([p.temperature if p else 0.0 for p in params], np.float32)
        top_k = np.array([p.top_k if p else 0 for p in params], np.int32)
        top_p = np.array([p.top_p if p else 1.0 for p in params], np.float32)
        seeds = np.array([r.seed if r else 0 for r in self._slots], np.uint32)
        next_tok = self._pick(logits, temperature, top_k, top_p, seeds, self._steps)
        wanted = [s for s in active if self._slots[s].req.logprobs is not None]
        if wanted:
            rows = logprob_rows(logits, next_tok, [self._slots[s].req.logprobs or 0 if s in wanted else 0
                                                   for s in range(len(self._slots))])
            for s in wanted:
                self._slots[s].logprobs.append(rows[s])
        for s in active:
            self._positions[s] += 1
            self._tokens[s] = next_tok[s]
            self._emit_token(s, int(next_tok[s]))

    def _emit_token(self, slot: int, token_id: int):
        run = self._slots[slot]
        delta = push_token(run, token_id, self.metrics)
        if run.stream.finish_reason is not None:
            self._free(slot, run.stream.finish_reason, delta)
        else:
            self._send(run.req, token_event(run, token_id, delta,
                                            logprobs=run.logprobs[-1:] if run.req.logprobs is not None else None,
                                            prompt_logprobs=run.take_prompt_logprobs()))

    @staticmethod
    def _send(req: EngineRequest, event: StreamEvent):
        try:
            req.emit(event)
        except Exception:  # a broken consumer must not take the engine down with it
            log.exception("emit for request %s failed; dropping the event", req.request_id)

    def _free(self, slot: int, reason: str, delta: str = "", error: str | None = None):
        run = self._slots[slot]
        self._slots[slot] = None
        self._tokens[slot] = 0
        self._positions[slot] = 0
        with self._lock:
            self._n_running -= 1
        self._finish_event(run.req, run, reason, delta=delta, error=error)
        self._set_gauges()

    def _finish_event(self, req: EngineRequest, run: _Running | None, reason: str, delta: str = "",
                      error: str | None = None):
        stream = run.stream if run is not None else None
        ids = stream.output_ids if stream is not None else []
        # The last event carries the final token unless it was a stop/EOS id (never shown).
        last_id = stream.ids[-1:] if stream is not None and stream.finish_reason and len(ids) == len(stream.ids) else []
        if self.metrics is not None:
            self.metrics.observe_finished(reason, run.token_times if run is not None else [])
        logprobs = None
        if run is not None and req.logprobs is not None:
            logprobs = run.logprobs[-1:] if last_id else []
        self._send(req, StreamEvent(req.request_id, text=delta, token_ids=last_id, finish_reason=reason,
                             prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(ids), error=error,
                             final_text=stream.text if stream is not None and stream.finish_reason else None,
                             logprobs=logprobs, prompt_logprobs=run.take_prompt_logprobs() if run else None))

    def _fail_all(self, message: str):
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._waiting.append(payload)
        while self._waiting:
            req = self._waiting.popleft()
            with self._lock:
                self._n_waiting -= 1
            self._finish_event(req, None, "error", error=message)
        for s, run in enumerate(self._slots):
            if run is not None:
                self._slots[s] = None
                with self._lock:
                    self._n_running -= 1
                self._finish_event(run.req, run, "error", error=message)
        self._set_gauges()


def create_batcher(model: Model, config: BatcherConfig = BatcherConfig(), metrics=None):
    """The engine `config.kv_layout` names: `PagedBatcher` ("paged": paged KV cache, chunked
    prefill) or `ContinuousBatcher` ("slots": one N_max cache per slot)."""
    if config.kv_layout == "slots":
        return ContinuousBatcher(model, config, metrics)
    from .paged_batcher import PagedBatcher

    return PagedBatcher(model, config, metrics)
