"""The decode side of disaggregated serving: `ContinuousBatcher`'s interface over a SmartGen
`DecodeWorker` (`jkv serve --role decode`, and `--role all --disaggregation MODE`).

    engine = DisaggBatcher(model, decode_worker, BatcherConfig(max_slots, max_model_len), metrics)
    engine.start(); engine.submit(EngineRequest(...)); engine.cancel(request_id); engine.stop()

`server.create_app` drives it exactly like the colocated batcher. Admission is continuous: while
fewer than `max_slots` requests are in flight, a waiting request is submitted to the worker at
once (planned and handed to a prefill worker without pausing the running batch) and joins the
decode batch at the first step boundary after its hand-off; a finished one leaves at the step
boundary where it ends. Tokens stream out as they are sampled through the worker's `on_token`
hook; each request's `TextStream` turns them into deltas with the same stop rules the worker
applies, so the streamed text equals its final output.

KV owner: an `EngineRequest.kv_owner` (the router's `X-JKV-Prefill-Worker` header, a prefill
worker's transport address) makes that prefill worker own the request's KV; an address this
worker is not connected to yet is connected when the request is admitted; a dead or unknown one
falls back to round robin over the live prefill workers.

Reconnect: a `PrefillReconnector` thread (jkv/disagg/reconnect.py) reconnects the configured
prefill workers (`addresses`) whose connection was lost, with capped exponential backoff, so a
decode worker that was stopped past the transport timeout serves again without a request naming
the worker. While no prefill worker is live (and on_failure is not "recompute") `submit` refuses a
request at once with a RuntimeError the server answers 503.

Supervision (`--role all`): when a local prefill worker process dies, jkv/disagg/supervisor.py
restarts it and calls `prefill_worker_moved(old, new)`, which points the reconnector at the new
address; /health lists the local workers with their restart counts (`supervisor`).

Threads. The engine thread owns the DecodeWorker: it admits waiting requests, calls
`DecodeWorker.step` in a loop, and runs the worker's `on_token` / `on_done` callbacks.
`submit` / `cancel` come from the event loop: a submit goes through a `queue.SimpleQueue`; a
cancel of a waiting request is finished at once, a cancel of a running one ends its stream at
once and is passed to a control thread that calls `DecodeWorker.cancel` (an RPC that frees the
KV on the prefill worker, then on this side; the request leaves the decode batch at the next
step boundary). Per-request state is guarded by `self._lock`; a request's events go out in
order and nothing follows its final event (`_Run.closed`). `stop()` fails waiting requests,
cancels running ones (the engine thread retires them from the worker) and joins both threads.
"""
from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time

from ..disagg.reconnect import PrefillReconnector
from ..engine import Request
from .batcher import (BatcherConfig, ContextLengthError, ContinuousBatcher, EngineRequest, StreamEvent, push_token,
                      token_event)
from .text_stream import TextStream

log = logging.getLogger(__name__)

WARMUP_PROMPT = [1, 2, 3, 4]
CONNECT_TIMEOUT_S = 1.0  # a named prefill worker that refuses this long is skipped (round robin instead)


class _Run:
    """One request in a batch (engine-thread bookkeeping; `closed` under the batcher's lock)."""

    def __init__(self, req: EngineRequest, stream: TextStream):
        self.req = req
        self.stream = stream
        self.token_times: list[float] = []
        self.closed = False
        self.cancelled = False


def _check_pages(config: BatcherConfig, worker) -> None:
    """The decode worker's KV is the paged cache: refuse a config that asks for another layout or a
    page geometry the worker was not built with (its pages exist before the batcher)."""
    if config.kv_layout != "paged":
        raise ValueError(f"kv_layout={config.kv_layout!r}: the disaggregated decode engine keeps its KV in the "
                         "paged cache only; use kv_layout='paged'")
    have = worker.pages.cache.page_cfg
    if config.page_size != have.page_size or config.num_pages not in (None, have.num_pages):
        raise ValueError(f"page_size={config.page_size}, num_pages={config.num_pages} asked, but the decode worker "
                         f"was built with page_size={have.page_size}, num_pages={have.num_pages}; build it with "
                         "DecodeWorker(page_config=jkv.serving.paged_batcher.page_config(config))")


class DisaggBatcher:
    """A SmartGen DecodeWorker behind ContinuousBatcher's submit/cancel/events interface."""

    check_request = ContinuousBatcher.check_request
    supervisor = None  # jkv.disagg.supervisor.PrefillSupervisor of local prefill workers (--role all), for /health

    def __init__(self, model, worker, config: BatcherConfig = BatcherConfig(), metrics=None,
                 addresses: list[str] = (), owners: list[str] = (), prefill_cache_stats=None):
        """prefill_cache_stats: the local prefill workers' own prefix caches for /metrics
        (`jkv.disagg.cluster.PrefillCacheStats`; --role all --disaggregation)."""
        ctx = model.cfg.max_position_embeddings
        if config.max_model_len > ctx:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {ctx}; "
                             f"use --max-model-len <= {ctx}")
        _check_pages(config, worker)
        self.model, self.worker, self.config, self.metrics = model, worker, config, metrics
        self.eos_ids = tuple(model.cfg.eos_token_ids)
        self._owner_by_main = {a.partition("|")[0]: o for a, o in zip(addresses, owners)}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._running: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._n_waiting = 0
        self._dead: str | None = None  # why the engine thread died; submit refuses from then on
        self._cancelled_waiting: set[str] = set()
        if metrics is not None and metrics.kv is not None:
            metrics.kv.watch_pool(worker.pool)  # host staging
            metrics.kv.watch_steps(worker.phases, worker.pages.h2d_bytes)  # host->device bytes of each step
        if metrics is not None:
            metrics.watch_kv_cache(worker.pages.cache)  # device pages: jkv_kv_pages_in_use / _free
        if metrics is not None and worker.pages.cache.prefix_caching:  # hits: prompt rows that did not cross
            metrics.watch_prefix_cache(worker.pages.cache.stats, prefill_cache_stats)
        if metrics is not None and metrics.transfers is not None:  # fetch RPCs, notifications (transport threads)
            worker.endpoint.observe_transfers(metrics.transfers.observe_transfer)
        self._reconnect = PrefillReconnector(addresses, dict(zip(addresses, owners)),
                                             connect=self._connect_worker, alive=worker.owner_alive)

    # ------------------------------------------------------------ any thread
    def submit(self, req: EngineRequest):
        self.check_request(len(req.prompt_token_ids), req.params.max_tokens)
        if self._stop.is_set():
            raise RuntimeError("the engine is shutting down; no new requests are accepted")
        self._check_live_owner()
        with self._lock:  # with _crash's drain: a request is either failed by it or refused here
            if self._dead is not None:
                raise RuntimeError(self._dead)
            self._n_waiting += 1
            self._inbox.put(req)
        self._set_gauges()

    def cancel(self, request_id: str):
        """Cancel a waiting or running request (thread-safe); its KV is freed on both roles."""
        with self._lock:
            run = self._running.get(request_id)
            if run is None:  # waiting (or unknown): dropped when it would be admitted
                self._cancelled_waiting.add(request_id)
                return
            run.cancelled = True
        self._finish(run, "cancelled")
        self._cancels.put(request_id)

    def _check_live_owner(self):
        """Fail fast (the server answers 503) while no prefill worker can take the request."""
        if self.worker.on_failure == "recompute" or any(self.worker.owner_alive(o) for o in self.worker.owners):
            return
        configured = self._reconnect.addresses  # none is live, so the reconnector retries them all
        raise RuntimeError("no live prefill worker is connected" + (
            f"; reconnecting to {', '.join(configured)} with backoff, retry shortly" if configured else
            "; start `jkv prefill-worker` processes"))

    def prefill_worker_moved(self, old: str, new: str) -> None:
        """A local prefill worker was restarted at a new address (the supervisor's `on_restart`):
        forget the old one and reconnect to the new one at once. Any thread."""
        self._owner_by_main.pop(old.partition("|")[0], None)
        self._reconnect.readdress(old, new)

    def _connect_worker(self, address: str, timeout: float) -> str:
        name = self.worker.connect_one(address, connect_timeout=timeout)
        self._owner_by_main[address.partition("|")[0]] = name
        return name

    @property
    def num_waiting(self) -> int:
        return self._n_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    def start(self):
        if self._threads:
            raise RuntimeError("the engine is already started")
        self._threads = [threading.Thread(target=self._loop, name="jkv-decode-engine", daemon=True),
                         threading.Thread(target=self._cancel_loop, name="jkv-decode-cancel", daemon=True)]
        for t in self._threads:
            t.start()
        self._reconnect.start()

    def stop(self, timeout: float = 30.0):
        self._stop.set()
        self._reconnect.close()
        self._inbox.put(None)
        with self._lock:
            running = list(self._running)
        for rid in running:
            self.cancel(rid)
        self._cancels.put(None)
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.error("%s did not stop within %.0fs", t.name, timeout)
        self._threads = []

    def warmup(self):
        """One short request through prefill, hand-off and decode (compiles both sides)."""
        from ..sampling import SamplingParams

        t = time.perf_counter()
        out = self.worker.generate([Request("warmup", WARMUP_PROMPT, WARMUP_PROMPT,
                                            SamplingParams(max_tokens=3, ignore_eos=True))])
        if out[0].finish_reason == "error":
            raise RuntimeError(f"warm-up request failed: {out[0].metrics.extra.get('error')}")
        log.debug("disaggregated warm-up in %.1fs", time.perf_counter() - t)

    def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not) for /ready and /health: serving needs at least one live prefill worker."""
        if not self._threads or not all(t.is_alive() for t in self._threads):
            return False, "the decode engine is not running (stopped or crashed; see the server log)"
        peers = self.worker.endpoint.peers
        if not any(o in peers and peers[o].alive for o in self.worker.owners):
            return False, (f"no live prefill worker is connected (known: {', '.join(self.worker.owners) or 'none'}); "
                           "requests would fail until one is back")
        return True, None

    def health(self) -> dict:
        """Extra /health fields: the prefill workers this decode worker knows, the KV it holds and
        the configuration every connected prefill worker agreed to in the handshake."""
        peers = self.worker.endpoint.peers
        agreed = [o for o in self.worker.owners if o in peers and peers[o].alive]
        return {"mode": self.worker.transfer.mode,
                "handshake": {"config": self.worker.config.as_dict(), "agreed_with": agreed}, "kv_host_bytes_in_use": self.worker.pool.bytes_in_use,
                "kv_host_requests": len(self.worker.pool.live()),
                "kv_pages_in_use": self.worker.pages.cache.pages_in_use,
                "prefill_workers": [{"name": o, "alive": o in peers and peers[o].alive,
                                     "address": next((a for a, n in self._owner_by_main.items() if n == o), None)}
                                    for o in self.worker.owners],
                **({} if self.supervisor is None else {"local_prefill_workers": self.supervisor.status()})}

    # ------------------------------------------------------------ engine thread
    def _set_gauges(self):
        if self.metrics is not None:
            running = len(self._running)
            self.metrics.set_engine_state(waiting=self._n_waiting, running=running, slots=self.config.max_slots)

    def _loop(self):
        try:
            self._serve()
        except Exception as e:  # the engine is dead: fail every open request loudly rather than hang clients
            log.exception("decode engine thread crashed")
            self._crash(f"engine error: {e}")
            raise

    def _crash(self, message: str):
        """Refuse new requests, fail waiting and running ones, and release what the worker holds."""
        with self._lock:
            self._dead = f"{message} (the decode engine thread has stopped; restart the server)"
            running = list(self._running.values())
        self._fail_waiting(message)
        for run in running:
            self._on_done(run, None, error=message)
            try:  # frees its KV on both roles; the worker may be what broke, so this is best effort
                self.worker.cancel(run.req.request_id)
            except Exception:  # noqa: BLE001 - already failing; the first error is the one logged
                log.exception("releasing request %s after the crash failed", run.req.request_id)

    def _serve(self):
        while not self._stop.is_set():
            busy = bool(self._waiting or self.worker.num_active)
            try:
                item = self._inbox.get_nowait() if busy else self._inbox.get(timeout=0.5)
            except queue.Empty:
                item = None
            while item is not None:
                self._waiting.append(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            self._admit()
            if self.worker.num_active:
                self.worker.step()
        self._fail_waiting("the server is shutting down")
        self._retire_worker()

    def _admit(self):
        """Waiting requests go to the worker while fewer than max_slots are in flight."""
        admitted = 0
        while self._waiting and len(self._running) < self.config.max_slots:
            req = self._waiting.popleft()
            with self._lock:
                self._n_waiting -= 1
                cancelled = req.request_id in self._cancelled_waiting
                self._cancelled_waiting.discard(req.request_id)
                run = _Run(req, TextStream(self.model.tokenizer, req.params, self.eos_ids))
                if not cancelled:
                    self._running[req.request_id] = run
            if cancelled:
                self._finish(run, "cancelled")
                continue
            if self.metrics is not None:
                self.metrics.observe_prefill(len(req.prompt_token_ids))
            try:
                self.worker.submit(Request(req.request_id, req.prompt_token_ids, req.prompt_token_ids, req.params),
                                   on_token=lambda _rid, token, run=run: self._on_token(run, token),
                                   on_done=functools.partial(self._on_done, run), owner=self._owner(req.kv_owner))
            except Exception as e:  # noqa: BLE001 - the request fails alone, with the reason
                log.exception("submitting request %s to the decode worker failed", req.request_id)
                self._on_done(run, None, error=f"engine error: {e}")
                continue
            admitted += 1
        if admitted and self.metrics is not None and self.metrics.kv is not None:
            self.metrics.kv.batches.inc()
        self._set_gauges()

    def _retire_worker(self, max_steps: int = 1000):
        """Shutdown: cancel what the worker still holds and step until it has retired it all."""
        with self._lock:
            running = list(self._running)
        for rid in running:
            self.worker.cancel(rid)
        for _ in range(max_steps):
            if not self.worker.num_active:
                return
            self.worker.step()
        log.error("the decode worker still holds %d requests at shutdown", self.worker.num_active)

    def _owner(self, address: str | None) -> str | None:
        """The prefill worker named by a transport address; connects to a new or restarted one."""
        if not address:
            return None
        main = address.partition("|")[0]
        name = self._owner_by_main.get(main)
        if name is not None and self.worker.owner_alive(name):
            return name
        with self._reconnect.connecting(blocking=False) as ok:
            if not ok:  # the reconnect thread is connecting right now: never stall the engine thread on it
                log.info("prefill worker %s is being reconnected; using another one for this request", address)
                return None
            try:
                name = self.worker.connect_one(address, connect_timeout=CONNECT_TIMEOUT_S)
            except Exception as e:  # a dead address: round robin over the live workers instead
                log.warning("cannot connect to prefill worker %s (%s); using another one", address, e)
                return None
        self._owner_by_main[main] = name
        log.info("decode: connected to prefill worker %s at %s", name, address)
        return name

    def _on_done(self, run: _Run, out, error: str | None = None):
        """The worker's `on_done` (engine thread): a request left the decode batch."""
        with self._lock:
            self._running.pop(run.req.request_id, None)
            self._cancelled_waiting.discard(run.req.request_id)
        kv = self.metrics.kv if self.metrics is not None else None
        if kv is not None and out is not None:
            kv.observe_output(out.metrics.extra)
        if self.metrics is not None and self.metrics.transfers is not None and out is not None \
                and out.finish_reason != "error":
            self.metrics.transfers.observe_request(out.metrics.extra)
        if out is None or out.finish_reason == "error":
            if not run.cancelled:
                if kv is not None:
                    kv.failed()
                self._finish(run, "error", error=error or out.metrics.extra.get("error") or "decode failed")
        elif not run.closed:  # the worker stopped it where the stream did not (should not happen)
            self._finish(run, out.finish_reason, final_text=out.text)
        self._set_gauges()

    def _on_token(self, run: _Run, token_id: int):
        if run.closed:
            if run.cancelled:  # cancelled before the worker planned it: stop it here, on its own thread
                self.worker.cancel(run.req.request_id)
            return
        delta = push_token(run, token_id, self.metrics)
        if run.stream.finish_reason is not None:
            self._finish(run, run.stream.finish_reason, delta)
        else:
            self._send(run, token_event(run, token_id, delta), final=False)

    def _finish(self, run: _Run, reason: str, delta: str = "", error: str | None = None,
                final_text: str | None = None):
        stream = run.stream
        done = stream.finish_reason is not None
        ids = stream.output_ids
        last = stream.ids[-1:] if done and len(ids) == len(stream.ids) else []
        event = StreamEvent(run.req.request_id, text=delta, token_ids=last, finish_reason=reason,
                            prompt_tokens=len(run.req.prompt_token_ids), completion_tokens=len(ids), error=error,
                            final_text=stream.text if done else final_text)
        if self._send(run, event, final=True) and self.metrics is not None:
            self.metrics.observe_finished(reason, run.token_times)

    def _send(self, run: _Run, event: StreamEvent, final: bool) -> bool:
        with self._lock:
            if run.closed:
                return False
            run.closed = final
        try:
            run.req.emit(event)
        except Exception:
            log.exception("emit for request %s failed; dropping the event", run.req.request_id)
        return True

    def _fail_waiting(self, message: str):
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._waiting.append(item)
        while self._waiting:
            req = self._waiting.popleft()
            with self._lock:
                self._n_waiting -= 1
            self._finish(_Run(req, TextStream(self.model.tokenizer, req.params, self.eos_ids)), "error",
                         error=message)
        self._set_gauges()

    # ------------------------------------------------------------ control thread
    def _cancel_loop(self):
        while True:
            rid = self._cancels.get()
            if rid is None:
                return
            try:
                self.worker.cancel(rid)
            except Exception:
                log.exception("cancelling request %s on the decode worker failed", rid)


__all__ = ["DisaggBatcher", "ContextLengthError"]
