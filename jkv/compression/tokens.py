"""Token-importance precision tiers per request (SnapKV observation window deciding bits and drops).

SnapKV (Li et al. 2024) observes that the attention of a prompt's last W queries (the *observation
window*) over the earlier keys predicts which tokens later decode steps attend to, per head. Here
that importance decides, per (layer, KV head), how each token crosses the wire:

- tier 2 ("hi"): the attention sinks (first `sink` tokens), the `recent` last tokens and the top
  `hi_frac` of the middle tokens by importance — encoded with the `hi` pipeline;
- tier 1 ("lo"): the next `lo_frac` of the middle tokens — encoded with the `lo` pipeline (e.g. 2 bits);
- tier 0: the rest — dropped (the decode side attends to the kept tokens only, `MaskedDecoder`).

DuoAttention's streaming heads are the special case of a head whose middle tokens are all dropped;
here every head keeps its own most-attended tokens instead, so a retrieval head is not all-or-nothing.
The importance of middle token j for KV head h is the observation-window attention mass summed over
the W queries and the query heads of h's GQA group, max-pooled over `pool` neighbouring tokens
(SnapKV's clustering: a selected token brings its neighbours, which keeps identifiers and literals
whole). No future token is used: the queries are the prefill's own (`heads.observation_queries`).

Every tier of a layer holds the same number of tokens for every head, so a tier is one block
[H_kv, n_tier, D] (tokens gathered per head in ascending position) through any pipeline, per-layer
`mixed-` tables included. Bytes, all counted by `request_bytes`: a JSON manifest, the zstd-coded
tier table u8[L, H_kv, N], and per layer the hi K, hi V (and lo K, lo V) containers.

    cfg = TierConfig(hi="hadamard+kivi4g128+zstdh3", lo="hadamard+kivi2g128+zstdh3", hi_frac=0.2, lo_frac=0.3)
    imp = token_importance(model, prompt, kv16, window=cfg.window, pool=cfg.pool)   # f32[L, H_kv, N]
    blobs = encode_request(cfg, plan_tiers(imp, cfg), kv16)                         # list of bytes
    kv, keep = decode_request(blobs)            # per layer (K, V) f32[H_kv, N, D]; keep bool[L, H_kv, N]

No threads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from jkv.compression.codecs import get_codec
from jkv.compression.pipeline import Pipeline, decode_block
from jkv.compression.spec import CodecSpec, PipelineSpec

MANIFEST_MAGIC = "jkv.tokentiers.v1"
TABLE_CODEC = CodecSpec("zstd", 19)


@dataclass(frozen=True)
class TierConfig:
    """hi / lo: pipeline ids of the two kept tiers (lo None: no lo tier); hi_frac / lo_frac: shares
    of the *middle* tokens (neither sink nor recent) per head; window / pool: SnapKV's observation
    window and pooling kernel. A point of the profile search space (`id`, `features`, `nominal_cr`)."""

    hi: str = "hadamard+kivi4g128+zstdh3"
    lo: str | None = "hadamard+kivi2g128+zstdh3"
    hi_frac: float = 0.2
    lo_frac: float = 0.3
    sink: int = 16
    recent: int = 64
    window: int = 32
    pool: int = 7

    def __post_init__(self):
        for name in ("hi", "lo"):
            text = getattr(self, name)
            if text is None and name == "lo":
                continue
            spec = PipelineSpec.parse(text)  # raises naming the bad id
            if spec.quantizer.method == "mixhq":
                raise ValueError(f"TierConfig.{name}={text!r}: write MixHQ as an explicit mixed-<table> id "
                                 "(the tier blocks need no calibration state)")
        if not (0 <= self.hi_frac <= 1 and 0 <= self.lo_frac <= 1 and self.hi_frac + self.lo_frac <= 1):
            raise ValueError(f"TierConfig needs 0 <= hi_frac, lo_frac and hi_frac + lo_frac <= 1; got "
                             f"{self.hi_frac=}, {self.lo_frac=}")
        if self.lo is None and self.lo_frac:
            raise ValueError(f"TierConfig: lo_frac={self.lo_frac} needs a lo pipeline (or lo_frac=0)")
        if self.sink < 0 or self.recent < 1 or self.window < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"TierConfig needs sink >= 0, recent >= 1, window >= 1 and an odd pool >= 1; got "
                             f"{self.sink=}, {self.recent=}, {self.window=}, {self.pool=}")

    # ---- the profile search's view of a spec (profiling.bayesian_search / nominal_cr)
    @property
    def hi_spec(self) -> PipelineSpec:
        return PipelineSpec.parse(self.hi)

    @property
    def lo_spec(self) -> PipelineSpec | None:
        return PipelineSpec.parse(self.lo) if self.lo else None

    @property
    def id(self) -> str:
        lo = f"+lo{round(100 * self.lo_frac)}:{self.lo}" if self.lo and self.lo_frac else ""
        return (f"tiers:hi{round(100 * self.hi_frac)}:{self.hi}{lo}:s{self.sink}w{self.recent}"
                f"o{self.window}p{self.pool}")

    def __str__(self) -> str:
        return self.id

    @property
    def codec(self) -> CodecSpec:
        return self.hi_spec.codec

    @property
    def family(self) -> str:
        """The BO's pruning family: tiers never share one with a plain pipeline."""
        return f"tiers/{self.hi_spec.quantizer.method}"

    def features(self) -> dict:
        hi = {f"hi_{k}": v for k, v in self.hi_spec.features().items()}
        lo_bits = self.lo_spec.quantizer.mean_bits() if self.lo_spec else 0.0
        return {**hi, "tiers": "tiers", "hi_frac": float(self.hi_frac), "lo_frac": float(self.lo_frac),
                "lo_bits": float(lo_bits)}

    def shares(self, n: int) -> tuple[float, float]:
        """(hi, lo) fraction of a head's n tokens kept in each tier."""
        n_hi, n_lo = tier_counts(self, n)
        return n_hi / n, n_lo / n

    def nominal_cr(self, shape: tuple[int, int, int], itemsize: int = 2, n: int = 512) -> float:
        """Layout CR of the kept tiers (`profiling.nominal_cr` of each pipeline, weighted by its
        share of the tokens); the manifest and the tier table are left to the measurement."""
        from jkv.compression.profiling import nominal_cr

        hi, lo = self.shares(n)
        per_byte = hi / nominal_cr(self.hi_spec, shape, itemsize)
        if self.lo_spec is not None and lo:
            per_byte += lo / nominal_cr(self.lo_spec, shape, itemsize)
        return 1.0 / max(per_byte, 1e-9)


def tier_counts(cfg: TierConfig, n: int) -> tuple[int, int]:
    """(hi, lo) tokens per head for a request of n tokens (sinks + recent count as hi)."""
    edge = min(n, cfg.sink + cfg.recent)
    middle = n - edge
    n_hi_mid = int(round(cfg.hi_frac * middle))
    n_lo = int(round(cfg.lo_frac * middle)) if cfg.lo else 0
    return edge + n_hi_mid, min(n_lo, middle - n_hi_mid)


def importance_from_queries(q: np.ndarray, k_layers, pool: int = 7) -> np.ndarray:
    """f32[L, H_kv, N]: observation-window attention of q f32[L, H, W, D] (the last W positions)
    over each layer's keys f32[H_kv, N, D], summed over the W queries and the GQA group, max-pooled."""
    from jkv.compression.heads import attention_probs

    n = k_layers[0].shape[1]
    q_pos = np.arange(n - q.shape[2], n)
    out = []
    for layer, k in enumerate(k_layers):
        probs = attention_probs(q[layer], np.asarray(k, np.float32), q_pos)  # [H, W, N]
        h_kv = k.shape[0]
        mass = probs.sum(axis=1).reshape(h_kv, -1, n).sum(axis=1)  # [H_kv, N]
        out.append(_max_pool(mass, pool))
    return np.stack(out).astype(np.float32)


def _max_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Max over a centred window of `kernel` tokens along the last axis (edges: the window shrinks)."""
    if kernel <= 1:
        return x
    r = kernel // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)], constant_values=-np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    return windows.max(axis=-1)


def token_importance(model, prompt, kv, window: int = 32, pool: int = 7) -> np.ndarray:
    """f32[L, H_kv, N] SnapKV importance of one request from its own observation-window queries."""
    from jkv.compression.heads import observation_queries

    q = observation_queries(model, prompt, kv, window)
    return importance_from_queries(q, [k for k, _ in kv], pool)


def plan_tiers(importance: np.ndarray, cfg: TierConfig) -> np.ndarray:
    """u8[L, H_kv, N] tier per token (2 hi, 1 lo, 0 dropped) from importance f32[L, H_kv, N]:
    sinks + recent are hi; per head, middle tokens by descending importance (ties: earlier first)."""
    imp = np.asarray(importance, np.float64)
    if imp.ndim != 3 or not np.all(np.isfinite(imp)):
        raise ValueError(f"importance must be a finite [L, H_kv, N] array; got shape {imp.shape}")
    L, H, n = imp.shape
    n_hi, n_lo = tier_counts(cfg, n)
    tiers = np.zeros((L, H, n), np.uint8)
    j = np.arange(n)
    edge = (j < cfg.sink) | (j >= n - cfg.recent)
    tiers[:, :, edge] = 2
    middle = np.flatnonzero(~edge)
    n_hi_mid = n_hi - int(edge.sum())
    order = np.argsort(-imp[:, :, middle], axis=-1, kind="stable")  # [L, H, n_mid]
    ranked = middle[order]
    np.put_along_axis(tiers, ranked[:, :, :n_hi_mid], 2, axis=-1)
    np.put_along_axis(tiers, ranked[:, :, n_hi_mid:n_hi_mid + n_lo], 1, axis=-1)
    return tiers


def _positions(tiers_layer: np.ndarray, tier: int) -> np.ndarray:
    """i64[H_kv, n_tier]: each head's token positions in `tier`, ascending (equal counts per head)."""
    rows = [np.flatnonzero(row == tier) for row in tiers_layer]
    if len({r.size for r in rows}) != 1:
        raise ValueError(f"tier {tier} holds {[r.size for r in rows]} tokens per head; every head needs the same count")
    return np.stack(rows)


def encode_request(cfg: TierConfig, tiers: np.ndarray, kv16) -> list[bytes]:
    """kv16: per layer (K, V) [H_kv, N, D]; tiers u8[L, H_kv, N] (`plan_tiers`) -> [manifest, tier
    table, then per layer: hi K, hi V, and if the lo tier is non-empty lo K, lo V containers]."""
    tiers = np.asarray(tiers, np.uint8)
    L, H, n = tiers.shape
    if len(kv16) != L or kv16[0][0].shape[:2] != (H, n):
        raise ValueError(f"tier table [L={L}, H_kv={H}, N={n}] does not match the KV "
                         f"({len(kv16)} layers of {kv16[0][0].shape})")
    if cfg.lo is None and (tiers == 1).any():
        raise ValueError("the tier table has lo tokens but the config has no lo pipeline")
    pipes = {2: Pipeline(cfg.hi_spec), 1: Pipeline(cfg.lo_spec) if cfg.lo else None}
    table = get_codec(TABLE_CODEC).compress(tiers.tobytes())
    manifest = {"format": MANIFEST_MAGIC, "n": n, "layers": L, "heads": H, "table_bytes": len(table)}
    out = [json.dumps(manifest, separators=(",", ":")).encode(), table]
    for layer, (k, v) in enumerate(kv16):
        for tier in (2, 1):
            pos = _positions(tiers[layer], tier)
            if pos.shape[1] == 0:
                continue
            heads = np.arange(H)[:, None]
            for kind, x in (("k", k), ("v", v)):
                out.append(pipes[tier].encode_block(np.asarray(x)[heads, pos], layer=layer, kind=kind))
    return out


def decode_request(blobs: list[bytes]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Inverse of `encode_request`: (per layer (K, V) f32[H_kv, N, D] with 0 where dropped,
    keep bool[L, H_kv, N]). Needs nothing but the bytes (each container names its pipeline)."""
    try:
        manifest = json.loads(blobs[0].decode())
        if manifest.get("format") != MANIFEST_MAGIC:
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_MAGIC!r}")
        n, L, H = int(manifest["n"]), int(manifest["layers"]), int(manifest["heads"])
        if len(blobs[1]) != int(manifest["table_bytes"]):
            raise ValueError(f"tier table of {len(blobs[1])} bytes, the manifest says {manifest['table_bytes']}")
        raw = get_codec(TABLE_CODEC).decompress(blobs[1], L * H * n)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"token-tier request: bad manifest or tier table ({e})") from None
    tiers = np.frombuffer(raw, np.uint8).reshape(L, H, n)
    if (tiers > 2).any():
        raise ValueError("token-tier request: tier table holds values other than 0/1/2")
    it = iter(blobs[2:])
    kv = []
    heads = np.arange(H)[:, None]
    for layer in range(L):
        parts = {}
        for tier in (2, 1):
            pos = _positions(tiers[layer], tier)
            if pos.shape[1] == 0:
                continue
            for kind in ("k", "v"):
                block = next(it, None)
                if block is None:
                    raise ValueError(f"token-tier request: layer {layer} tier {tier} {kind} container missing")
                x = np.asarray(decode_block(block), np.float32)
                if x.shape[:2] != pos.shape:
                    raise ValueError(f"token-tier request: layer {layer} tier {tier} {kind} block {x.shape} "
                                     f"does not match the table's {pos.shape}")
                if kind not in parts:
                    parts[kind] = np.zeros((H, n, x.shape[2]), np.float32)
                parts[kind][heads, pos] = x
        if not parts:
            raise ValueError(f"token-tier request: layer {layer} keeps no token")
        kv.append((parts["k"], parts["v"]))
    if next(it, None) is not None:
        raise ValueError("token-tier request: more containers than the tier table implies")
    return kv, tiers > 0


def request_bytes(blobs: list[bytes]) -> int:
    """Every byte of an encoded request (manifest and tier table included)."""
    return sum(len(b) for b in blobs)

