"""OpenAI-compatible HTTP API over an engine: the colocated `ContinuousBatcher` (`jkv serve --role all`)
or the disaggregated `DisaggBatcher` (`--role decode`, `--role all --disaggregation`); both take
`submit(EngineRequest)` / `cancel(request_id)` and emit `StreamEvent`s. A router's
`X-JKV-Prefill-Worker` header becomes `EngineRequest.kv_owner` (the prefill worker to own the KV).

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming or one JSON body),
GET /v1/models (router `openai_router`); GET /health (liveness, says why when degraded), GET
/ready (503 while the engine cannot serve, e.g. no live prefill worker), GET /metrics
(Prometheus text) (router `ops_router`). Request bodies over `max_request_bytes` get 413
before they are read (`LimitRequestBody`).

Concurrency. Handlers run on uvicorn's single asyncio event loop. Each HTTP request turns into
n x prompts engine requests that are `submit`ted to the batcher (thread-safe queue); their
`StreamEvent`s come back on the engine thread and are handed to this loop by `AsyncSink`
(`loop.call_soon_threadsafe(queue.put_nowait, event)`), one asyncio.Queue per HTTP request.
Nothing here touches the device. Tokenizing, chat templating and detokenizing log-prob tokens
run in the threadpool (`run_in_threadpool`), so a large prompt never blocks the loop and /health
keeps answering. If the client goes away (a streaming write fails, or a
non-streaming request sees `is_disconnected()`), the handler's `finally` cancels every engine
request it still has open, which frees their slots on the engine thread before its next step.
Graceful shutdown is uvicorn's: stop accepting, let open responses finish (up to
`graceful_timeout`), then the lifespan hook stops the engine thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .admission import SLO_HEADER, parse_slo_ms
from .batcher import ContextLengthError, ContinuousBatcher, EngineRequest, StreamEvent
from .metrics import ServerMetrics
from . import protocol as P

log = logging.getLogger(__name__)
PREFILL_WORKER_HEADER = "x-jkv-prefill-worker"  # router -> decode: transport address of the chosen prefill worker
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")
DISAGG_UNSUPPORTED = ("is not supported by the disaggregated engine (--role decode, --role all --disaggregation); "
                      "use a `jkv serve --role all` server without --disaggregation")


class AsyncSink:
    """Engine thread -> event loop hand-off for one HTTP request's events."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

    def emit(self, event: StreamEvent):  # called on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class CountRequests:
    """Pure ASGI middleware (streaming- and disconnect-safe) counting requests by endpoint and status."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope.get("path", "")
            self.metrics.count_request(path if path in _ENDPOINTS else "other", status[0])


class LimitRequestBody:
    """Pure ASGI middleware: a body over `max_bytes` gets 413 naming the limit, before any handler
    parses it (by Content-Length up front, or by counting the bytes of a chunked body as they arrive;
    the handler then sees a disconnect and whatever it answers is dropped)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> JSONResponse:
        return P.error_response(f"the request body is {size} bytes, over this server's limit of {self.max_bytes} "
                                "bytes (raise it with --max-request-bytes / max_request_bytes)", 413,
                                param="body", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(declared.decode())(scope, receive, send)
        seen, started, refused = [0], [False], [False]

        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request" and not refused[0]:
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_bytes and not started[0]:
                    refused[0] = True
                    await self._too_large(f"more than {self.max_bytes}")(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def noted_send(message):
            if refused[0]:
                return  # the 413 went out already
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, noted_send)


def install_error_handlers(app: FastAPI):
    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = P.validation_message(exc.errors())
        return P.error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return P.error_response(f"{exc.detail}: {request.method} {request.url.path}", exc.status_code, type_=kind)

    @app.exception_handler(P.RequestError)
    async def _req(request, exc: P.RequestError):
        return exc.response()


class _Job:
    """The engine requests of one HTTP request: choice index -> request id, and their sink."""

    def __init__(self, engine: ContinuousBatcher, loop, kv_owner: str | None = None):
        self.engine = engine
        self.kv_owner = kv_owner
        self.sink = AsyncSink(loop)
        self.index: dict[str, int] = {}
        self.open: set[str] = set()

    def submit(self, prompts_ids: list[list[int]], params_for, **scoring) -> None:
        """scoring: EngineRequest's logprobs / prompt_logprobs / prompt_only / slo_ms, the same for every choice."""
        for p, ids in enumerate(prompts_ids):
            for c, sp in enumerate(params_for(p, ids)):
                rid = P.new_id("req")
                self.index[rid] = len(self.index)
                self.open.add(rid)
                self.engine.submit(EngineRequest(rid, ids, sp, self.sink.emit, kv_owner=self.kv_owner, **scoring))

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        while self.open:
            ev = await self.sink.queue.get()
            if ev.finish_reason is not None:
                self.open.discard(ev.request_id)
            yield self.index[ev.request_id], ev

    def cancel_open(self):
        for rid in self.open:
            self.engine.cancel(rid)
        self.open.clear()


class _Shape:
    """What one OpenAI request asks for beyond sampling: chat or completion, log-probs, echo."""

    def __init__(self, chat: bool, logprobs: int | None = None, echo_texts: list[str] | None = None,
                 echo_ids: list[list[int]] | None = None, prompt_only: bool = False, choices_per_prompt: int = 1):
        self.chat, self.logprobs, self.prompt_only = chat, logprobs, prompt_only
        self.echo_texts, self.echo_ids, self.n = echo_texts, echo_ids, choices_per_prompt

    def scoring(self) -> dict:
        echo_scored = self.echo_texts is not None and self.logprobs is not None
        # A request that asks for log-probs reads no cached prefix: its numbers then never depend on
        # what other requests left in the cache (a cached prefix changes them by float rounding).
        return dict(logprobs=self.logprobs, prompt_logprobs=self.logprobs if echo_scored else None,
                    prompt_only=self.prompt_only, prefix_cache=self.logprobs is None)

    def echo(self, choice: int) -> str:
        return self.echo_texts[choice // self.n] if self.echo_texts is not None else ""


class _Frontend:
    """The engine behind the OpenAI routes: tokenizing, validation, submission and the responses."""

    def __init__(self, engine, model_name: str, default_max_tokens: int):
        self.engine, self.model_name, self.default_max_tokens = engine, model_name, default_max_tokens
        self.tok = engine.model.tokenizer
        self.vocab = engine.model.cfg.vocab_size
        self.max_len = engine.config.max_model_len
        self.scores = getattr(engine, "supports_logprobs", False)

    def check_model(self, name: str | None):
        if name is not None and name != self.model_name:
            raise P.RequestError(f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                                 status=404, param="model", type_="not_found_error", code="model_not_found")

    def check_supported(self, feature: str, param: str):
        if not self.scores:
            raise P.RequestError(f"{feature} {DISAGG_UNSUPPORTED}", param=param)

    def encode(self, prompt) -> list[int]:  # threadpool: a large prompt must not stall the event loop
        if isinstance(prompt, str):
            if self.tok is None:
                raise P.RequestError("this model has no tokenizer; send the prompt as token ids", param="prompt")
            ids = self.tok.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise P.RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab})",
                                     param="prompt")
        if not ids:
            raise P.RequestError("the prompt is empty (0 tokens); give at least one token", param="prompt")
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:  # threadpool
        if self.tok is None or not self.tok.chat_template:
            raise P.RequestError("this model has no chat template; use /v1/completions", param="messages")
        try:
            return self.tok.apply_chat_template(messages)
        except ValueError as e:
            raise P.RequestError(f"the chat template rejected the messages: {e}", param="messages") from None

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False) if self.tok is not None else \
            f"token_id:{token_id}"

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.tok is not None else ""

    def plan(self, body: P.SamplingFields, prompts_ids: list[list[int]], requested: int | None, default: int):
        def params_for(p, ids):
            max_tokens = requested if requested is not None else max(1, min(default, self.max_len - len(ids)))
            try:
                self.engine.check_request(len(ids), max_tokens)
                return [body.sampling(max(max_tokens, 1), c) for c in range(body.n)]
            except ContextLengthError as e:
                raise P.RequestError(str(e), param="messages" if isinstance(body, P.ChatRequest) else "prompt",
                                     code="context_length_exceeded") from None
            except ValueError as e:
                raise P.RequestError(str(e)) from None
        planned = [params_for(p, ids) for p, ids in enumerate(prompts_ids)]  # validate everything first
        return lambda p, ids: planned[p]

    async def run(self, request: Request, body: P.SamplingFields, prompts_ids, params_for, shape: _Shape):
        try:
            slo_ms = parse_slo_ms(body.slo_ms, request.headers.get(SLO_HEADER))
        except ValueError as e:
            return P.error_response(str(e), 400, param=SLO_HEADER)
        job = _Job(self.engine, asyncio.get_running_loop(), request.headers.get(PREFILL_WORKER_HEADER))
        try:
            job.submit(prompts_ids, params_for, slo_ms=slo_ms, **shape.scoring())
        except (RuntimeError, ContextLengthError) as e:
            job.cancel_open()
            return P.error_response(str(e), 503 if isinstance(e, RuntimeError) else 400)
        rid = P.new_id("chatcmpl" if shape.chat else "cmpl")
        n_prompt = sum(len(ids) for ids in prompts_ids)
        if body.stream:
            return StreamingResponse(self.stream(job, rid, body, n_prompt, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.collect(request, job, rid, n_prompt, shape)

    async def _gather_until_disconnect(self, request: Request, job: _Job) -> dict[int, list[StreamEvent]] | None:
        """Every event per choice, or None when the client went away first (its requests cancelled)."""
        events: dict[int, list[StreamEvent]] = {}

        async def gather():
            async for i, ev in job.events():
                events.setdefault(i, []).append(ev)

        async def watch_disconnect():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        work, watch = asyncio.create_task(gather()), asyncio.create_task(watch_disconnect())
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            job.cancel_open()
        return events if work.done() and not work.cancelled() else None

    async def collect(self, request: Request, job: _Job, rid: str, n_prompt: int, shape: _Shape):
        events = await self._gather_until_disconnect(request, job)
        if events is None:
            return Response(status_code=499)  # client went away; nobody reads this
        finals = {i: evs[-1] for i, evs in events.items()}
        errors = [ev.error for ev in finals.values() if ev.finish_reason == "error"]
        if errors:
            return P.error_response(errors[0], 500, type_="server_error")
        choices = await run_in_threadpool(lambda: [self._choice(i, events[i], shape) for i in sorted(finals)])
        use = P.usage(n_prompt, sum(ev.completion_tokens for ev in finals.values()))
        return JSONResponse(P.chat_body(rid, self.model_name, choices, use) if shape.chat
                            else P.completion_body(rid, self.model_name, choices, use))

    def _choice(self, i: int, evs: list[StreamEvent], shape: _Shape) -> dict:  # threadpool
        final = evs[-1]
        text = final.final_text if final.final_text is not None else "".join(ev.text for ev in evs)
        if shape.chat:
            return P.chat_choice(i, text, final.finish_reason,
                                 self._logprobs(evs, shape, i) if shape.logprobs is not None else None)
        logprobs = self._logprobs(evs, shape, i) if shape.logprobs is not None else None
        return P.completion_choice(i, shape.echo(i) + text, final.finish_reason, logprobs)

    def _logprobs(self, evs: list[StreamEvent], shape: _Shape, choice: int, offset: int = 0) -> dict:
        """The OpenAI logprobs of the tokens in `evs` (with the echoed prompt's when it is scored)."""
        ids = [t for ev in evs for t in ev.token_ids]
        entries = [e for ev in evs for e in (ev.logprobs or [])]
        if shape.chat:
            return P.chat_logprobs(entries, self.token_text)
        prompt = next((ev.prompt_logprobs for ev in evs if ev.prompt_logprobs is not None), None)
        if prompt is not None:
            out = P.completion_logprobs(prompt, self.token_text, shape.echo_ids[choice // shape.n])
            more = P.completion_logprobs(entries, self.token_text, ids, offset=len(shape.echo(choice)))
            return {k: out[k] + more[k] for k in out}
        return P.completion_logprobs(entries, self.token_text, ids, offset=offset)

    async def stream(self, job: _Job, rid: str, body: P.SamplingFields, n_prompt: int, shape: _Shape):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        completion_tokens, offsets = 0, {}
        try:
            if shape.chat:
                for i in range(len(job.index)):
                    yield sse(P.chat_chunk(rid, self.model_name,
                                           [P.chat_delta(i, {"role": "assistant", "content": ""}, None)]))
            async for i, ev in job.events():
                if ev.finish_reason == "error":
                    yield sse(P.error_body(ev.error or "engine error", "server_error"))
                    job.cancel_open()
                    return
                if ev.finish_reason is not None:
                    completion_tokens += ev.completion_tokens
                chunk = await run_in_threadpool(self._stream_choice, rid, i, ev, shape, offsets)
                if chunk is not None:
                    yield sse(chunk)
            if body.include_usage:
                use = P.usage(n_prompt, completion_tokens)
                yield sse((P.chat_chunk if shape.chat else P.completion_chunk)(rid, self.model_name, [], use))
            yield "data: [DONE]\n\n"
        finally:
            job.cancel_open()  # client disconnect (GeneratorExit/CancelledError) lands here too

    def _stream_choice(self, rid: str, i: int, ev: StreamEvent, shape: _Shape,
                       offsets: dict[int, int]) -> dict | None:
        """One SSE chunk for event `ev` of choice `i` (None when it carries nothing); threadpool.
        offsets: characters of each choice's text already sent (for completions' text_offset)."""
        model = self.model_name
        reason = ev.finish_reason if ev.finish_reason != "cancelled" else "abort"
        text = ev.text
        if not shape.chat and i not in offsets:
            text = shape.echo(i) + text  # the echoed prompt leads the choice's first chunk
        has_lp = shape.logprobs is not None and (ev.logprobs or ev.prompt_logprobs)
        if not text and ev.finish_reason is None and not has_lp:
            return None
        logprobs = None
        if shape.logprobs is not None:
            logprobs = self._logprobs([ev], shape, i, offset=offsets.get(i, 0))
        offsets[i] = offsets.get(i, 0) + len(text)
        if shape.chat:
            delta = {"content": text} if text else {}
            return P.chat_chunk(rid, model, [P.chat_delta(i, delta, reason, logprobs)])
        return P.completion_chunk(rid, model, [P.completion_choice(i, text, reason, logprobs)])


def openai_router(fe: _Frontend) -> APIRouter:
    """POST /v1/completions, POST /v1/chat/completions, GET /v1/models."""
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        fe.check_model(body.model)
        body.check_scoring()
        if body.logprobs is not None:
            fe.check_supported("logprobs", "logprobs")
        if body.max_tokens == 0:
            fe.check_supported("max_tokens=0 (scoring the prompt)", "max_tokens")
        prompts = body.prompts()
        prompts_ids = await run_in_threadpool(lambda: [fe.encode(p) for p in prompts])
        params_for = fe.plan(body, prompts_ids, body.max_tokens, 16)  # OpenAI's completions default is 16
        echo_texts = None
        if body.echo:
            echo_texts = await run_in_threadpool(
                lambda: [p if isinstance(p, str) else fe.decode(ids) for p, ids in zip(prompts, prompts_ids)])
        shape = _Shape(False, body.logprobs, echo_texts, prompts_ids if body.echo else None,
                       prompt_only=body.max_tokens == 0, choices_per_prompt=body.n)
        return await fe.run(request, body, prompts_ids, params_for, shape)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatRequest, request: Request):
        fe.check_model(body.model)
        logprobs = body.logprob_count()
        if logprobs is not None:
            fe.check_supported("logprobs", "logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await run_in_threadpool(fe.chat_ids, messages)
        requested = body.max_completion_tokens or body.max_tokens
        params_for = fe.plan(body, [ids], requested, fe.default_max_tokens)
        return await fe.run(request, body, [ids], params_for, _Shape(True, logprobs))

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "created": P.now(),
                                            "owned_by": "jkv", "max_model_len": fe.max_len}]}

    return api


def readiness(engine) -> tuple[bool, str | None]:
    """(ready, why not): the engine's own `readiness()` when it has one."""
    check = getattr(engine, "readiness", None)
    return check() if check is not None else (True, None)


def ops_router(engine, metrics: ServerMetrics) -> APIRouter:
    """GET /health (liveness: 200 while the process serves HTTP; `status` "degraded" with a `reason`
    when it cannot take requests), GET /ready (readiness: 200, or 503 with the reason), GET /metrics."""
    api = APIRouter()

    @api.get("/health")
    async def health():
        ready, why = readiness(engine)
        extra = engine.health() if hasattr(engine, "health") else {}
        state = {"status": "ok"} if ready else {"status": "degraded", "reason": why}
        return {**state, "ready": ready, "role": metrics.role, "running": engine.num_running,
                "waiting": engine.num_waiting, **extra}

    @api.get("/ready")
    async def ready():
        ok, why = readiness(engine)
        return JSONResponse({"status": "ready"} if ok else {"status": "unready", "reason": why},
                            status_code=200 if ok else 503)

    @api.get("/metrics")
    async def prometheus():  # off the event loop: a scrape may wait on the local prefill workers' stats RPC
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    return api


def base_app(title: str, metrics, max_request_bytes: int, on_shutdown=None) -> FastAPI:
    """The FastAPI shell every role's app starts from: OpenAI-shaped errors, the body cap (413),
    request counting (outermost, so the 413s count too) and `on_shutdown` after the server stops."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title=title, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(LimitRequestBody, max_bytes=max_request_bytes)
    app.add_middleware(CountRequests, metrics=metrics)
    return app


def create_app(engine, model_name: str, metrics: ServerMetrics, default_max_tokens: int = 256, on_shutdown=None,
               max_request_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    app = base_app("jkv", metrics, max_request_bytes, on_shutdown)
    app.include_router(openai_router(_Frontend(engine, model_name, default_max_tokens)))
    app.include_router(ops_router(engine, metrics))
    return app
