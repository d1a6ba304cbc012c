"""CALVO's binary linear service-cost model (§3.2), fitted per deployment from profiling.

    T_load = a * ctx_tokens + b        (L3 -> L2 -> L1 loading of the cached prefix; Fig. 6: linear)
    T_comp = c * query_tokens + d      (prefill of the uncached suffix)
    T      = T_load + T_comp

`ctx_tokens` are the tokens whose KV is loaded from the pool (cache hits), `query_tokens` the
tokens prefilled on the device (misses). A request with no cached chunk loads nothing, so its
T_load is 0 (no round trip, no `b`). The intercepts b and d are only separately identifiable
from per-stage timings (`fit`); from end-to-end timings alone (`fit_total`) their sum lands in b.

Compute part on a bucketed engine (still linear in its features, fitted per stage):

    T_comp = c * q' + e * ctx' * q' + f * ctx' + d

    q'   = query_tokens rounded up to the engine's compute bucket (`query_buckets`; the
           compute stage pads the suffix to a bucket, so padded rows cost like real ones)
    ctx' = ctx_tokens rounded up to a multiple of `prefix_bucket` (the padded prefix the query
           attends to); e: attention of each query row over the prefix, f: per-prefix-token
           work independent of the query (gathering the prefix's L1 slots, K/V reads)

With no buckets and e = f = 0 (the defaults) this is the paper's T_comp = c * query + d.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib

import numpy as np

_FORMAT = "calvo-binary-linear-v2"
_READABLE = ("calvo-binary-linear-v1", _FORMAT)   # v1 files have no e, f or buckets


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per loaded token (a), load overhead (b), seconds per computed token (c), compute
    overhead (d); `deployment` names what was profiled (model, dtype, link, device).
    Optional compute terms (module docstring): e seconds per (prefix token x query token), f
    seconds per prefix token; `query_buckets` (ascending) and `prefix_bucket` the padding the
    compute stage applies (empty / 1: none)."""

    a: float
    b: float
    c: float
    d: float
    deployment: str = ""
    e: float = 0.0
    f: float = 0.0
    query_buckets: tuple[int, ...] = ()
    prefix_bucket: int = 1

    def __post_init__(self):
        for name in "abcdef":
            value = getattr(self, name)
            if not np.isfinite(value):
                raise ValueError(f"cost-model coefficient {name}={value} must be finite")
        buckets = tuple(int(b) for b in self.query_buckets)
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"query_buckets={self.query_buckets} must be strictly ascending "
                             "positive token counts (the compute stage's suffix buckets)")
        object.__setattr__(self, "query_buckets", buckets)
        if int(self.prefix_bucket) < 1:
            raise ValueError(f"prefix_bucket={self.prefix_bucket} must be >= 1 (1: no padding)")

    def padded_query(self, query_tokens) -> np.ndarray:
        """q' = query tokens rounded up to the next compute bucket (beyond the last bucket:
        unchanged, i.e. linear extrapolation)."""
        q = np.asarray(query_tokens, dtype=np.float64)
        if not self.query_buckets:
            return q
        buckets = np.asarray(self.query_buckets, dtype=np.float64)
        idx = np.searchsorted(buckets, q, side="left")
        return np.where(idx < len(buckets), buckets[np.minimum(idx, len(buckets) - 1)], q)

    def padded_ctx(self, ctx_tokens) -> np.ndarray:
        """ctx' = prefix tokens rounded up to a multiple of prefix_bucket."""
        ctx = np.asarray(ctx_tokens, dtype=np.float64)
        return np.ceil(ctx / self.prefix_bucket) * self.prefix_bucket

    def t_load(self, ctx_tokens: int | np.ndarray) -> float | np.ndarray:
        if isinstance(ctx_tokens, numbers.Real):  # scalar arithmetic: LSTF's key calls this per queued
            return self.a * ctx_tokens + self.b if ctx_tokens > 0 else 0.0  # request at every dispatch
        ctx = np.asarray(ctx_tokens, dtype=np.float64)
        out = np.where(ctx > 0, self.a * ctx + self.b, 0.0)
        return float(out) if out.ndim == 0 else out

    def t_comp(self, query_tokens: int | np.ndarray,
               ctx_tokens: int | np.ndarray = 0) -> float | np.ndarray:
        """Compute time of query_tokens prefilled on top of a ctx_tokens prefix."""
        q, ctx = self.padded_query(query_tokens), self.padded_ctx(ctx_tokens)
        out = self.c * q + self.e * ctx * q + self.f * ctx + self.d
        return float(out) if out.ndim == 0 else out

    def cost(self, ctx_tokens, query_tokens):
        """Modelled service time T = T_load + T_comp (seconds)."""
        return self.t_load(ctx_tokens) + self.t_comp(query_tokens, ctx_tokens)

    @classmethod
    def fit(cls, ctx_tokens, query_tokens, t_load, t_comp, deployment: str = "",
            relative: bool = False, query_buckets: tuple[int, ...] = (), prefix_bucket: int = 1,
            context_terms: bool = False) -> "CostModel":
        """Least-squares fit of both stage lines from per-request profiling samples.

        ctx_tokens, query_tokens: i[n]; t_load, t_comp: f[n] seconds. Samples with ctx_tokens == 0
        carry no loading information and are ignored for (a, b).
        relative: minimise relative instead of absolute errors (weights 1/t), so samples spanning
        orders of magnitude (a 16-token query and a 1K-token recompute) are all fitted well
        rather than the largest dominating and the small ones getting negative predictions.
        query_buckets, prefix_bucket: the compute stage's padding; the compute line is fitted
        on the padded counts q', ctx' (what the engine really computes).
        context_terms: also fit e (ctx' x q') and f (ctx') of T_comp; needs samples whose
        prefix lengths and query lengths vary independently.

        The compute part's coefficients (c, d and e, f) are fitted non-negative: compute time
        cannot fall with more query or prefix tokens, and an unconstrained fit on a small noisy
        profile did return negative terms (SmolLM2, 16 samples: c = -1.6 ms per query token,
        f = -0.87 ms per prefix token, d = +427 ms), which predicted *negative* compute time for
        a short query on a 1K-token prefix and misordered SJF/LSTF. The loading line stays
        unconstrained (its small negative intercept is real: Fig. 6 is linear).
        """
        ctx, query, load, comp = (np.asarray(x, dtype=np.float64).reshape(-1)
                                  for x in (ctx_tokens, query_tokens, t_load, t_comp))
        if not len(ctx) == len(query) == len(load) == len(comp):
            raise ValueError(f"sample arrays differ in length: {len(ctx)=} {len(query)=} "
                             f"{len(load)=} {len(comp)=}")
        has_load = ctx > 0
        a, b = _line(ctx[has_load], load[has_load], "ctx_tokens", relative)
        shape = cls(a, b, 0.0, 0.0, query_buckets=tuple(query_buckets),
                    prefix_bucket=prefix_bucket)
        q, pctx = shape.padded_query(query), shape.padded_ctx(ctx)
        if not context_terms:
            c, d = _line(q, comp, "query_tokens", relative, nonneg=True)
            return dataclasses.replace(shape, c=c, d=d, deployment=deployment)
        design = np.stack([q, pctx * q, pctx, np.ones_like(q)], axis=1)
        c, e, f, d = _solve(design, comp, "query_tokens and ctx_tokens (independently)",
                            relative, nonneg=True)
        return dataclasses.replace(shape, c=c, d=d, e=e, f=f, deployment=deployment)

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

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every time coefficient multiplied by `factor` (> 0): a profile
        recalibrated to measured isolated times taken under different conditions (e.g. another
        load on a shared box); orders by cost are unchanged, slack changes."""
        if not (np.isfinite(factor) and factor > 0):
            raise ValueError(f"scale factor {factor} must be finite and > 0")
        return dataclasses.replace(self, **{k: getattr(self, k) * factor for k in "abcdef"})

    def save(self, path: str | pathlib.Path) -> None:
        fields = dataclasses.asdict(self)
        fields["query_buckets"] = list(self.query_buckets)
        pathlib.Path(path).write_text(json.dumps({"format": _FORMAT, **fields}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "CostModel":
        raw = json.loads(pathlib.Path(path).read_text())
        if raw.pop("format", None) not in _READABLE:
            raise ValueError(f"{path} is not a {_FORMAT} cost model (re-run profiling)")
        raw["query_buckets"] = tuple(raw.get("query_buckets", ()))
        return cls(**raw)


def fit_line(x, y, what: str, nonneg: bool = False) -> tuple[float, float]:
    """(slope, intercept) of y ~= slope * x + intercept by least squares (nonneg: both >= 0), for
    one stage measured alone (a serving engine's page loads, or its prefills)."""
    return _line(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), what, nonneg=nonneg)


def _line(x: np.ndarray, y: np.ndarray, what: str, relative: bool = False,
          nonneg: bool = False) -> tuple[float, float]:
    slope, intercept = _solve(np.stack([x, np.ones_like(x)], axis=1), y, what, relative, nonneg)
    return slope, intercept


def _solve(design: np.ndarray, y: np.ndarray, what: str, relative: bool,
           nonneg: bool = False) -> tuple[float, ...]:
    """Least squares design @ coef ~= y (relative: rows weighted by 1 / y; nonneg: coef >= 0)."""
    _check_rank(design, what)
    if relative:
        if (y <= 0).any():
            raise ValueError(f"a relative fit needs positive times; got min {y.min()} s for {what}")
        design, y = design / y[:, None], np.ones_like(y)
    coef = _nnls(design, y) if nonneg else np.linalg.lstsq(design, y, rcond=None)[0]
    return tuple(float(x) for x in coef)


def _nnls(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||design @ coef - y|| subject to coef >= 0, exactly, for the few columns here: the
    optimum is the unconstrained least-squares solution on its support, so try every support
    (2^k - 1 subsets, k <= 4) and keep the best feasible one."""
    k = design.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y ** 2))
    for mask in range(1, 2 ** k):
        cols = [i for i in range(k) if mask >> i & 1]
        sub, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
        if (sub < 0).any():
            continue
        err = float(np.sum((design[:, cols] @ sub - y) ** 2))
        if err < best_err - 1e-15 * max(1.0, best_err):
            best = np.zeros(k)
            best[cols] = sub
            best_err = err
    return best


def _check_rank(design: np.ndarray, what: str) -> None:
    if design.shape[0] < design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError(f"cannot fit: need at least {design.shape[1]} samples with distinct "
                         f"{what}, got {design.shape[0]} samples; profile more lengths")
