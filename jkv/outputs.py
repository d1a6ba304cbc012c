"""Results returned by `LLM.generate()`."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timings in seconds, measured from the moment generate() accepted the request.

    ttft: time to first token; ttst: time to second token (includes any prefill->decode stall);
    tbt: gaps between consecutive tokens after the first (tbt[0] is first->second);
    ctl: cumulative latency at each token (ctl[i] = time token i was ready).
    """

    prompt_tokens: int = 0
    ttft: float = 0.0
    ttst: float | None = None
    tbt: list[float] = dataclasses.field(default_factory=list)
    ctl: list[float] = dataclasses.field(default_factory=list)
    e2e: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def mean_tbt(self) -> float:
        later = self.tbt[1:] if len(self.tbt) > 1 else self.tbt  # TBT excludes the second token
        return float(np.mean(later)) if later else 0.0

    @classmethod
    def from_token_times(cls, prompt_tokens: int, times: list[float], **extra) -> "RequestMetrics":
        ttft = times[0] if times else 0.0
        return cls(prompt_tokens=prompt_tokens, ttft=ttft, ttst=times[1] if len(times) > 1 else None,
                   tbt=[b - a for a, b in zip(times, times[1:])], ctl=list(times),
                   e2e=times[-1] if times else 0.0, extra=dict(extra))


@dataclasses.dataclass
class RequestOutput:
    """One finished request: generated text and ids, why it stopped, and its timings."""

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string/token) or "length" (max_tokens)
    metrics: RequestMetrics
