"""`jkv serve --role router`: load-balancing, health-checking proxy in front of jkv servers.

Upstreams have a kind (`UPSTREAM_KINDS`): "all" (a colocated `--role all` server), or a
disaggregated pool of "prefill" (`--role prefill`) and "decode" (`--role decode`) servers;
`Router.pick(kind)` is the single place the choice is made. With a pool, each request gets a
prefill instance and a decode instance (both by the rule below); it is sent to the
decode instance with the prefill instance's transport address (from its /health) in the
`X-JKV-Prefill-Worker` header, and that prefill worker owns the request's KV. The prefill
instance counts as in flight until the response ends. A prefill instance dying mid-request
fails its requests on the decode instance, which ends their streams with an error event (500 for
a non-streaming request); the health check then removes it, and new requests go to the others.

Selection (`--routing least-load`): the healthy upstream of the wanted kind with the fewest
in-flight tokens (the sum, over requests the router is proxying to it, of estimated prompt tokens
+ max_tokens x n; the router has no tokenizer, so prompt tokens are estimated as UTF-8 bytes / 4).
Ties go to the one with fewer in-flight requests, then round-robin order. `--routing cache-aware`
(the default) first prefers the upstream holding the longest prefix of the request's text, as the
router remembers sending it, within a balance threshold of the least loaded one
(jkv/serving/routing.py); each pool (all, prefill, decode) has its own records.

Health: a background task GETs each upstream's /health every `health_interval`; a failure, a
`status` other than "ok" (a server with no live prefill worker reports "degraded"), or a
connection error while proxying marks it unhealthy and it gets no new requests; a later
passing check re-adds it. With no healthy upstream the router answers 503 (and so does its
own /ready; /health says which upstreams are down).

The app is `_Proxy` (selection and I/O) behind two routers: `proxy_router` (the OpenAI routes)
and `ops_router` (/health, /ready, /metrics); bodies over `max_request_bytes` get 413 before
they are read.

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
from collections.abc import Sequence

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from . import protocol as P
from .config import UPSTREAM_KINDS, ServeConfig
from .metrics import RouterMetrics
from .routing import PrefixRecord, RoutingConfig, prefix_keys
from .server import PREFILL_WORKER_HEADER, CountRequests, LimitRequestBody

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
    """Upstream bookkeeping and selection (pure; the app below does the I/O).

    With `routing.policy` "cache-aware" each upstream has a `PrefixRecord` of the prefix keys
    (`jkv.serving.routing.prefix_keys`) of the requests it was picked for; `pick(kind, keys=...)`
    prefers the one holding the longest run of them (jkv/serving/routing.py says when load wins)."""

    def __init__(self, upstreams: list[Upstream], metrics: RouterMetrics | None = None,
                 routing: RoutingConfig = RoutingConfig()):
        if not upstreams:
            raise ValueError("a router needs at least one upstream")
        self.upstreams = upstreams
        self.metrics = metrics
        self.routing = routing
        self.records = {(u.kind, u.url): PrefixRecord(routing.record_chunks) for u in upstreams}
        self._rr = collections.defaultdict(itertools.count)
        for u in upstreams:
            self._publish(u)

    def record(self, u: Upstream) -> PrefixRecord:
        return self.records[(u.kind, u.url)]

    def pick(self, kind: str = "all", exclude: set[str] = frozenset(), keys: Sequence[bytes] = ()) -> Upstream:
        """The upstream of `kind` for a request whose prefix keys are `keys` (empty: by load only);
        with cache-aware routing the keys are added to the chosen upstream's record."""
        live = [u for u in self.upstreams if u.kind == kind and u.healthy and u.url not in exclude]
        if not live:
            total = sum(u.kind == kind for u in self.upstreams)
            raise NoUpstreamError(f"no healthy {kind!r} upstream can serve this request "
                                  f"({total} configured, all failing health checks)")
        turn = next(self._rr[kind])  # rotation per pool, so picks in one pool never skew another's
        n = sum(u.kind == kind for u in self.upstreams)

        def by_load(u: Upstream):
            return u.inflight_tokens, u.inflight_requests, (u.order - turn) % n

        least = min(live, key=by_load)
        if self.routing.policy != "cache-aware" or not keys:
            chosen, by = least, "load"
        else:
            chosen, by = self._by_cache(live, keys, by_load)
            cfg = self.routing
            if (chosen.inflight_tokens - least.inflight_tokens > cfg.balance_abs_tokens
                    and chosen.inflight_tokens > cfg.balance_rel * least.inflight_tokens):
                chosen, by = least, "load"  # affinity must not queue work behind an idle instance
            evicted = self.record(chosen).insert(keys)
            self._publish(chosen)
            if self.metrics is not None and evicted:
                self.metrics.record_evictions.labels(chosen.url, kind).inc(evicted)
        if self.metrics is not None:
            self.metrics.routed.labels(kind, by).inc()
        return chosen

    def _by_cache(self, live: list[Upstream], keys: Sequence[bytes], by_load) -> tuple[Upstream, str]:
        """(upstream, reason) before the balance check: the longest held prefix, else the emptiest record."""
        matched = {u.url: self.record(u).match(keys) for u in live}
        best = max(matched.values())
        if best > 0 and best >= self.routing.min_match * len(keys):
            holders = [u for u in live if matched[u.url] == best]
            return min(holders, key=by_load), "prefix" if len(holders) < len(live) else "load"
        # a new prefix: the instance whose cache holds least of what the router sent it
        return min(live, key=lambda u: (len(self.record(u)), *by_load(u))), "cache_size"

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
                # it may have restarted with an empty cache: forget what it held rather than send it
                # traffic for prefixes it no longer has
                self.record(u).clear()
                log.warning("upstream %s is healthy again; routing to it", u.url)
            else:
                log.warning("upstream %s removed from rotation: %s", u.url, why)
        u.healthy = healthy
        self._publish(u)

    def _publish(self, u: Upstream):
        if self.metrics is not None:
            self.metrics.healthy.labels(u.url, u.kind).set(1 if u.healthy else 0)
            self.metrics.inflight_tokens.labels(u.url, u.kind).set(u.inflight_tokens)
            if self.routing.policy == "cache-aware":
                self.metrics.record_chunks.labels(u.url, u.kind).set(len(self.record(u)))


def estimate_tokens(body: dict, raw_len: int) -> int:
    """In-flight token estimate for load balancing: prompt bytes / 4 + max_tokens x n."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    n = body.get("n") or 1
    try:
        return raw_len // 4 + int(max_tokens) * int(n)
    except (TypeError, ValueError):
        return raw_len // 4


def health_verdict(status_code: int, body) -> tuple[bool, str]:
    """(healthy, why not) from an upstream's /health answer: 200 and status "ok"."""
    if status_code != 200:
        return False, f"/health answered {status_code}"
    if not isinstance(body, dict) or body.get("status") != "ok":
        status = body.get("status") if isinstance(body, dict) else body
        reason = body.get("reason") if isinstance(body, dict) else None
        return False, f"/health reports {status!r}" + (f" ({reason})" if reason else "")
    return True, ""


class _Proxy:
    """The router's state and I/O: health checks, prefill choice, proxying and stream relaying."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.metrics = RouterMetrics()
        pools = [(u, "all") for u in cfg.upstream] + [(u, "prefill") for u in cfg.prefill] + \
            [(u, "decode") for u in cfg.decode]
        self.router = Router([Upstream(u, kind, order=sum(k == kind for _, k in pools[:i]))
                              for i, (u, kind) in enumerate(pools)], self.metrics, cfg.routing)
        self.disaggregated = bool(cfg.decode)  # a --prefill/--decode pool takes the requests; --upstream is unused
        self.serving_kind = "decode" if self.disaggregated else "all"
        self.client: httpx.AsyncClient | None = None  # set by the app's lifespan

    async def check_once(self):
        async def one(u: Upstream):
            try:
                r = await self.client.get(u.url + "/health", timeout=self.cfg.health_timeout)
                body = r.json() if r.status_code == 200 else None
                if r.status_code == 200 and u.kind == "prefill" and isinstance(body, dict):
                    u.info = body  # transport_address, in-flight requests/tokens
                self.router.mark(u, *health_verdict(r.status_code, body))
            except (httpx.HTTPError, ValueError) as e:
                self.router.mark(u, False, f"/health failed ({type(e).__name__})")
        await asyncio.gather(*(one(u) for u in self.router.upstreams))

    async def health_loop(self):
        while True:
            await self.check_once()
            await asyncio.sleep(self.cfg.health_interval)

    def available(self) -> bool:
        kinds = ("prefill", "decode") if self.disaggregated else ("all",)
        return all(any(u.healthy and u.kind == k for u in self.router.upstreams) for k in kinds)

    async def pick_prefill(self, tried: set[str], keys: Sequence[bytes] = ()) -> tuple[Upstream, str]:
        """A healthy prefill instance (`Router.pick`) and its transport address (from its /health)."""
        router = self.router
        while True:
            p = router.pick("prefill", exclude=tried, keys=keys)  # NoUpstreamError when none is left
            tried.add(p.url)
            if not p.info.get("transport_address"):
                try:
                    r = await self.client.get(p.url + "/health", timeout=self.cfg.health_timeout)
                    p.info = r.json() if r.status_code == 200 else {}
                except (httpx.HTTPError, ValueError) as e:
                    router.mark(p, False, f"/health failed ({type(e).__name__})")
                    continue
            if p.info.get("transport_address"):
                return p, p.info["transport_address"]
            router.mark(p, False, "/health reports no transport_address (not a `--role prefill` server?)")

    async def proxy(self, request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return P.error_response(f"the request body is not a valid JSON object ({e})", 400, param="body")
        tokens = estimate_tokens(body, len(raw))
        routing = self.cfg.routing
        keys = prefix_keys(body, path, routing.chunk_chars) if routing.policy == "cache-aware" else []
        headers = {"content-type": "application/json"}
        held: list[Upstream] = []  # prefill instance (disaggregated pool): released with the response
        if self.disaggregated:
            try:
                p, address = await self.pick_prefill(set(), keys)
            except NoUpstreamError as e:
                return P.error_response(str(e), 503, type_="service_unavailable")
            self.router.acquire(p, tokens)
            held.append(p)
            headers[PREFILL_WORKER_HEADER] = address
            self.metrics.proxied.labels(p.url, p.kind, "picked").inc()

        def release_held():
            for h in held:
                self.router.release(h, tokens)
            held.clear()

        return await self._send(path, raw, headers, tokens, bool(body.get("stream")), release_held, keys)

    async def _send(self, path: str, raw: bytes, headers: dict, tokens: int, stream: bool, release_held,
                    keys: Sequence[bytes]):
        """POST to the serving upstream `Router.pick` chooses; a refused connection moves on to the next."""
        router, metrics, tried, t0 = self.router, self.metrics, set(), time.perf_counter()
        while True:
            try:
                u = router.pick(self.serving_kind, exclude=tried, keys=keys)
            except NoUpstreamError as e:
                release_held()
                return P.error_response(str(e), 503, type_="service_unavailable")
            tried.add(u.url)
            router.acquire(u, tokens)
            try:
                req = self.client.build_request("POST", u.url + path, content=raw, headers=headers)
                resp = await self.client.send(req, stream=True)
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
                return StreamingResponse(self._relay_stream(u, resp, tokens, release_held), status_code=200,
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return await self._relay_body(u, resp, tokens, release_held)

    async def _relay_body(self, u: Upstream, resp: httpx.Response, tokens: int, release_held):
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            self.metrics.proxied.labels(u.url, u.kind, "error").inc()
            return P.error_response(f"upstream {u.url} died mid-response ({type(e).__name__})", 502,
                                    type_="upstream_error")
        finally:
            await resp.aclose()
            self.router.release(u, tokens)
            release_held()
        self.metrics.proxied.labels(u.url, u.kind, "ok" if resp.status_code < 500 else "error").inc()
        return Response(content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    async def _relay_stream(self, u: Upstream, resp: httpx.Response, tokens: int, release_held):
        outcome = "ok"
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            outcome = "died_mid_stream"
            self.router.mark(u, False, f"died mid-stream ({type(e).__name__})")
            err = P.error_body(f"upstream {u.url} failed mid-stream ({type(e).__name__}); the output is incomplete",
                               "upstream_error")
            yield f"\n\ndata: {json.dumps(err)}\n\n".encode()
        finally:
            await resp.aclose()  # on client disconnect this closes the upstream stream, which cancels there too
            self.router.release(u, tokens)
            release_held()
            self.metrics.proxied.labels(u.url, u.kind, outcome).inc()


def proxy_router(px: _Proxy) -> APIRouter:
    """POST /v1/completions, POST /v1/chat/completions (proxied), GET /v1/models (first healthy upstream)."""
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await px.proxy(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        return await px.proxy(request, "/v1/chat/completions")

    @api.get("/v1/models")
    async def models():
        for u in [u for u in px.router.upstreams if u.healthy and u.kind == px.serving_kind]:
            try:
                r = await px.client.get(u.url + "/v1/models", timeout=px.cfg.health_timeout)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError:
                px.router.mark(u, False, "/v1/models failed")
        return P.error_response("no healthy upstream", 503, type_="service_unavailable")

    return api


def ops_router(px: _Proxy) -> APIRouter:
    """GET /health (200 or 503, with every upstream's state), GET /ready (the same verdict), GET /metrics."""
    api = APIRouter()

    @api.get("/health")
    async def health():
        ups = [{"url": u.url, "kind": u.kind, "healthy": u.healthy, "inflight_tokens": u.inflight_tokens,
                "inflight_requests": u.inflight_requests} for u in px.router.upstreams]
        ok = px.available()
        return JSONResponse({"status": "ok" if ok else "unavailable", "upstreams": ups},
                            status_code=200 if ok else 503)

    @api.get("/ready")
    async def ready():
        ok = px.available()
        return JSONResponse({"status": "ready"} if ok else
                            {"status": "unready", "reason": "no healthy upstream of some needed kind"},
                            status_code=200 if ok else 503)

    @api.get("/metrics")
    async def prometheus():
        return Response(px.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return api


def create_router_app(cfg: ServeConfig) -> FastAPI:
    px = _Proxy(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.upstream_timeout, connect=cfg.health_timeout),
                                     limits=limits) as client:
            px.client = client
            await px.check_once()
            task = asyncio.create_task(px.health_loop())
            try:
                yield
            finally:
                task.cancel()

    app = FastAPI(title="jkv router", lifespan=lifespan)
    app.add_middleware(LimitRequestBody, max_bytes=cfg.max_request_bytes)
    app.add_middleware(CountRequests, metrics=px.metrics)
    app.state.router = px.router
    app.include_router(proxy_router(px))
    app.include_router(ops_router(px))
    return app
