"""Streaming-head pruning at request level (DuoAttention, Xiao et al. 2024; KVServe §5.1 MixHQ).

DuoAttention splits KV heads into *retrieval* heads, which need the whole context, and *streaming*
heads, which attend only to the attention sinks (the first `sink` tokens) and a window of the
`recent` last tokens. For KV transfer this means a streaming head's middle tokens never cross the
wire: only `sink + recent` of its N tokens are sent, and the decode side attends, per head, to
exactly the tokens it received plus the ones it generates (`MaskedDecoder`).

The heads are classified per request from the prefill's own last queries (an observation window,
SnapKV-style: `heads.observation_queries` + `heads.retrieval_scores`), so no future information is
used. Kept tokens are compressed with any per-head-uniform pipeline (kivi/tok/ch/ec/none), so the
pruning composes with quantization; the compression ratio counts every byte: the manifest (JSON
with the retrieval table), each retrieval head group's chunk containers and the streaming heads'
sink + recent containers.

    plan = StreamingPlan.from_scores(scores, streaming_fraction=0.5, sink=16, recent=64)
    blob = encode_request(pipe, plan, kv16, chunk_tokens=128)           # list of bytes
    kv, keep = decode_request(blob)     # kv: per layer (K, V) f32[H_kv, N, D] (0 where dropped)
                                        # keep: bool[L, H_kv, N]

The pruned KV is only usable by a decoder that masks per head (`MaskedDecoder` here; on the
serving path the decode worker's DROPPED mask entries, jkv/compression/dropping.py). No threads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jkv.compression.heads import classify_heads
from jkv.compression.pipeline import Pipeline, decode_block

MANIFEST_MAGIC = "jkv.streaming.v1"


@dataclass(frozen=True)
class StreamingConfig:
    """How a request is pruned: the `fraction` of heads with the lowest observation-window
    retrieval score stream (keep `sink` + `recent` tokens); scores from the last `window` queries."""

    fraction: float = 0.5
    sink: int = 16
    recent: int = 64
    window: int = 32

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"StreamingConfig {self.fraction=} must be in [0, 1]")
        if self.sink < 0 or self.recent < 1 or self.window < 1:
            raise ValueError(f"StreamingConfig needs {self.sink=} >= 0, {self.recent=} >= 1, {self.window=} >= 1")

    @property
    def id(self) -> str:
        return f"duo{round(100 * self.fraction)}s{self.sink}w{self.recent}"


@dataclass(frozen=True)
class StreamingPlan:
    """retrieval: bool [L][H_kv] (True = keep every token); streaming heads keep `sink` + `recent`."""

    retrieval: tuple[tuple[bool, ...], ...]
    sink: int = 16
    recent: int = 64

    def __post_init__(self):
        if not self.retrieval or any(not row for row in self.retrieval) or len({len(r) for r in self.retrieval}) != 1:
            raise ValueError("StreamingPlan.retrieval must be a non-empty rectangular bool table [L][H_kv]")
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"streaming heads need {self.sink=} >= 0 and {self.recent=} >= 1")

    @classmethod
    def from_scores(cls, scores: np.ndarray, streaming_fraction: float, sink: int = 16,
                    recent: int = 64) -> "StreamingPlan":
        """The `streaming_fraction` of heads with the lowest retrieval score f32[L, H_kv] stream."""
        if not 0.0 <= streaming_fraction <= 1.0:
            raise ValueError(f"{streaming_fraction=} must be in [0, 1]")
        retrieval = classify_heads(scores, 1.0 - streaming_fraction)
        return cls(tuple(tuple(bool(r) for r in row) for row in retrieval), sink, recent)

    def stream_positions(self, n: int) -> np.ndarray:
        """i64[k]: the token positions a streaming head keeps (sinks, then the recent window)."""
        j = np.arange(n)
        return np.flatnonzero((j < self.sink) | (j >= n - self.recent))

    def keep_mask(self, n: int) -> np.ndarray:
        """bool[L, H_kv, n]: the tokens each head keeps for a request of n tokens."""
        stream = np.zeros(n, dtype=bool)
        stream[self.stream_positions(n)] = True
        table = np.asarray(self.retrieval, dtype=bool)
        return np.where(table[:, :, None], True, stream[None, None, :])

    def to_json(self) -> dict:
        return {"format": MANIFEST_MAGIC, "sink": self.sink, "recent": self.recent,
                "retrieval": ["".join("r" if r else "s" for r in row) for row in self.retrieval]}

    @classmethod
    def from_json(cls, obj: dict) -> "StreamingPlan":
        if obj.get("format") != MANIFEST_MAGIC:
            raise ValueError(f"not a streaming manifest: format {obj.get('format')!r}, expected {MANIFEST_MAGIC!r}")
        rows = obj["retrieval"]
        if not all(isinstance(r, str) and set(r) <= {"r", "s"} for r in rows):
            raise ValueError("streaming manifest: retrieval rows must be strings of 'r'/'s'")
        return cls(tuple(tuple(c == "r" for c in row) for row in rows), int(obj["sink"]), int(obj["recent"]))


def _check_pipe(pipe: Pipeline) -> None:
    if pipe.spec.quantizer.method in ("mixed", "mixhq"):
        raise ValueError(f"{pipe.id}: streaming pruning encodes head subsets; use a per-head-uniform quantizer "
                         "(none/tok/ch/kivi/ec), not a per-head table")


def encode_request(pipe: Pipeline, plan: StreamingPlan, kv16, chunk_tokens: int = 128) -> list[bytes]:
    """kv16: per layer (K, V) [H_kv, N, D] -> [manifest, then per layer: retrieval-head chunk
    containers (K, V alternating) and, if any, the streaming heads' kept-token containers (K, V)]."""
    _check_pipe(pipe)
    if len(kv16) != len(plan.retrieval):
        raise ValueError(f"plan covers {len(plan.retrieval)} layers; the request has {len(kv16)}")
    n = kv16[0][0].shape[1]
    manifest = dict(plan.to_json(), n=n, chunk_tokens=chunk_tokens)
    out = [json.dumps(manifest, separators=(",", ":")).encode()]
    stream_pos = plan.stream_positions(n)
    for layer, (k, v) in enumerate(kv16):
        row = np.asarray(plan.retrieval[layer])
        if k.shape[0] != len(row):
            raise ValueError(f"layer {layer}: plan has {len(row)} heads, KV has H_kv={k.shape[0]}")
        ret, stream = np.flatnonzero(row), np.flatnonzero(~row)
        if ret.size:
            for start in range(0, n, chunk_tokens):
                for kind, x in (("k", k), ("v", v)):
                    out.append(pipe.encode_block(x[ret, start:start + chunk_tokens], layer=layer, kind=kind))
        if stream.size:
            for kind, x in (("k", k), ("v", v)):
                out.append(pipe.encode_block(x[stream][:, stream_pos], layer=layer, kind=kind))
    return out


def decode_request(blobs: list[bytes]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Inverse of `encode_request`: (per layer (K, V) f32[H_kv, N, D], keep bool[L, H_kv, N])."""
    try:
        manifest = json.loads(blobs[0].decode())
        plan = StreamingPlan.from_json(manifest)
        n, chunk = int(manifest["n"]), int(manifest["chunk_tokens"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"streaming request: bad manifest ({e})") from None
    keep = plan.keep_mask(n)
    stream_pos = plan.stream_positions(n)
    it = iter(blobs[1:])
    kv = []
    for row in plan.retrieval:
        row = np.asarray(row)
        ret, stream = np.flatnonzero(row), np.flatnonzero(~row)
        parts = {}
        chunks = {"k": [], "v": []}
        if ret.size:
            for _ in range(0, n, chunk):
                for kind in ("k", "v"):
                    chunks[kind].append(np.asarray(decode_block(next(it)), np.float32))
        tails = {}
        if stream.size:
            for kind in ("k", "v"):
                tails[kind] = np.asarray(decode_block(next(it)), np.float32)
        for kind in ("k", "v"):
            first = chunks[kind][0] if chunks[kind] else tails[kind]
            full = np.zeros((len(row), n, first.shape[2]), np.float32)
            if ret.size:
                full[ret] = np.concatenate(chunks[kind], axis=1)
            if stream.size:
                full[np.ix_(stream, stream_pos)] = tails[kind]
            parts[kind] = full
        kv.append((parts["k"], parts["v"]))
    if next(it, None) is not None:
        raise ValueError("streaming request: more containers than the manifest implies")
    return kv, keep


def request_bytes(blobs: list[bytes]) -> int:
    """Every byte of an encoded request (manifest included)."""
    return sum(len(b) for b in blobs)


class MaskedDecoder:
    """Decode on top of a pruned cache: each (layer, KV head) attends to its kept tokens + new ones.

    kv: per layer (K, V) [H_kv, N, D]; keep: bool[L, H_kv, N]. Tokens are compacted per head to the
    front of a [1, H_kv, n_keep_max + steps, D] buffer; `Model.attend_and_mlp` masks by the per-head
    valid count (the same entry point jkv's sparse decode uses).
    """

    def __init__(self, model, kv, keep: np.ndarray, max_new: int):
        self.model = model
        keep = np.asarray(keep, dtype=bool)
        n_layers, h, n = keep.shape
        if len(kv) != n_layers:
            raise ValueError(f"keep covers {n_layers} layers; kv has {len(kv)}")
        self.n = n
        self.count = keep.sum(-1).astype(np.int32)  # [L, H_kv]
        cap = int(self.count.max()) + max_new
        dtype = model.cfg.dtype
        self.K, self.V = [], []
        for layer, (k, v) in enumerate(kv):
            ks = np.zeros((1, h, cap, k.shape[2]), np.float32)
            vs = np.zeros_like(ks)
            for head in range(h):
                idx = np.flatnonzero(keep[layer, head])
                ks[0, head, :idx.size] = np.asarray(k[head], np.float32)[idx]
                vs[0, head, :idx.size] = np.asarray(v[head], np.float32)[idx]
            self.K.append(jnp.asarray(ks, dtype))
            self.V.append(jnp.asarray(vs, dtype))
        self.step_index = 0

    def step(self, token: int) -> np.ndarray:
        """Feed `token` at position n + steps so far; returns the next-token logits f32[V]."""
        m, pos = self.model, self.n + self.step_index
        heads = jnp.arange(self.count.shape[1])
        x = m.embed(jnp.asarray([int(token)]))
        for layer in range(len(self.K)):
            q, k, v = m.qkv(layer, x, jnp.asarray([pos]))
            slot = jnp.asarray(self.count[layer])
            self.K[layer] = self.K[layer].at[0, heads, slot].set(k[0].astype(self.K[layer].dtype))
            self.V[layer] = self.V[layer].at[0, heads, slot].set(v[0].astype(self.V[layer].dtype))
            self.count[layer] += 1
            x = m.attend_and_mlp(layer, x, q, self.K[layer], self.V[layer], jnp.asarray(self.count[layer][None]))
        self.step_index += 1
        return np.asarray(m.logits(x)[0], np.float32)
