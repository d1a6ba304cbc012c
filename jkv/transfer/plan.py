"""Transfer modes and block plans: which blocks go proactively, in which order the rest follow.

Modes (DESIGN.md "Modes"; SmartGen §5.3 factor analysis), one engine and one option:

    mode         proactive choice        on-demand lanes   speculative
    full         every block             -                 -
    partial      first Kr, address order serial            no
    +profile     first Kr by strategy    serial            no
    +parallel    first Kr by strategy    parallel          no
    smartgen     first Kr by strategy    parallel          yes   (alias "+speculative")

Proactive strategies (SmartGen §5.4, Fig. 15): `profile` (descending I, Eq. 1), `sequential`
(address order), `random`, `streaming` (sink block then most recent blocks of each layer) and
`oracle` (descending I of a profile fitted on the served prompts themselves: the upper bound).
Pure numpy; no JAX.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jkv.kvbuffers.geometry import BlockGeometry
from jkv.transfer.profile import compute_kr

MODES = ("full", "partial", "+profile", "+parallel", "smartgen")
STRATEGIES = ("profile", "sequential", "random", "streaming", "oracle")
_ALIASES = {"+speculative": "smartgen"}


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """mode: one of MODES; strategy: proactive choice for modes past `partial`;
    spec_ratio: at most this fraction of a request's blocks moves speculatively per decode step;
    max_blocks: M; kr_fraction: force Kr = ceil(kr_fraction * L * M_eff) (tests, sweeps) instead
    of Eq. 2; bandwidth_bps: the link estimate Tt is computed from (bytes/s * 8); lookahead: fetch
    layer l+1's remote rows while layer l computes (None: on in smartgen mode only); hint_margin,
    lookahead_gate: how the lookahead hints and when its prefetch leaves (see the fields)."""

    mode: str = "smartgen"
    strategy: str = "profile"
    spec_ratio: float = 0.10
    max_blocks: int = 1024
    kr_fraction: float | None = None
    bandwidth_bps: float | None = None
    seed: int = 0
    spec_every_layer: bool = True  # DESIGN.md: trigger at each attention layer; False: once per step
    lookahead: bool | None = None  # layer lookahead (jkv/disagg/lookahead.py); None: on in smartgen mode
    # The lookahead's hint (jkv/disagg/hint.py): the selected set plus this many next-ranked rows per
    # row, by a linear-time partition where the selector has one (InfiniGen); None: the selector's
    # own ordered `select` (no margin).
    hint_margin: int | None = 8
    # When a prefetch may leave: "first_step" holds it behind the previous layer's synchronous fetch
    # only in a request's first decode step; "always" in every step.
    lookahead_gate: str = "first_step"

    def __post_init__(self):
        object.__setattr__(self, "mode", _ALIASES.get(self.mode, self.mode))
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES} (or '+speculative')")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} must be one of {STRATEGIES}")
        if not 0 < self.spec_ratio <= 1:
            raise ValueError(f"spec_ratio={self.spec_ratio!r} must be in (0, 1], e.g. 0.1")
        if not isinstance(self.max_blocks, int) or self.max_blocks < 1:
            raise ValueError(f"max_blocks={self.max_blocks!r} must be an int >= 1 (M, default 1024)")
        if self.kr_fraction is not None and not 0 <= self.kr_fraction <= 1:
            raise ValueError(f"kr_fraction={self.kr_fraction!r} must be in [0, 1] or None (use Eq. 2)")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps={self.bandwidth_bps!r} must be > 0 bits/s")
        if self.lookahead not in (None, True, False):
            raise ValueError(f"lookahead={self.lookahead!r} must be True, False or None (on in smartgen mode)")
        if self.hint_margin is not None and not (isinstance(self.hint_margin, int) and self.hint_margin >= 0):
            raise ValueError(f"hint_margin={self.hint_margin!r} must be an int >= 0 or None (the selector's select)")
        if self.lookahead_gate not in ("first_step", "always"):
            raise ValueError(f"lookahead_gate={self.lookahead_gate!r} must be 'first_step' or 'always'")
        if self.lookahead and self.mode == "full":
            raise ValueError("lookahead=True needs on-demand fetches; mode 'full' moves every block "
                             "proactively (use lookahead=None or a partial/smartgen mode)")

    @property
    def effective_strategy(self) -> str:
        return "sequential" if self.mode == "partial" else self.strategy

    @property
    def parallel_lanes(self) -> bool:
        return self.mode in ("+parallel", "smartgen")

    @property
    def speculative(self) -> bool:
        return self.mode == "smartgen"

    @property
    def layer_lookahead(self) -> bool:
        """Fetch layer l+1's hinted remote rows while layer l computes (default: smartgen only)."""
        return self.mode == "smartgen" if self.lookahead is None else bool(self.lookahead)

    @property
    def needs_profile(self) -> bool:
        return self.mode not in ("full", "partial") and self.strategy in ("profile", "oracle")

    def kr(self, geometry: BlockGeometry, prefill_s: float | None, request_bytes: int,
           metadata_bytes: int = 0) -> int:
        """Number of blocks pushed during prefill for one request. The selector metadata that
        goes first (InfiniGen partial keys: ~15 % of the KV bytes) takes its share of the
        prefill window, so Eq. 2 gets Tp - Tm with Tm = metadata_bytes / bandwidth (SmartGen §4
        "Integrating different KV selection algorithms": the metadata overhead is jointly
        considered by the analytical model)."""
        full = geometry.num_blocks
        if self.mode == "full":
            return full
        if self.kr_fraction is not None:
            return int(np.ceil(self.kr_fraction * full))
        if prefill_s is None or self.bandwidth_bps is None:
            raise ValueError("Eq. 2 needs the prefill time (a profile) and a bandwidth estimate; "
                             "pass TransferConfig(bandwidth_bps=...) and a profile, or kr_fraction")
        transfer_s = request_bytes * 8 / self.bandwidth_bps
        window_s = max(0.0, prefill_s - metadata_bytes * 8 / self.bandwidth_bps)
        return compute_kr(geometry.blocks_per_layer, geometry.num_layers, window_s, transfer_s)


def proactive_order(strategy: str, geometry: BlockGeometry, importance: np.ndarray | None = None,
                    seed: int = 0) -> np.ndarray:
    """Every non-empty flat block id (l * M_eff + m) in the order the strategy sends them:
    the first Kr go proactively, the rest follow speculatively in the same order."""
    ids = geometry.nonempty_ids()
    M = geometry.blocks_per_layer
    layer, m = ids // M, ids % M
    if strategy == "sequential":
        return ids
    if strategy == "random":
        return np.random.default_rng(seed).permutation(ids).astype(np.int32)
    if strategy == "streaming":
        last = max(mm for mm in range(M) if not geometry.is_empty(mm))
        rank = np.where(m == 0, 0, last - m + 1)  # sink block first, then newest to oldest
        return ids[np.lexsort((layer, rank))]
    if strategy in ("profile", "oracle"):
        if importance is None:
            raise ValueError(f"strategy {strategy!r} needs an importance profile (`jkv profile`)")
        if importance.shape != (geometry.num_layers, M):
            raise ValueError(f"importance shape {importance.shape} != (L={geometry.num_layers}, M={M})")
        score = importance[layer, m]
        return ids[np.lexsort((ids, -score))]  # descending importance, ties in address order
    raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")


def speculative_order(order: np.ndarray, kr: int) -> np.ndarray:
    """The blocks left after the proactive Kr, in the order speculation sends them."""
    return order[kr:]


def per_layer(geometry: BlockGeometry, block_ids) -> dict[int, list[int]]:
    """Flat ids -> {layer: [m, ...]} (sorted m)."""
    out: dict[int, list[int]] = {}
    for b in block_ids:
        layer, m = geometry.split(int(b))
        out.setdefault(layer, []).append(m)
    return {k: sorted(v) for k, v in out.items()}
