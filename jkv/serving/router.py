"""`jkv serve --role router`: load-balancing, health-checking proxy in front of jkv servers.

Upstreams have a kind (`UPSTREAM_KINDS`): "all" (a colocated `--role all` server), or a
disaggregated pool of "prefill" (`--role prefill`) and "decode" (`--role decode`) servers;
`Router.pick(kind)` is the single place the choice is made. With a pool, each request gets a
prefill instance (least in-flight tokens) and a decode instance (same rule); it is sent to the
decode instance with the prefill instance's transport address (from its /health) in the
`X-JKV-Prefill-Worker` header, and that prefill worker owns the request's KV. The prefill
instance counts as in flight until the response ends. A prefill instance dying mid-request
fails its requests on the decode instance, which ends their streams with an error event (500 for
a non-streaming request); the health check then removes it, and new requests go to the others.

Selection: the healthy upstream of the wanted kind with the fewest in-flight tokens (the sum,
over requests the router is proxying to it, of estimated prompt tokens + max_tokens x n; the
router has no tokenizer, so prompt tokens are estimated as UTF-8 bytes / 4). Ties go to the
one with fewer in-flight requests, then round-robin order.

Health: a background task GETs each upstream's /health every `health_interval`; a failure (or a
connection error while proxying) marks it unhealthy and it gets no new requests; a later
passing check re-adds it. With no healthy upstream the router answers 503.

Failures while proxying: a connection failure before any byte reached the client is retried
on the next healthy upstream; an upstream dying mid-stream ends the client's SSE stream with an
`{"error": ...}` event (no `[DONE]`), and mid-body on a non-streaming request gives a 502 —
never a silently truncated 200.

Concurrency: everything runs on uvicorn's event loop (one shared `httpx.AsyncClient`); counters
are only touched from that loop, so no locks are needed.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from . import protocol as P
from .config import UPSTREAM_KINDS, ServeConfig
from .metrics import RouterMetrics
from .server import PREFILL_WORKER_HEADER, CountRequests

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Upstream:
    url: str
    kind: str = "all"
    healthy: bool = True  # optimistic until the first check says otherwise
    inflight_tokens: int = 0
    inflight_requests: int = 0
    order: int = 0
    info: dict = dataclasses.field(default_factory=dict)  # last /health body (prefill: transport_address)

    def __post_init__(self):
        if self.kind not in UPSTREAM_KINDS:
            raise ValueError(f"upstream kind {self.kind!r} must be one of {UPSTREAM_KINDS}")
        self.url = self.url.rstrip("/")


class NoUpstreamError(Exception):
    pass


class Router:
    """Upstream bookkeeping and selection (pure; the app below does the I/O)."""

    def __init__(self, upstreams: list[Upstream], metrics: RouterMetrics | None = None):
        if not upstreams:
            raise ValueError("a router needs at least one upstream")
        self.upstreams = upstreams
        self.metrics = metrics
        self._rr = collections.defaultdict(itertools.count)
        for u in upstreams:
            self._publish(u)

    def pick(self, kind: str = "all", exclude: set[str] = frozenset()) -> Upstream:
        live = [u for u in self.upstreams if u.kind == kind and u.healthy and u.url not in exclude]
        if not live:
            total = sum(u.kind == kind for u in self.upstreams)
            raise NoUpstreamError(f"no healthy {kind!r} upstream can serve this request "
                                  f"({total} configured, all failing health checks)")
        turn = next(self._rr[kind])  # rotation per pool, so picks in one pool never skew another's
        n = sum(u.kind == kind for u in self.upstreams)
        return min(live, key=lambda u: (u.inflight_tokens, u.inflight_requests, (u.order - turn) % n))

    def acquire(self, u: Upstream, tokens: int):
        u.inflight_tokens += tokens
        u.inflight_requests += 1
        self._publish(u)

    def release(self, u: Upstream, tokens: int):
        u.inflight_tokens -= tokens
        u.inflight_requests -= 1
        self._publish(u)

    def mark(self, u: Upstream, healthy: bool, why: str = ""):
        if u.healthy != healthy:
            if healthy:
                log.warning("upstream %s is healthy again; routing to it", u.url)
            else:
                log.warning("upstream %s removed from rotation: %s", u.url, why)
        u.healthy = healthy
        self._publish(u)

    def _publish(self, u: Upstream):
        if self.metrics is not None:
            self.metrics.healthy.labels(u.url, u.kind).set(1 if u.healthy else 0)
            self.metrics.inflight_tokens.labels(u.url, u.kind).set(u.inflight_tokens)


def estimate_tokens(body: dict, raw_len: int) -> int:
    """In-flight token estimate for load balancing: prompt bytes / 4 + max_tokens x n."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    n = body.get("n") or 1
    try:
        return raw_len // 4 + int(max_tokens) * int(n)
    except (TypeError, ValueError):
        return raw_len // 4


def create_router_app(cfg: ServeConfig) -> FastAPI:
    metrics = RouterMetrics()
    pools = [(u, "all") for u in cfg.upstream] + [(u, "prefill") for u in cfg.prefill] + \
        [(u, "decode") for u in cfg.decode]
    router = Router([Upstream(u, kind, order=sum(k == kind for _, k in pools[:i]))
                     for i, (u, kind) in enumerate(pools)], metrics)
    disaggregated = bool(cfg.decode)  # a --prefill/--decode pool takes the requests; --upstream is unused then
    serving_kind = "decode" if disaggregated else "all"
    state: dict = {}

    async def check_once(client: httpx.AsyncClient):
        async def one(u: Upstream):
            try:
                r = await client.get(u.url + "/health", timeout=cfg.health_timeout)
                if r.status_code == 200 and u.kind == "prefill":
                    u.info = r.json()  # transport_address, in-flight requests/tokens
                router.mark(u, r.status_code == 200, f"/health answered {r.status_code}")
            except (httpx.HTTPError, ValueError) as e:
                router.mark(u, False, f"/health failed ({type(e).__name__})")
        await asyncio.gather(*(one(u) for u in router.upstreams))

    async def health_loop(client):
        while True:
            await check_once(client)
            await asyncio.sleep(cfg.health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.upstream_timeout, connect=cfg.health_timeout),
                                     limits=limits) as client:
            state["client"] = client
            await check_once(client)
            task = asyncio.create_task(health_loop(client))
            try:
                yield
            finally:
                task.cancel()

    app = FastAPI(title="jkv router", lifespan=lifespan)
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.router = router

    async def pick_prefill(client: httpx.AsyncClient, tried: set[str]) -> tuple[Upstream, str]:
        """Least-loaded healthy prefill instance and its transport address (from its /health)."""
        while True:
            p = router.pick("prefill", exclude=tried)  # NoUpstreamError when none is left
            tried.add(p.url)
            if not p.info.get("transport_address"):
                try:
                    r = await client.get(p.url + "/health", timeout=cfg.health_timeout)
                    p.info = r.json() if r.status_code == 200 else {}
                except (httpx.HTTPError, ValueError) as e:
                    router.mark(p, False, f"/health failed ({type(e).__name__})")
                    continue
            if p.info.get("transport_address"):
                return p, p.info["transport_address"]
            router.mark(p, False, "/health reports no transport_address (not a `--role prefill` server?)")

    async def proxy(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return P.error_response(f"the request body is not a valid JSON object ({e})", 400, param="body")
        tokens = estimate_tokens(body, len(raw))
        stream = bool(body.get("stream"))
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        t0 = time.perf_counter()
        headers = {"content-type": "application/json"}
        held: list[Upstream] = []  # prefill instance (disaggregated pool): released with the response
        if disaggregated:
            try:
                p, address = await pick_prefill(client, set())
            except NoUpstreamError as e:
                return P.error_response(str(e), 503, type_="service_unavailable")
            router.acquire(p, tokens)
            held.append(p)
            headers[PREFILL_WORKER_HEADER] = address
            metrics.proxied.labels(p.url, p.kind, "picked").inc()

        def release_held():
            for h in held:
                router.release(h, tokens)
            held.clear()

        while True:
            try:
                u = router.pick(serving_kind, exclude=tried)
            except NoUpstreamError as e:
                release_held()
                return P.error_response(str(e), 503, type_="service_unavailable")
            tried.add(u.url)
            router.acquire(u, tokens)
            try:
                req = client.build_request("POST", u.url + path, content=raw, headers=headers)
                resp = await client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                router.release(u, tokens)
                router.mark(u, False, f"connection failed ({type(e).__name__})")
                metrics.proxied.labels(u.url, u.kind, "connect_error").inc()
                continue  # nothing reached the client yet: try the next upstream
            except httpx.HTTPError as e:
                router.release(u, tokens)
                release_held()
                metrics.proxied.labels(u.url, u.kind, "error").inc()
                return P.error_response(f"upstream {u.url} failed: {type(e).__name__}: {e}", 502,
                                        type_="upstream_error")
            metrics.ttft.observe(time.perf_counter() - t0)
            if stream and resp.status_code == 200:
                return StreamingResponse(_relay_stream(u, resp, tokens, release_held), status_code=200,
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                metrics.proxied.labels(u.url, u.kind, "error").inc()
                return P.error_response(f"upstream {u.url} died mid-response ({type(e).__name__})", 502,
                                        type_="upstream_error")
            finally:
                await resp.aclose()
                router.release(u, tokens)
                release_held()
            metrics.proxied.labels(u.url, u.kind, "ok" if resp.status_code < 500 else "error").inc()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))

    async def _relay_stream(u: Upstream, resp: httpx.Response, tokens: int, release_held):
        outcome = "ok"
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            outcome = "died_mid_stream"
            router.mark(u, False, f"died mid-stream ({type(e).__name__})")
            err = P.error_body(f"upstream {u.url} failed mid-stream ({type(e).__name__}); the output is incomplete",
                               "upstream_error")
            yield f"\n\ndata: {json.dumps(err)}\n\n".encode()
        finally:
            await resp.aclose()  # on client disconnect this closes the upstream stream, which cancels there too
            router.release(u, tokens)
            release_held()
            metrics.proxied.labels(u.url, u.kind, outcome).inc()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        client: httpx.AsyncClient = state["client"]
        for u in [u for u in router.upstreams if u.healthy and u.kind == serving_kind]:
            try:
                r = await client.get(u.url + "/v1/models", timeout=cfg.health_timeout)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError:
                router.mark(u, False, "/v1/models failed")
        return P.error_response("no healthy upstream", 503, type_="service_unavailable")

    @app.get("/health")
    async def health():
        ups = [{"url": u.url, "kind": u.kind, "healthy": u.healthy, "inflight_tokens": u.inflight_tokens,
                "inflight_requests": u.inflight_requests} for u in router.upstreams]
        kinds = ("prefill", "decode") if disaggregated else ("all",)
        ok = all(any(u.healthy and u.kind == k for u in router.upstreams) for k in kinds)
        return JSONResponse({"status": "ok" if ok else "unavailable", "upstreams": ups},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
