"""Bayesian profiling engine (KVServe §5.2, Algorithm 1) and the 3D Pareto profile file (§5.2.3).

Goal: max CR(c) s.t. Acc(c) >= Acc_ths over a finite strategy space of `PipelineSpec`s, with as few
calls as possible of an expensive objective `evaluate(spec) -> (accuracy, cr, latency_s)`
(`FidelityObjective` here; the model accuracy harness later). Per iteration t (Alg. 1):

1. encode the space: one-hot categorical + min-max numeric features (line 1);
2. fit a GP on the evaluated points: Matern(nu=1.5) * constant + WhiteKernel, normalized targets;
3. acquisition (Eq. 4): a(c) = CR_hat(c) * P(Acc(c) >= Acc_ths) + lambda_t * sigma_norm(c),
   lambda_t = lambda_0 * decay^t (exploration early, exploitation late); CR_hat is the measured CR
   where known, else a prior (`nominal_cr`, rescaled per codec by what was measured) or a GP on log
   CR; the exploitation term is 0 where CR_hat cannot beat the best feasible CR so far;
4. bi-directional pruning with margin eps (lines 9-13): a feasible point removes candidates with
   CR_hat < CR - eps (always safe: they cannot beat it); a clearly infeasible one
   (Acc < Acc_ths - fail_margin) removes CR_hat > CR + eps. The latter relies on the monotone
   CR-accuracy trade-off, which holds within a family (same transform and quantizer method) but
   not across families — on real SmolLM2 KV a failing identity+kivi4 pruned the optimum
   hadamard+kivi4 — so by default (`prune_scope="family"`) it only prunes the same family;
   `prune_scope="global"` is the paper's literal rule;
5. early stopping (lines 14-16): `patience` consecutive iterations without a better feasible CR,
   or no candidates left.

The output keeps every evaluation; `pareto_front` reduces the feasible ones to the non-dominated
set in (accuracy up, CR up, latency down), saved by `save_profile` as a versioned JSON file.
"""
from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from jkv.compression.dropping import is_dropping_id
from jkv.compression.pipeline import Calibration, Pipeline, decode_block
from jkv.compression.quantizers import QuantPlan, make_plan, section_layout
from jkv.compression.spec import PipelineSpec, ec_bits_estimate
from jkv.compression.transforms import side_layout

log = logging.getLogger(__name__)

PROFILE_FORMAT = "jkv.compression.profile"
PROFILE_VERSION = 1
Objective = Callable[[PipelineSpec], tuple[float, float, float]]


@dataclass(frozen=True)
class Evaluation:
    spec_id: str
    accuracy: float
    cr: float
    latency_s: float


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of Algorithm 1. `prune_margin` is eps in CR units; `fail_margin` defines Acc << Acc_ths."""

    acc_threshold: float
    max_iters: int = 80
    n_init: int = 6
    prune_margin: float = 0.25
    fail_margin: float = 0.05
    lambda0: float = 1.0
    lambda_decay: float = 0.85
    patience: int = 12
    prune_scope: str = "family"  # infeasible-side pruning: "family" (same transform + quantizer method) | "global"
    seed: int = 0

    def __post_init__(self):
        if self.prune_scope not in ("family", "global"):
            raise ValueError(f"{self.prune_scope=} must be 'family' or 'global'")
        if self.max_iters < 1 or self.n_init < 1:
            raise ValueError(f"{self.max_iters=} and {self.n_init=} must be >= 1")
        if self.prune_margin < 0 or self.fail_margin < 0:
            raise ValueError(f"{self.prune_margin=} and {self.fail_margin=} must be >= 0")
        if not 0 < self.lambda_decay <= 1 or self.lambda0 < 0:
            raise ValueError(f"need 0 < {self.lambda_decay=} <= 1 and {self.lambda0=} >= 0")
        if self.patience < 1:
            raise ValueError(f"{self.patience=} must be >= 1")


@dataclass
class SearchResult:
    evaluations: list[Evaluation]
    acc_threshold: float
    space_size: int
    stopped: str = ""
    pruned: int = 0

    @property
    def feasible(self) -> list[Evaluation]:
        return [e for e in self.evaluations if e.accuracy >= self.acc_threshold]

    @property
    def best(self) -> Evaluation | None:
        """Feasible evaluation with the highest CR (ties: higher accuracy)."""
        return max(self.feasible, key=lambda e: (e.cr, e.accuracy), default=None)


def encode_space(space: Sequence[PipelineSpec]) -> np.ndarray:
    """f32[len(space), F]: one-hot of every categorical feature, min-max of every numeric one."""
    feats = [s.features() for s in space]
    columns = []
    keys = sorted({k for f in feats for k in f})  # a mixed space (pipelines + token tiers): the union
    for key in keys:
        kind = next(f[key] for f in feats if key in f)
        values = [f.get(key, "-" if isinstance(kind, str) else 0.0) for f in feats]
        if isinstance(values[0], str):
            for cat in sorted(set(values)):
                columns.append([float(v == cat) for v in values])
        else:
            arr = np.asarray(values, dtype=np.float64)
            span = arr.max() - arr.min()
            columns.append((arr - arr.min()) / span if span > 0 else np.zeros_like(arr))
    return np.asarray(columns, dtype=np.float64).T


def nominal_cr(spec: PipelineSpec, shape: tuple[int, int, int] = (3, 1024, 64), itemsize: int = 2,
               n_tokens: int | None = None) -> float:
    """CR of the transform + quantizer stages computed from the section layout (no data, no codec).

    For MixHQ, `retrieval_pct` % of heads at `bits` and the rest at `low_bits`; for a mixed table,
    the average over layers. A cheap CR prior for the search (the codec only adds to it) — except
    for the entropy-coded `ec` quantizer behind a codec, whose 4-bit codes are counted at the
    Gaussian entropy estimate `ec_bits_estimate(step)` (the codec is what makes it pay). A token-tier
    spec (`tokens.TierConfig`) weights its pipelines by their token shares at `n_tokens` per request.
    """
    if hasattr(spec, "nominal_cr"):  # a request-level spec (token tiers) knows its own layout
        return spec.nominal_cr(shape, itemsize, n=n_tokens or shape[1])
    h = shape[0]
    ec_code_frac = (ec_bits_estimate(spec.quantizer.step) / 4
                    if spec.quantizer.method == "ec" and spec.codec.name != "none" else 1.0)

    def payload(plan: QuantPlan) -> float:
        lay = dict(side_layout(spec.transform, shape, np.dtype(np.float16)))
        lay.update(section_layout(plan, shape, np.dtype(np.float16)))
        return sum(math.prod(s) * np.dtype(d).itemsize * (ec_code_frac if name.endswith(".codes") else 1.0)
                   for name, (s, d) in lay.items())

    q = spec.quantizer
    total = 0.0
    for kind in ("k", "v"):
        if q.method == "mixhq":
            frac = q.retrieval_pct / 100
            hi, lo = (make_plan(q, 0, kind, h, np.full((1, h), r)) for r in (True, False))
            total += frac * payload(hi) + (1 - frac) * payload(lo)
        elif q.method == "mixed":
            total += np.mean([payload(make_plan(q, layer, kind, h)) for layer in range(len(q.table))])
        else:
            total += payload(make_plan(q, 0, kind, h))
    return 2 * math.prod(shape) * itemsize / total


class _Surrogate:
    """GP surrogate of one target (§5.2.2): Matern(nu=1.5) with one length scale per feature (ARD),
    times a constant, plus white noise; targets normalized. Hyperparameters are refitted from the
    same start every iteration (warm starts got stuck in poor likelihood optima in tests)."""

    def __init__(self, n_features: int, seed: int):
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

        self.kernel = ConstantKernel(1.0, (1e-2, 1e2)) * Matern(
            length_scale=np.ones(n_features), length_scale_bounds=(1e-2, 1e2), nu=1.5) + WhiteKernel(1e-3, (1e-6, 1e-1))
        self.seed = seed

    def fit_predict(self, x_train, y_train, x_all) -> tuple[np.ndarray, np.ndarray]:
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor

        if np.ptp(y_train) == 0:  # constant targets carry no signal: predict the constant, unit doubt
            return np.full(len(x_all), float(y_train[0])), np.ones(len(x_all))
        gp = GaussianProcessRegressor(kernel=self.kernel, normalize_y=True, random_state=self.seed,
                                      optimizer=_bounded_lbfgs)
        # Matrices here are tiny (<= a few hundred rows): BLAS threads only add contention, which
        # made each fit 10x slower on a loaded 2-core machine.
        with warnings.catch_warnings(), threadpool_limits(limits=1):
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp.fit(x_train, y_train)
            mu, sigma = gp.predict(x_all, return_std=True)
        return mu, np.maximum(sigma, 1e-9)


def _bounded_lbfgs(obj_func, initial_theta, bounds):
    """sklearn's default L-BFGS-B with an iteration cap: hyperparameters need not be exact."""
    from scipy.optimize import minimize

    res = minimize(obj_func, initial_theta, method="L-BFGS-B", jac=True, bounds=bounds, options={"maxiter": 60})
    return res.x, res.fun


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(z)


def bayesian_search(space: Sequence[PipelineSpec], evaluate: Objective, config: SearchConfig,
                    cr_prior: Callable[[PipelineSpec], float] | None = None) -> SearchResult:
    """Algorithm 1 over `space`; `cr_prior` (e.g. `nominal_cr`) estimates CR before evaluation.

    Without a prior, CR is predicted by a GP on log CR and a candidate is pruned only when its
    whole 2-sigma band lies beyond the pruning bound (a wrong guess must not discard the optimum).
    """
    if not space:
        raise ValueError("the strategy space is empty")
    ids = [s.id for s in space]
    if len(set(ids)) != len(ids):
        raise ValueError("the strategy space contains duplicate specs")
    x_all = encode_space(space)
    prior = np.array([cr_prior(s) for s in space], dtype=np.float64) if cr_prior else None
    if prior is not None and not np.all(np.isfinite(prior) & (prior > 0)):
        raise ValueError("cr_prior must return finite CR > 0 for every spec")
    codecs = np.array([s.codec.id for s in space])
    # A spec may name its own pruning family (token tiers: `tokens.TierConfig.family`).
    families = np.array([getattr(s, "family", None) or f"{s.transform.name}/{s.quantizer.method}" for s in space])
    acc_model, cr_model = _Surrogate(x_all.shape[1], config.seed), _Surrogate(x_all.shape[1], config.seed)
    rng = np.random.default_rng(config.seed)
    remaining = np.ones(len(space), dtype=bool)
    evaluated: dict[int, Evaluation] = {}
    result = SearchResult([], config.acc_threshold, len(space))
    best_cr, k_fail, cr_band = -math.inf, 0, None
    init = [int(i) for i in rng.choice(len(space), size=min(config.n_init, len(space)), replace=False)]

    for t in range(config.max_iters):
        if not remaining.any():
            result.stopped = "space exhausted"
            break
        init = [i for i in init if remaining[i]]
        if init:
            idx = init.pop(0)
        else:
            # Without a prior the CR term is optimistic (mean + 1 sigma) so unexplored high-CR regions get tried.
            cr_hat = cr_band[0] if prior is not None else np.sqrt(cr_band[0] * cr_band[2])
            idx = _next_candidate(t, x_all, evaluated, remaining, cr_hat, best_cr, acc_model, config)
        acc, cr, latency = (float(v) for v in evaluate(space[idx]))
        if not (math.isfinite(acc) and math.isfinite(cr) and cr > 0 and math.isfinite(latency)):
            raise ValueError(f"evaluate({space[idx].id}) returned {(acc, cr, latency)}; need finite values, cr > 0")
        ev = Evaluation(space[idx].id, acc, cr, latency)
        evaluated[idx] = ev
        result.evaluations.append(ev)
        remaining[idx] = False
        cr_band = _cr_estimates(evaluated, prior, codecs, x_all, cr_model)  # (estimate, low, high)
        before = int(remaining.sum())
        if acc >= config.acc_threshold:  # Alg. 1 lines 9-11: lower-CR candidates cannot win
            remaining &= ~(cr_band[2] < cr - config.prune_margin)
        elif acc < config.acc_threshold - config.fail_margin:  # lines 12-13: higher CR will fail too
            scope = families == families[idx] if config.prune_scope == "family" else True
            remaining &= ~((cr_band[1] > cr + config.prune_margin) & scope)
        result.pruned += before - int(remaining.sum())
        if acc >= config.acc_threshold and cr > best_cr:
            best_cr, k_fail = cr, 0
        else:
            k_fail += 1
        log.debug("iter %d: %s acc=%.4f cr=%.2f remaining=%d k_fail=%d", t, ev.spec_id, acc, cr, remaining.sum(), k_fail)
        if k_fail >= config.patience and best_cr > -math.inf:  # lines 14-16
            result.stopped = f"no better feasible CR in {config.patience} iterations"
            break
    else:
        result.stopped = "max iterations"
    return result


def _cr_estimates(evaluated, prior, codecs, x_all, cr_model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(estimate, low, high) CR for every spec; exact where measured."""
    idx = np.fromiter(evaluated, dtype=int)
    measured = np.array([evaluated[i].cr for i in idx])
    if prior is not None:
        est = prior.copy()
        # The prior ignores the codec: rescale by the measured/nominal ratio of each codec seen so far.
        for codec in set(codecs[idx]):
            sel = codecs[idx] == codec
            est[codecs == codec] *= float(np.exp(np.mean(np.log(measured[sel] / prior[idx][sel]))))
        low, high = est.copy(), est.copy()
    else:
        mu, sigma = cr_model.fit_predict(x_all[idx], np.log(measured), x_all)
        est, low, high = np.exp(mu), np.exp(mu - 2 * sigma), np.exp(mu + 2 * sigma)
    for arr in (est, low, high):
        arr[idx] = measured
    return est, low, high


def _next_candidate(t, x_all, evaluated, remaining, cr_hat, best_cr, acc_model, config) -> int:
    idx = np.fromiter(evaluated, dtype=int)
    acc = np.array([evaluated[i].accuracy for i in idx])
    mu, sigma = acc_model.fit_predict(x_all[idx], acc, x_all)
    p_feasible = _normal_cdf((mu - config.acc_threshold) / sigma)
    cand = np.flatnonzero(remaining)
    lam = config.lambda0 * config.lambda_decay ** t
    # Eq. 4. A candidate whose CR cannot exceed the best feasible CR found has nothing to exploit
    # (the pruning margin keeps such near-ties alive, and with P(feasible) ~ 1 they would otherwise
    # win the exploitation term over and over); it can still be chosen for exploration.
    exploit = np.where(cr_hat[cand] > best_cr, cr_hat[cand] / cr_hat[cand].max() * p_feasible[cand], 0.0)
    score = exploit + lam * sigma[cand] / sigma[cand].max()
    return int(cand[np.argmax(score)])


def exhaustive_search(space: Sequence[PipelineSpec], evaluate: Objective, acc_threshold: float) -> SearchResult:
    """Evaluate every spec (the baseline Algorithm 1 is compared against)."""
    result = SearchResult([], acc_threshold, len(space), stopped="exhaustive")
    for spec in space:
        acc, cr, latency = (float(v) for v in evaluate(spec))
        result.evaluations.append(Evaluation(spec.id, acc, cr, latency))
    return result


def pareto_front(evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """Non-dominated evaluations in (accuracy max, CR max, latency min), sorted by CR (§5.2.3)."""
    def dominates(a: Evaluation, b: Evaluation) -> bool:
        no_worse = a.accuracy >= b.accuracy and a.cr >= b.cr and a.latency_s <= b.latency_s
        return no_worse and (a.accuracy > b.accuracy or a.cr > b.cr or a.latency_s < b.latency_s)

    front = [e for e in evaluations if not any(dominates(o, e) for o in evaluations)]
    return sorted(front, key=lambda e: (e.cr, e.accuracy))


@dataclass(frozen=True)
class ProfilePoint:
    """One Pareto profile p = (cr_p, s_p, q_p) for the controller (KVServe §3.1)."""

    spec_id: str
    accuracy: float
    cr: float
    latency_s: float
    throughput_Bps: float  # s_p = probe_bytes / (encode + decode seconds)


@dataclass(frozen=True)
class ProfileFile:
    workload: str
    acc_threshold: float
    probe_bytes: int
    points: tuple[ProfilePoint, ...]
    search: dict = field(default_factory=dict)


def build_profile(result: SearchResult, workload: str, probe_bytes: int) -> ProfileFile:
    """The 3D Pareto set of the feasible evaluations, with s_p from `probe_bytes` per latency."""
    if probe_bytes < 1:
        raise ValueError(f"{probe_bytes=} must be >= 1 (bytes of KV each latency was measured on)")
    points = tuple(ProfilePoint(e.spec_id, e.accuracy, e.cr, e.latency_s, probe_bytes / max(e.latency_s, 1e-12))
                   for e in pareto_front(result.feasible))
    search = {"evaluations": len(result.evaluations), "space_size": result.space_size, "stopped": result.stopped,
              "pruned": result.pruned}
    return ProfileFile(workload, result.acc_threshold, probe_bytes, points, search)


def save_profile(path: str | Path, profile: ProfileFile) -> None:
    obj = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "workload": profile.workload,
           "acc_threshold": profile.acc_threshold, "probe_bytes": profile.probe_bytes, "search": profile.search,
           "created_unix": time.time(), "points": [asdict(p) for p in profile.points]}
    Path(path).write_text(json.dumps(obj, indent=1))


def load_profile(path: str | Path) -> ProfileFile:
    """Read a profile file; unknown format/version or malformed points raise ValueError naming the file."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON profile file ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: not a {PROFILE_FORMAT} file")
    if obj.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: profile version {obj.get('version')!r} unsupported; this jkv reads {PROFILE_VERSION}")
    try:
        points = tuple(ProfilePoint(str(p["spec_id"]), float(p["accuracy"]), float(p["cr"]), float(p["latency_s"]),
                                    float(p["throughput_Bps"])) for p in obj["points"])
        for p in points:
            if not is_dropping_id(p.spec_id):  # token tiers / streaming heads: jkv.compression.dropping
                PipelineSpec.parse(p.spec_id)
            if p.cr <= 0 or p.throughput_Bps <= 0:
                raise ValueError(f"profile {p.spec_id} needs cr > 0 and throughput > 0")
        return ProfileFile(str(obj["workload"]), float(obj["acc_threshold"]), int(obj["probe_bytes"]), points,
                           dict(obj.get("search", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed profile ({e})") from None


@dataclass(frozen=True)
class FidelityResult:
    rel_error_k: float  # ||K - K_hat|| / ||K|| over all layers
    rel_error_v: float
    attn_rel_error: float  # ||O - O_hat|| / ||O||, O = softmax(q K^T / sqrt(D)) V
    cr: float  # all container bytes counted
    latency_s: float  # encode + decode of all blocks

    @property
    def accuracy(self) -> float:
        """Fidelity proxy in [0, 1]: 1 - relative attention-output error."""
        return max(0.0, 1.0 - self.attn_rel_error)


class FidelityObjective:
    """`evaluate(spec) -> (accuracy, cr, latency_s)` from KV arrays alone (no model needed).

    kv: per layer (K, V), each [H_kv, N, D]; queries: per layer [H, Tq, D] (default: the last
    `n_queries` keys of each KV head, used as queries over the full, non-causal context).
    """

    def __init__(self, kv: Sequence[tuple[np.ndarray, np.ndarray]], queries: Sequence[np.ndarray] | None = None,
                 calibration: Calibration | None = None, n_queries: int = 16):
        if not kv:
            raise ValueError("FidelityObjective needs KV for at least one layer")
        self.kv = [(np.asarray(k), np.asarray(v)) for k, v in kv]
        for layer, (k, v) in enumerate(self.kv):
            if k.ndim != 3 or k.shape != v.shape:
                raise ValueError(f"layer {layer}: K {k.shape} and V {v.shape} must both be [H_kv, N, D]")
        if queries is None:
            queries = [k[:, -n_queries:, :] for k, _ in self.kv]
        if len(queries) != len(self.kv):
            raise ValueError(f"{len(queries)} query arrays for {len(self.kv)} layers")
        self.queries = [np.asarray(q, np.float32) for q in queries]
        self.calibration = calibration
        self.probe_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv)
        self._reference = [self._attend(q, k, v) for q, (k, v) in zip(self.queries, self.kv)]

    @staticmethod
    def _attend(q, k, v) -> np.ndarray:
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        group = q.shape[0] // k.shape[0]
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        logits = q @ np.swapaxes(k, 1, 2) / np.sqrt(q.shape[-1])
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v

    def measure(self, spec: PipelineSpec) -> FidelityResult:
        pipe = Pipeline(spec, self.calibration)
        for layer, (k, v) in enumerate(self.kv[:1]):  # compile outside the timed pass
            [decode_block(b) for b in pipe.encode_kv(k, v, layer=layer)]
        t0 = time.perf_counter()
        blocks = [pipe.encode_kv(k, v, layer=layer) for layer, (k, v) in enumerate(self.kv)]
        decoded = [(np.asarray(decode_block(kb)), np.asarray(decode_block(vb))) for kb, vb in blocks]
        latency = time.perf_counter() - t0
        nbytes = sum(len(kb) + len(vb) for kb, vb in blocks)
        num = {"k": 0.0, "v": 0.0, "o": 0.0}
        den = {"k": 0.0, "v": 0.0, "o": 0.0}
        for (k, v), (k_hat, v_hat), q, ref in zip(self.kv, decoded, self.queries, self._reference):
            for key, a, b in (("k", k, k_hat), ("v", v, v_hat), ("o", ref, self._attend(q, k_hat, v_hat))):
                a = np.asarray(a, np.float64)
                num[key] += float(np.sum((a - np.asarray(b, np.float64)) ** 2))
                den[key] += float(np.sum(a ** 2))
        rel = {key: math.sqrt(num[key] / den[key]) if den[key] else 0.0 for key in num}
        return FidelityResult(rel["k"], rel["v"], rel["o"], self.probe_bytes / nbytes, latency)

    def __call__(self, spec: PipelineSpec) -> tuple[float, float, float]:
        r = self.measure(spec)
        return r.accuracy, r.cr, r.latency_s
