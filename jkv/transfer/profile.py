"""Offline importance profile and the proactive budget Kr (SmartGen §4.1, DESIGN.md "Offline profile").

    I[l, m] = +inf                                  if l in {0, 1}          (SmartGen Eq. 1)
    I[l, m] = (1/|E(B_lm)|) * sum_{e in B_lm} S(e)  otherwise

S(e) counts how often entry e = (layer, KV head, token) was selected while decoding a
calibration set with the serving selector; E(B_lm) are the entries of block (l, m) (all heads
of its tokens). Profiles are grouped by prompt-length bin; serving uses the closest bin.

    Kr = M * (L - 1) * Tp / Tt, clipped to [2M, L*M]                          (SmartGen Eq. 2)

with M the blocks per layer, Tp the prefill time and Tt = bytes / bandwidth the full-transfer
time. Kr = L*M means full transfer, which a fast link reaches by itself.

A profile file is an .npz holding each bin's I[L, M] plus a JSON header (selector, model,
M, bins, Tp per bin, bandwidth assumption).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import numpy as np

from jkv.kvbuffers.geometry import BlockGeometry

log = logging.getLogger(__name__)

DENSE_LAYERS = 2  # layers 0 and 1 always use every token: importance +inf


def block_importance(counts: np.ndarray, geometry: BlockGeometry, dense_layers: int = DENSE_LAYERS) -> np.ndarray:
    """Eq. 1. counts: S(e) as f[L, H_kv, N] (selections per layer, KV head, prompt token).
    Returns I: f64[L, M_eff]; empty trailing blocks get -inf so they are never chosen."""
    counts = np.asarray(counts, np.float64)
    L, H, N = counts.shape
    if (L, N) != (geometry.num_layers, geometry.num_tokens):
        raise ValueError(f"counts shape {counts.shape} does not match the geometry (L={geometry.num_layers}, "
                         f"N={geometry.num_tokens})")
    M = geometry.blocks_per_layer
    importance = np.full((L, M), -np.inf)
    for m in range(M):
        start, stop = geometry.token_range(m)
        if start < stop:
            importance[:, m] = counts[:, :, start:stop].sum(axis=(1, 2)) / (H * (stop - start))
    importance[:min(dense_layers, L)] = np.inf
    return importance


def compute_kr(blocks_per_layer: int, num_layers: int, prefill_s: float, transfer_s: float) -> int:
    """Eq. 2: Kr = M*(L-1)*Tp/Tt clipped to [2M, L*M] (2M: the two dense layers always go)."""
    if blocks_per_layer < 1 or num_layers < 1:
        raise ValueError(f"{blocks_per_layer=} and {num_layers=} must be >= 1")
    if not prefill_s >= 0 or not transfer_s >= 0:
        raise ValueError(f"{prefill_s=} and {transfer_s=} must be >= 0 seconds")
    full = blocks_per_layer * num_layers
    if transfer_s == 0:
        return full
    kr = blocks_per_layer * (num_layers - 1) * prefill_s / transfer_s
    return int(min(full, max(min(2 * blocks_per_layer, full), math.floor(kr))))


@dataclasses.dataclass
class ProfileBin:
    """One prompt-length bin. importance: f64[L, M_eff(prompt_len)]; prefill_s: Tp measured."""

    prompt_len: int
    importance: np.ndarray
    prefill_s: float


@dataclasses.dataclass
class ImportanceProfile:
    selector: str
    model: str
    max_blocks: int
    bins: list[ProfileBin]
    bandwidth_bps: float | None = None  # the bandwidth assumption the profile was measured for
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.bins:
            raise ValueError("a profile needs at least one prompt-length bin")
        self.bins = sorted(self.bins, key=lambda b: b.prompt_len)

    def closest_bin(self, prompt_len: int) -> ProfileBin:
        return min(self.bins, key=lambda b: (abs(b.prompt_len - prompt_len), b.prompt_len))

    def importance_for(self, geometry: BlockGeometry) -> np.ndarray:
        """I[L, M_eff] for a request: the closest bin, resampled along m when its M_eff differs
        (block ids are positional relative to the prompt length)."""
        b = self.closest_bin(geometry.num_tokens)
        src = b.importance
        if src.shape[0] != geometry.num_layers:
            raise ValueError(f"profile has {src.shape[0]} layers but the model has {geometry.num_layers}; "
                             "profile the serving model with `jkv profile`")
        M = geometry.blocks_per_layer
        if src.shape[1] == M:
            return src.copy()
        pick = np.minimum((np.arange(M) + 0.5) * src.shape[1] / M, src.shape[1] - 1).astype(int)
        out = src[:, pick]
        for m in range(M):
            if geometry.is_empty(m):
                out[:, m] = -np.inf
        return out

    def prefill_time(self, prompt_len: int) -> float:
        """Tp for a prompt length: linear interpolation between bins (through the origin below
        the first bin, extrapolated linearly per token above the last)."""
        xs = [0] + [b.prompt_len for b in self.bins]
        ys = [0.0] + [b.prefill_s for b in self.bins]
        if prompt_len >= xs[-1]:
            return ys[-1] * prompt_len / xs[-1]
        return float(np.interp(prompt_len, xs, ys))

    # ---------------------------------------------------------------- file
    def save(self, path: str | os.PathLike) -> None:
        header = dict(selector=self.selector, model=self.model, max_blocks=self.max_blocks,
                      bandwidth_bps=self.bandwidth_bps, meta=self.meta,
                      bins=[dict(prompt_len=b.prompt_len, prefill_s=b.prefill_s) for b in self.bins])
        arrays = {f"importance_{i}": b.importance for i, b in enumerate(self.bins)}
        with open(path, "wb") as f:
            np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ImportanceProfile":
        try:
            data = np.load(path, allow_pickle=False)
            header = json.loads(bytes(data["header"]).decode())
            bins = [ProfileBin(b["prompt_len"], data[f"importance_{i}"], b["prefill_s"])
                    for i, b in enumerate(header["bins"])]
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a jkv importance profile ({e}); create one with `jkv profile`") from e
        return cls(header["selector"], header["model"], header["max_blocks"], bins, header.get("bandwidth_bps"),
                   header.get("meta", {}))


class _RecordingSelector:
    """Delegates to a selector and accumulates S(e) for every select() (prompt tokens only)."""

    def __init__(self, selector, counts: np.ndarray, prompt_len: int):
        self._inner, self.counts, self.prompt_len = selector, counts, prompt_len
        self.config, self.is_dense = selector.config, selector.is_dense

    def prepare(self, *a):
        return self._inner.prepare(*a)

    def append(self, *a):
        return self._inner.append(*a)

    def decode_query(self, *a):
        return self._inner.decode_query(*a)

    def select(self, layer, q, metadata, lengths):
        index = self._inner.select(layer, q, metadata, lengths)
        rows = np.asarray(index)  # [H_kv, k] for a batch of one
        for h, row in enumerate(rows):
            row = row[(row >= 0) & (row < self.prompt_len)]
            np.add.at(self.counts[layer, h], row, 1.0)
        return index


def selection_counts(model, selector, prompt: list[int], steps: int) -> np.ndarray:
    """S(e) for one calibration prompt: f64[L, H_kv, N] selection counts over `steps` decode steps."""
    from jkv.selection.sparse_decode import decode, prefill_to_host

    cfg = model.cfg
    counts = np.zeros((cfg.num_layers, cfg.num_kv_heads, len(prompt)))
    host = prefill_to_host(model, [list(prompt)], len(prompt) + steps)
    decode(model, host, _RecordingSelector(selector, counts, len(prompt)), steps + 1)
    return counts


def measure_prefill(model, prompt_len: int, repeats: int = 2) -> float:
    """Tp: best-of-`repeats` wall time of one prefill of `prompt_len` tokens (after a warm-up)."""
    tokens = np.ones((1, prompt_len), np.int32)
    lengths = np.asarray([prompt_len], np.int32)
    best = math.inf
    for i in range(repeats + 1):
        t = time.perf_counter()
        logits, kv = model.prefill(tokens, lengths)
        np.asarray(logits)
        if i:
            best = min(best, time.perf_counter() - t)
    return best


def build_profile(model, selector, selector_name: str, prompts_by_bin: dict[int, list[list[int]]], steps: int,
                  max_blocks: int = 1024, bandwidth_bps: float | None = None, model_name: str = "") -> ImportanceProfile:
    """Profile `selector` on calibration prompts grouped by bin length (each prompt of a bin is
    cut to the bin's length). Returns the ImportanceProfile (Eq. 1 per bin, Tp per bin)."""
    bins = []
    for prompt_len, prompts in sorted(prompts_by_bin.items()):
        if not prompts:
            raise ValueError(f"bin {prompt_len} has no calibration prompts")
        geometry = BlockGeometry(prompt_len, model.cfg.num_layers, max_blocks)
        counts = sum(selection_counts(model, selector, p[:prompt_len], steps) for p in prompts)
        tp = measure_prefill(model, prompt_len)
        log.info("profile bin %d: %d prompts, Tp=%.3fs", prompt_len, len(prompts), tp)
        bins.append(ProfileBin(prompt_len, block_importance(counts, geometry), tp))
    return ImportanceProfile(selector_name, model_name or model.name, max_blocks, bins, bandwidth_bps,
                             dict(steps=steps))
