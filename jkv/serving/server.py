"""OpenAI-compatible HTTP API over an engine: the colocated `ContinuousBatcher` (`jkv serve --role all`)
or the disaggregated `DisaggBatcher` (`--role decode`, `--role all --disaggregation`); both take
`submit(EngineRequest)` / `cancel(request_id)` and emit `StreamEvent`s. A router's
`X-JKV-Prefill-Worker` header becomes `EngineRequest.kv_owner` (the prefill worker to own the KV).

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming or one JSON body),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

Concurrency. Handlers run on uvicorn's single asyncio event loop. Each HTTP request turns into
n x prompts engine requests that are `submit`ted to the batcher (thread-safe queue); their
`StreamEvent`s come back on the engine thread and are handed to this loop by `AsyncSink`
(`loop.call_soon_threadsafe(queue.put_nowait, event)`), one asyncio.Queue per HTTP request.
Nothing here touches the device. If the client goes away (a streaming write fails, or a
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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batcher import ContextLengthError, ContinuousBatcher, EngineRequest, StreamEvent
from .metrics import ServerMetrics
from . import protocol as P

log = logging.getLogger(__name__)
PREFILL_WORKER_HEADER = "x-jkv-prefill-worker"  # router -> decode: transport address of the chosen prefill worker
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


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

    def submit(self, prompts_ids: list[list[int]], params_for) -> None:
        for p, ids in enumerate(prompts_ids):
            for c, sp in enumerate(params_for(p, ids)):
                rid = P.new_id("req")
                self.index[rid] = len(self.index)
                self.open.add(rid)
                self.engine.submit(EngineRequest(rid, ids, sp, self.sink.emit, kv_owner=self.kv_owner))

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


def create_app(engine, model_name: str, metrics: ServerMetrics,
               default_max_tokens: int = 256, on_shutdown=None) -> FastAPI:
    tok = engine.model.tokenizer
    vocab = engine.model.cfg.vocab_size
    max_len = engine.config.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="jkv", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(CountRequests, metrics=metrics)

    def check_model(name: str | None):
        if name is not None and name != model_name:
            raise P.RequestError(f"The model `{name}` does not exist; this server serves `{model_name}`",
                                 status=404, param="model", type_="not_found_error", code="model_not_found")

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tok is None:
                raise P.RequestError("this model has no tokenizer; send the prompt as token ids", param="prompt")
            ids = tok.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise P.RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        if not ids:
            raise P.RequestError("the prompt is empty (0 tokens); give at least one token", param="prompt")
        return ids

    def plan(body: P.SamplingFields, prompts_ids: list[list[int]], requested: int | None, default: int):
        def params_for(p, ids):
            max_tokens = requested if requested is not None else max(1, min(default, max_len - len(ids)))
            try:
                engine.check_request(len(ids), max_tokens)
                return [body.sampling(max_tokens, c) for c in range(body.n)]
            except ContextLengthError as e:
                raise P.RequestError(str(e), param="messages" if isinstance(body, P.ChatRequest) else "prompt",
                                     code="context_length_exceeded") from None
            except ValueError as e:
                raise P.RequestError(str(e)) from None
        planned = [params_for(p, ids) for p, ids in enumerate(prompts_ids)]  # validate everything first
        return lambda p, ids: planned[p]

    async def run(request: Request, body: P.SamplingFields, prompts_ids, params_for, chat: bool):
        job = _Job(engine, asyncio.get_running_loop(), request.headers.get(PREFILL_WORKER_HEADER))
        try:
            job.submit(prompts_ids, params_for)
        except (RuntimeError, ContextLengthError) as e:
            job.cancel_open()
            return P.error_response(str(e), 503 if isinstance(e, RuntimeError) else 400)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        n_prompt = sum(len(ids) for ids in prompts_ids)
        if body.stream:
            return StreamingResponse(_stream(job, rid, body, n_prompt, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, job, rid, n_prompt, chat)

    async def _collect(request: Request, job: _Job, rid: str, n_prompt: int, chat: bool):
        texts: dict[int, list[str]] = {}
        finals: dict[int, StreamEvent] = {}

        async def gather():
            async for i, ev in job.events():
                texts.setdefault(i, []).append(ev.text)
                if ev.finish_reason is not None:
                    finals[i] = ev

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
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # client went away; nobody reads this
        errors = [ev.error for ev in finals.values() if ev.finish_reason == "error"]
        if errors:
            return P.error_response(errors[0], 500, type_="server_error")
        choices = []
        for i in sorted(finals):
            ev = finals[i]
            text = ev.final_text if ev.final_text is not None else "".join(texts[i])
            choices.append(P.chat_choice(i, text, ev.finish_reason) if chat
                           else P.completion_choice(i, text, ev.finish_reason))
        use = P.usage(n_prompt, sum(ev.completion_tokens for ev in finals.values()))
        return JSONResponse(P.chat_body(rid, model_name, choices, use) if chat
                            else P.completion_body(rid, model_name, choices, use))

    async def _stream(job: _Job, rid: str, body: P.SamplingFields, n_prompt: int, chat: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        completion_tokens = 0
        try:
            if chat:
                for i in range(len(job.index)):
                    yield sse(P.chat_chunk(rid, model_name, [P.chat_delta(i, {"role": "assistant", "content": ""},
                                                                          None)]))
            async for i, ev in job.events():
                if ev.finish_reason == "error":
                    yield sse(P.error_body(ev.error or "engine error", "server_error"))
                    job.cancel_open()
                    return
                reason = ev.finish_reason if ev.finish_reason != "cancelled" else "abort"
                if ev.finish_reason is not None:
                    completion_tokens += ev.completion_tokens
                if not ev.text and ev.finish_reason is None:
                    continue
                if chat:
                    delta = {"content": ev.text} if ev.text else {}
                    yield sse(P.chat_chunk(rid, model_name, [P.chat_delta(i, delta, reason)]))
                else:
                    yield sse(P.completion_chunk(rid, model_name, [P.completion_choice(i, ev.text, reason)]))
            if body.include_usage:
                use = P.usage(n_prompt, completion_tokens)
                chunk = P.chat_chunk if chat else P.completion_chunk
                yield sse(chunk(rid, model_name, [], use))
            yield "data: [DONE]\n\n"
        finally:
            job.cancel_open()  # client disconnect (GeneratorExit/CancelledError) lands here too

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo:
            raise P.RequestError("echo=true is not supported", param="echo")
        prompts_ids = [encode(p) for p in body.prompts()]
        params_for = plan(body, prompts_ids, body.max_tokens, 16)  # OpenAI's completions default is 16
        return await run(request, body, prompts_ids, params_for, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatRequest, request: Request):
        check_model(body.model)
        if tok is None or not tok.chat_template:
            raise P.RequestError("this model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = tok.apply_chat_template(messages)
        except ValueError as e:
            raise P.RequestError(f"the chat template rejected the messages: {e}", param="messages") from None
        requested = body.max_completion_tokens or body.max_tokens
        params_for = plan(body, [ids], requested, default_max_tokens)
        return await run(request, body, [ids], params_for, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": P.now(),
                                            "owned_by": "jkv", "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        extra = engine.health() if hasattr(engine, "health") else {}
        return {"status": "ok", "role": metrics.role, "running": engine.num_running, "waiting": engine.num_waiting,
                **extra}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
