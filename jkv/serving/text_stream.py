"""Incremental detokenization with stop-string hold-back, for streaming token deltas.

`TextStream.push(token_id)` returns the text that is now safe to send to the client and, when
the request is over, why. Text is held back while it (a) ends in an incomplete UTF-8 sequence
(the byte-level decoder renders it as U+FFFD) or (b) ends with a prefix of a stop string, which
the next tokens may complete. The final text equals what `DenseEngine` returns for the same ids:
the same order of checks (stop token/EOS, then stop strings, then max_tokens) on the same
decoded text, so streaming and `LLM.generate()` agree.

Pure Python, no threads; owned by the engine thread.
"""
from __future__ import annotations

from typing import Sequence

from ..sampling import SamplingParams


def _held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Per-request detokenizer + stop checker. `tokenizer` may be None (token-id-only models)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: Sequence[int]):
        self.tok = tokenizer
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.ids: list[int] = []  # every generated id, including a final stop/EOS id
        self.sent = 0  # characters of text already returned
        self.finish_reason: str | None = None
        self.text = ""  # final text once finished

    @property
    def output_ids(self) -> list[int]:
        """Generated ids the client sees (a terminating stop/EOS id excluded)."""
        if self.ids and self.finish_reason == "stop" and self.ids[-1] in self.stop_ids:
            return self.ids[:-1]
        return list(self.ids)

    def _decode(self, ids) -> str:
        return self.tok.decode(ids) if self.tok is not None else ""

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the newly safe text delta (maybe ""). Sets finish_reason."""
        assert self.finish_reason is None, "push() after the stream finished"
        self.ids.append(int(token_id))
        if self.ids[-1] in self.stop_ids:
            self.finish_reason = "stop"
            return self._finish(self._decode(self.ids[:-1]))
        text = self._decode(self.ids)
        for s in self.params.stop:
            i = text.find(s)
            if i >= 0:
                self.finish_reason = "stop"
                return self._finish(text[:i])
        if len(self.ids) >= self.params.max_tokens:
            self.finish_reason = "length"
            return self._finish(text)
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":  # incomplete multi-byte character
            safe -= 1
        safe = max(self.sent, safe - _held_suffix_len(text[:safe], self.params.stop))
        delta = text[self.sent:safe]
        self.sent = safe
        return delta

    def _finish(self, text: str) -> str:
        self.text = text
        delta = text[self.sent:] if len(text) >= self.sent else ""
        self.sent = len(text)
        return delta
