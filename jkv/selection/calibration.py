"""Calibration data for the fitted selectors (InfiniGen's skew, HATA's hash weights).

`collect_calibration` prefills a calibration text and teacher-forces a dense decode over its
continuation through the model's per-layer pieces, recording every layer's decode query and
the keys those queries attend to — the distribution selection actually sees.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jkv.corpus import long_text
from jkv.selection.simple import Dense
from jkv.selection.sparse_decode import decode, prefill_to_host


@dataclasses.dataclass(frozen=True)
class Calibration:
    """queries: per layer f32[S, H, D] (RoPE applied), at query_positions i32[S];
    keys: per layer f32[N, H_kv, D] with N = query_positions[-1] + 1 (RoPE applied)."""

    queries: list[np.ndarray]
    query_positions: np.ndarray
    keys: list[np.ndarray]

    def split(self, fraction: float) -> tuple["Calibration", "Calibration"]:
        """(first, rest) by query: the first `fraction` of queries and the remainder."""
        cut = max(1, int(round(fraction * len(self.query_positions))))
        return (Calibration([q[:cut] for q in self.queries], self.query_positions[:cut], self.keys),
                Calibration([q[cut:] for q in self.queries], self.query_positions[cut:], self.keys))


def collect_calibration(model, token_ids: list[int], prompt_len: int, steps: int) -> Calibration:
    """Prefill token_ids[:prompt_len], then feed token_ids[prompt_len : prompt_len+steps] one by
    one, recording each layer's query at each step."""
    if prompt_len < 1 or steps < 1 or len(token_ids) < prompt_len + steps:
        raise ValueError(f"need prompt_len >= 1, steps >= 1 and len(token_ids)={len(token_ids)} >= "
                         f"prompt_len + steps = {prompt_len + steps}")
    num_layers = model.cfg.num_layers
    queries: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
    positions: list[int] = []

    def record(layer, q, pos):
        queries[layer].append(np.asarray(q, np.float32)[0])
        if layer == 0:
            positions.append(int(pos[0]))

    host = prefill_to_host(model, [list(token_ids[:prompt_len])], prompt_len + steps)
    forced = np.asarray([token_ids[prompt_len:prompt_len + steps]], np.int32)
    decode(model, host, Dense(), steps + 1, forced_tokens=forced, on_query=record)
    n = positions[-1] + 1
    keys = [np.ascontiguousarray(host.keys[layer][0, :, :n].transpose(1, 0, 2)) for layer in range(num_layers)]
    return Calibration([np.stack(q) for q in queries], np.asarray(positions, np.int32), keys)


def calibration_windows(model, windows: int, prompt_len: int, steps: int) -> list[Calibration]:
    """`windows` disjoint, consecutive windows of the calibration split, each prefilled with
    `prompt_len` tokens and teacher-forced for `steps` (window 0 is `collect_calibration` over
    `calibration_tokens(model, prompt_len + steps)`, the single window used before)."""
    if not (isinstance(windows, int) and windows >= 1):
        raise ValueError(f"windows={windows!r} must be an int >= 1")
    span = prompt_len + steps
    tokens = calibration_tokens(model, windows * span)
    return [collect_calibration(model, tokens[i * span:(i + 1) * span], prompt_len, steps) for i in range(windows)]


def calibration_tokens(model, num_tokens: int) -> list[int]:
    """`num_tokens` tokens of the calibration split of the local documentation corpus."""
    ids = model.tokenizer.encode(long_text("calibration"))
    if len(ids) < num_tokens:
        raise ValueError(f"calibration corpus has {len(ids)} tokens < {num_tokens=}")
    return ids[:num_tokens]
