"""OpenAI wire format: request models (validated by pydantic), response/chunk builders, errors.

Only the fields jkv implements are accepted with meaning; unknown extra fields are ignored (as
the OpenAI API does for forward compatibility). Errors use OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import time
import uuid
from typing import Callable, Literal, Optional, Sequence, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM extension; 0/-1 disables
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=16)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # vLLM extension
    slo_ms: Optional[float] = Field(default=None, gt=0)  # jkv extension: TTFT target for --schedule edf/lstf

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestError("stop must be up to 4 non-empty strings", param="stop")
        return stops

    def sampling(self, max_tokens: int, choice: int) -> SamplingParams:
        # n > 1 with a seed: choice i uses seed + i, so choices differ yet the request is reproducible.
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=seed, stop=self.stop_list(),
                              ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_TOP_LOGPROBS = 20  # OpenAI's cap for top_logprobs


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0 only with echo: score the prompt
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_scoring(self):
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens=0 generates nothing; it is only allowed with echo=true (to score the "
                               "prompt with logprobs)", param="max_tokens")

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"content part {i} has type {part.get('type')!r}; only text parts are supported",
                                   param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprob_count(self) -> int | None:
        """Top alternatives per token when logprobs are wanted, else None."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class RequestError(Exception):
    """A client error to return in OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status, self.param, self.type, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(message: str, status: int, param: str | None = None, type_: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices,
            "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(rid: str, model: str, choices: list[dict], use: dict | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
            "usage": use}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_chunk(rid: str, model: str, choices: list[dict], use: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def chat_delta(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_logprobs(entries: Sequence, token_text: Callable[[int], str], ids: Sequence[int],
                        offset: int = 0) -> dict:
    """OpenAI completions `logprobs` for tokens `ids` (entries: their `TokenLogprob`, or None where a
    token has none: the first prompt token). text_offset counts characters from `offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, e in zip(ids, entries):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(None if e is None else e.logprob)
        tops.append(None if e is None else {token_text(t): lp for t, lp in e.top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence, token_text: Callable[[int], str]) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries]}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI validation errors -> (message naming the field, param)."""
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or field
        if e.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})")
            param = "body"
        else:
            parts.append(f"{field}: {e.get('msg')} (got {e.get('input')!r:.60})")
    return "; ".join(parts), param
