"""`jkv serve --role prefill`: a SmartGen prefill worker plus a small HTTP app (/health, /metrics).

    worker = ServingPrefillWorker(model, selector, "prefill-a", secret=..., metrics=PrefillMetrics())
    address = worker.listen()            # "main|bulk": decode servers connect here
    app = create_prefill_app(worker, metrics, info)

The worker is `jkv.disagg.prefill_worker.PrefillWorker` (SmartGen §4.1 proactive, §4.2
on-demand, §4.3 speculative transfer) with accounting hooks for serving: requests queued and
held (in-flight tokens for the router), KV bytes pushed per path (counted when a request is
freed, from the worker's own per-request counts), why each request was freed (the decode
worker's "free", an expired lease / vanished decode peer, a failed prefill, shutdown), and
transport failures (a notification that could not be sent, a fetch that raised).

Threads: `PrefillWorker.run` on the "jkv-prefill-main" thread (prefill batches); the transport's
RPC and notify threads run fetch / free / spec and enqueue "prefill" jobs (`on_prefill_queued`); the
worker's lease thread; uvicorn's event loop serves HTTP and only reads counters guarded by
`self._acct` (prometheus metrics are thread-safe). `close()` stops the worker (frees everything).
"""
from __future__ import annotations

import threading

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from jkv.disagg.prefill_worker import PrefillWorker

from . import protocol as P
from .metrics import PrefillMetrics
from .server import base_app


class ServingPrefillWorker(PrefillWorker):
    """A PrefillWorker that counts through the worker's observer hooks (`on_*`)."""

    def __init__(self, *args, metrics: PrefillMetrics, **kw):
        self.metrics = metrics
        self._acct = threading.Lock()
        self._queued_requests = 0
        self._queued_tokens = 0
        self._by_decode: set[str] = set()  # rids the decode worker asked us to free
        self._failed: set[str] = set()
        super().__init__(*args, **kw)
        metrics.kv.watch_pool(self.pool)
        for endpoint in (self.endpoint, self.bulk):  # on-demand replies; pushes, metadata, hand-offs
            endpoint.observe_transfers(metrics.transfers.observe_transfer)
        metrics.inflight_tokens.set_function(lambda: self.inflight()[1])
        metrics.inflight_requests.set_function(lambda: self.inflight()[0])
        if self.prefix_cache is not None:
            metrics.watch_prefix_cache(self.prefix_cache.stats)

    def inflight(self) -> tuple[int, int]:
        """(requests, prompt tokens) queued or holding KV here."""
        held_requests, held_tokens = self.held_load()
        with self._acct:
            return self._queued_requests + held_requests, self._queued_tokens + held_tokens

    def on_prefill_queued(self, requests):
        with self._acct:
            self._queued_requests += len(requests)
            self._queued_tokens += sum(len(r["tokens"]) for r in requests)

    def prefill_batch(self, peer_name, requests):
        n_tokens = sum(len(r["tokens"]) for r in requests)
        try:
            with self.metrics.prefill_time.time():
                super().prefill_batch(peer_name, requests)
        except Exception:
            with self._acct:
                self._failed.update(r["rid"] for r in requests)
            self.metrics.prefilled.labels("failed").inc(len(requests))
            self.metrics.kv.failed(len(requests))
            raise
        else:
            self.metrics.prefilled.labels("prefilled").inc(len(requests))
            self.metrics.prompt_tokens.inc(n_tokens)
        finally:
            with self._acct:  # held from now on (or released on failure)
                self._queued_requests -= len(requests)
                self._queued_tokens -= n_tokens

    def on_free_requested(self, rid):
        with self._acct:
            self._by_decode.add(rid)

    def on_released(self, rid, stats):
        with self._acct:
            by_decode = rid in self._by_decode
            failed = rid in self._failed
            self._by_decode.discard(rid)
            self._failed.discard(rid)
        if stats is None:
            return
        self.metrics.kv.add_bytes(stats)
        if by_decode:
            reason = "decode"
        elif failed:
            reason = "failed"
        elif self.closed:
            reason = "shutdown"
        else:  # the lease thread: lease expired or the decode peer vanished
            reason = "lease_expired"
            self.metrics.expired.inc()
        self.metrics.freed.labels(reason).inc()

    def on_notify_failed(self, kind, peer_name):
        self.metrics.kv.failed()

    def on_fetch_failed(self, error):
        self.metrics.kv.failed()


def create_prefill_app(worker: ServingPrefillWorker, metrics: PrefillMetrics, info: dict,
                       on_shutdown=None, max_request_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    """info: static /health fields (transport_address, transport, selector, model, ...)."""
    app = base_app("jkv prefill", metrics, max_request_bytes, on_shutdown)

    @app.get("/health")
    async def health():
        requests, tokens = worker.inflight()
        return {"status": "ok", "role": "prefill", "name": worker.name, **info,
                "inflight_requests": requests, "inflight_tokens": tokens,
                "kv_host_bytes_in_use": worker.pool.bytes_in_use, "kv_host_requests": len(worker.pool.live()),
                # every connected decode worker passed the handshake check against this config
                "handshake": {"config": worker.config.as_dict(), "agreed_with": sorted(worker.endpoint.peers)}}

    @app.get("/ready")
    async def ready():  # the transport endpoint listens from before the app starts until shutdown
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    async def not_here(rest: str):
        return P.error_response(f"this is a prefill instance (transport {info.get('transport_address')}); send "
                                "OpenAI requests to a `--role decode` server or the router", 404,
                                type_="not_found_error")

    return app
