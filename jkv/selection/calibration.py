"""Calibration data for the fitted selectors (InfiniGen's skew, HATA's hash weights).

`collect_calibration` prefills a calibration text and teacher-forces a dense decode over its
continuation through the model's per-layer pieces, recording every layer's decode query and
the keys those queries attend to — the distribution selection actually sees.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jkv.corpus import code_text, long_text
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


# The prose+code calibration mix (issue 23): code (the calibration half of the stdlib files) and
# prose (the corpus' calibration split) at 1K and 2K, in this order -- training on the windows in
# turn ends on prose at the longest length. With 192 decode queries each it holds 768 queries, as
# many as `jkv train-hata`'s 4 corpus windows of 1024 + 192.
MIX_WINDOWS: tuple[tuple[str, int], ...] = (("code", 1024), ("corpus", 1024), ("code", 2048), ("corpus", 2048))
MIX_STEPS = 192


def mix_spans(sources: dict[str, list[int]], windows=MIX_WINDOWS, steps: int = MIX_STEPS) -> list[list[int]]:
    """Token spans of the mix: for each (source, prompt_len) of `windows`, the next
    prompt_len + steps tokens of sources[source], so spans of one source are disjoint and
    consecutive from its start."""
    offset = {name: 0 for name in sources}
    spans = []
    for name, prompt_len in windows:
        if name not in sources:
            raise ValueError(f"window source {name!r} is not one of {sorted(sources)}")
        ids = sources[name]
        end = offset[name] + prompt_len + steps
        if end > len(ids):
            raise ValueError(f"source {name!r} has {len(ids)} tokens < {end} needed by windows={windows}")
        spans.append(list(ids[offset[name]:end]))
        offset[name] = end
    return spans


def mixed_calibration_windows(model, windows=MIX_WINDOWS, steps: int = MIX_STEPS) -> list[Calibration]:
    """`collect_calibration` over `mix_spans` of the corpus' calibration split ('corpus') and the
    calibration half of the stdlib code ('code'), each window prefilled with its prompt_len
    tokens and teacher-forced for `steps`. Cost on CPU (SmolLM2-135M, 2 loaded cores): ~40 s per
    1K window, ~70 s per 2K window."""
    need = {name: sum(n + steps for s, n in windows if s == name) for name in ("corpus", "code")}
    code = code_text("calibration")
    # Encode only a prefix with ample margin (>= 8 characters a token; code averages ~3): BPE
    # splits at pre-token boundaries, so the first tokens equal those of encoding all of it.
    code_ids = model.tokenizer.encode(code[:16 * need["code"]])
    if len(code_ids) < need["code"] + 64:
        code_ids = model.tokenizer.encode(code)
    sources = {"corpus": calibration_tokens(model, need["corpus"]), "code": code_ids}
    return [collect_calibration(model, span, prompt_len, steps)
            for span, (_, prompt_len) in zip(mix_spans(sources, windows, steps), windows)]


def joint_windows(corpus: list, broad: list, windows=MIX_WINDOWS) -> list:
    """The joint calibration (docs/selection.md, 'Held-out domain'): `corpus` (calibration_windows,
    `jkv train-hata`'s default 1024 + 192 windows) and `broad` (mixed_calibration_windows over
    `windows`) less its ("corpus", 1024) window, whose tokens are corpus window 0's, alternating
    corpus and broad windows so that training on them interleaved sees both lengths and domains
    throughout: for 4 corpus windows and MIX_WINDOWS, 7 windows of 192 queries."""
    if len(broad) != len(windows):
        raise ValueError(f"broad has {len(broad)} windows but windows={windows} names {len(windows)}")
    rest = [w for spec, w in zip(windows, broad) if tuple(spec) != ("corpus", 1024)]
    pairs = [w for pair in zip(corpus, rest) for w in pair]
    return pairs + list(corpus[len(rest):]) + list(rest[len(corpus):])
