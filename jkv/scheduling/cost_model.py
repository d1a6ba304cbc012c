"""CALVO's binary linear service-cost model (§3.2), fitted per deployment from profiling.

    T_load = a * ctx_tokens + b        (L3 -> L2 -> L1 loading of the cached prefix; Fig. 6: linear)
    T_comp = c * query_tokens + d      (prefill of the uncached suffix)
    T      = T_load + T_comp

`ctx_tokens` are the tokens whose KV is loaded from the pool (cache hits), `query_tokens` the
tokens prefilled on the device (misses). A request with no cached chunk loads nothing, so its
T_load is 0 (no round trip, no `b`). The intercepts b and d are only separately identifiable
from per-stage timings (`fit`); from end-to-end timings alone (`fit_total`) their sum lands in b.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

_FORMAT = "calvo-binary-linear-v1"


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per loaded token (a), load overhead (b), seconds per computed token (c), compute
    overhead (d); `deployment` names what was profiled (model, dtype, link, device)."""

    a: float
    b: float
    c: float
    d: float
    deployment: str = ""

    def __post_init__(self):
        for name in "abcd":
            value = getattr(self, name)
            if not np.isfinite(value):
                raise ValueError(f"cost-model coefficient {name}={value} must be finite")

    def t_load(self, ctx_tokens: int | np.ndarray) -> float | np.ndarray:
        ctx = np.asarray(ctx_tokens, dtype=np.float64)
        out = np.where(ctx > 0, self.a * ctx + self.b, 0.0)
        return float(out) if out.ndim == 0 else out

    def t_comp(self, query_tokens: int | np.ndarray) -> float | np.ndarray:
        out = self.c * np.asarray(query_tokens, dtype=np.float64) + self.d
        return float(out) if out.ndim == 0 else out

    def cost(self, ctx_tokens, query_tokens):
        """Modelled service time T = T_load + T_comp (seconds)."""
        return self.t_load(ctx_tokens) + self.t_comp(query_tokens)

    @classmethod
    def fit(cls, ctx_tokens, query_tokens, t_load, t_comp, deployment: str = "",
            relative: bool = False) -> "CostModel":
        """Least-squares fit of both stage lines from per-request profiling samples.

        ctx_tokens, query_tokens: i[n]; t_load, t_comp: f[n] seconds. Samples with ctx_tokens == 0
        carry no loading information and are ignored for (a, b).
        relative: minimise relative instead of absolute errors (weights 1/t), so samples spanning
        orders of magnitude (a 16-token query and a 1K-token recompute) are all fitted well
        rather than the largest dominating and the small ones getting negative predictions.
        """
        ctx, query, load, comp = (np.asarray(x, dtype=np.float64).reshape(-1)
                                  for x in (ctx_tokens, query_tokens, t_load, t_comp))
        if not len(ctx) == len(query) == len(load) == len(comp):
            raise ValueError(f"sample arrays differ in length: {len(ctx)=} {len(query)=} "
                             f"{len(load)=} {len(comp)=}")
        has_load = ctx > 0
        a, b = _line(ctx[has_load], load[has_load], "ctx_tokens", relative)
        c, d = _line(query, comp, "query_tokens", relative)
        return cls(a, b, c, d, deployment)

    @classmethod
    def fit_total(cls, ctx_tokens, query_tokens, ttft, deployment: str = "") -> "CostModel":
        """Fit T = a*ctx + c*query + (b + d) from end-to-end times of requests that all load
        (ctx_tokens > 0); the joint intercept is reported as b (d = 0)."""
        ctx, query, total = (np.asarray(x, dtype=np.float64).reshape(-1)
                             for x in (ctx_tokens, query_tokens, ttft))
        if not len(ctx) == len(query) == len(total):
            raise ValueError(f"sample arrays differ in length: {len(ctx)=} {len(query)=} "
                             f"{len(total)=}")
        if (ctx <= 0).any():
            raise ValueError("fit_total needs ctx_tokens > 0 in every sample (T_load has no "
                             "intercept without a load); use fit() with per-stage timings")
        design = np.stack([ctx, query, np.ones_like(ctx)], axis=1)
        _check_rank(design, "ctx_tokens and query_tokens")
        (a, c, intercept), *_ = np.linalg.lstsq(design, total, rcond=None)
        return cls(float(a), float(intercept), float(c), 0.0, deployment)

    def save(self, path: str | pathlib.Path) -> None:
        fields = dataclasses.asdict(self)
        pathlib.Path(path).write_text(json.dumps({"format": _FORMAT, **fields}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "CostModel":
        raw = json.loads(pathlib.Path(path).read_text())
        if raw.pop("format", None) != _FORMAT:
            raise ValueError(f"{path} is not a {_FORMAT} cost model (re-run profiling)")
        return cls(**raw)


def _line(x: np.ndarray, y: np.ndarray, what: str, relative: bool = False) -> tuple[float, float]:
    design = np.stack([x, np.ones_like(x)], axis=1)
    _check_rank(design, what)
    if relative:
        if (y <= 0).any():
            raise ValueError(f"a relative fit needs positive times; got min {y.min()} s for {what}")
        design, y = design / y[:, None], np.ones_like(y)
    (slope, intercept), *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(slope), float(intercept)


def _check_rank(design: np.ndarray, what: str) -> None:
    if design.shape[0] < design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError(f"cannot fit: need at least {design.shape[1]} samples with distinct "
                         f"{what}, got {design.shape[0]} samples; profile more lengths")
