"""Service-aware online controller: one compression profile per request (KVServe §6).

Context c = (workload w, bandwidth B, T_SLO, q_min) plus the request's KV volume V and its
strategy-independent time T_model. A profile p = (cr_p, s_p, q_p) (from the offline Pareto set)
predicts (Eq. 1)

    T_p = T_model + V / s_p + V / (B * cr_p),        T_0 = T_model + V / B   (no compression).

Offline, per (workload, quality bucket): the lines T~_p(x) = 1/s_p + x/cr_p over x = 1/B (Eq. 6)
are reduced to their lower envelope — breakpoints 0 = x_0 < x_1 < ... with one optimal profile per
interval (Theorem 6.2). The uncompressed baseline (1/s = 0, slope 1) is one of the lines, so the
envelope never picks a profile where it does not pay off. Online, `decide`:

1. maps q_min to the strictest bucket that still guarantees it, and x = 1/B to its interval
   (bisect: O(log m));
2. candidates = the interval's profile and its `neighbours` on the envelope (§6.2);
3. drops profiles that cannot beat no compression at this B: B >= B*_p = (1 - 1/cr_p) s_p
   (Theorem 6.1, Eq. 5), profiles in cooldown, and profiles whose prediction exceeds T_SLO
   (guardrail); if none is left, the configured conservative fallback is used;
4. epsilon-greedy on the residual-corrected time T_eff = T_hat + EWMA residual (Eqs. 7-8), with
   one residual per (workload, bucket, interval, profile).

Overlap-aware prediction (`ControllerConfig.overlap_push`, used when T_model > 0 is known): jkv pushes
the KV layer by layer while the prefill runs, and the codec runs inline in the prefill's per-layer
callback, so the transfer hides behind the (codec-extended) prefill instead of adding to it:

    T_p = max(T_model + V / s_p, V / (B * cr_p)),        T_0 = max(T_model, V / B).

Eq. 1's sum overstates T_0 by up to T_model and so calls compression worth it on links fast enough for
the push to hide behind the prefill. There, the envelope's interval only picks the candidates
(baseline always added) and Theorem 6.1's filter becomes "T_p <= (1 - min_gain) T_0" under this model
(a margin against the break-even, where the prediction's error decides the sign of the gain).

`observe(decision, observed_s)` updates the residual and the profile's recent SLO violations;
K violations among its last M uses put the profile in cooldown for a number of decisions.

Concurrency: no threads. `decide` and `observe` may be called from different threads (request
path, transfer completion callbacks); a lock guards the bandit state. Pure Python, < 1 ms per
decision (`experiments/bench_controller.py`).
"""
from __future__ import annotations

import bisect
import logging
import math
import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jkv.compression.bandwidth import BandwidthEstimator
from jkv.compression.spec import UNCOMPRESSED

log = logging.getLogger(__name__)

BASELINE = UNCOMPRESSED.id  # "identity+none+none": no compression


@dataclass(frozen=True)
class Profile:
    """p = (cr_p, s_p, q_p): compression ratio, effective (de)compression throughput B/s, quality."""

    name: str
    cr: float
    throughput_Bps: float
    quality: float

    def __post_init__(self):
        if not self.cr > 0 or not self.throughput_Bps > 0:
            raise ValueError(f"profile {self.name}: need cr > 0 and throughput > 0, got {self.cr}, {self.throughput_Bps}")

    @property
    def intercept(self) -> float:
        """1 / s_p: seconds of (de)compression per uncompressed byte (Eq. 6)."""
        return 1.0 / self.throughput_Bps

    @property
    def slope(self) -> float:
        """1 / cr_p (Eq. 6)."""
        return 1.0 / self.cr

    @property
    def threshold_Bps(self) -> float:
        """B*_p = (1 - 1/cr_p) s_p: compression pays off only below this bandwidth (Eq. 5)."""
        return (1.0 - 1.0 / self.cr) * self.throughput_Bps


BASELINE_PROFILE = Profile(BASELINE, 1.0, math.inf, 1.0)


@dataclass(frozen=True)
class Context:
    """c = (w, B, T_SLO, q_min) and the request's volume. bandwidth_Bps=None: use the estimator."""

    workload: str
    t_slo_s: float
    q_min: float
    kv_bytes: int
    t_model_s: float = 0.0
    bandwidth_Bps: float | None = None

    def __post_init__(self):
        if self.kv_bytes < 0 or self.t_model_s < 0 or not self.t_slo_s > 0:
            raise ValueError(f"need kv_bytes >= 0, t_model_s >= 0, t_slo_s > 0; got {self}")
        if self.bandwidth_Bps is not None and not self.bandwidth_Bps > 0:
            raise ValueError(f"{self.bandwidth_Bps=} must be > 0")


@dataclass(frozen=True)
class ControllerConfig:
    quality_buckets: tuple[float, ...] = (0.99, 0.97, 0.95, 0.90)  # plus 1.0 (lossless) always
    neighbours: int = 1  # envelope neighbours on each side added to the candidate set
    epsilon: float = 0.1  # exploration probability
    residual_alpha: float = 0.2  # EWMA weight of a new residual (Eq. 7)
    violation_k: int = 2  # K: SLO violations ...
    violation_window: int = 5  # ... among the last M uses of a profile ...
    cooldown_decisions: int = 50  # ... remove it for this many decisions
    fallback: str = BASELINE  # conservative default when no candidate meets the SLO
    seed: int = 0
    overlap_push: bool = True  # with T_model known: layer-wise push overlaps prefill (see module docstring)
    min_gain: float = 0.05  # overlap model: compress only if predicted T_p <= (1 - min_gain) T_0 (break-even margin)

    def __post_init__(self):
        if not all(0 < q <= 1 for q in self.quality_buckets):
            raise ValueError(f"quality buckets {self.quality_buckets} must lie in (0, 1]")
        if self.neighbours < 0 or not 0 <= self.epsilon <= 1 or not 0 < self.residual_alpha <= 1:
            raise ValueError(f"need {self.neighbours=} >= 0, {self.epsilon=} in [0,1], {self.residual_alpha=} in (0,1]")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"{self.min_gain=} must lie in [0, 1)")
        if not 1 <= self.violation_k <= self.violation_window or self.cooldown_decisions < 0:
            raise ValueError(f"need 1 <= {self.violation_k=} <= {self.violation_window=}, {self.cooldown_decisions=} >= 0")


@dataclass(frozen=True)
class Envelope:
    """Lower envelope of T~_p(x) = intercept + slope * x over x = 1/B >= 0 (Theorem 6.2)."""

    breakpoints: tuple[float, ...]  # x_0 = 0 < x_1 < ...; profiles[i] is optimal on [x_i, x_{i+1})
    profiles: tuple[Profile, ...]

    def index(self, x: float) -> int:
        return bisect.bisect_right(self.breakpoints, x) - 1


def lower_envelope(profiles: Sequence[Profile]) -> Envelope:
    """Exact lower envelope of the profiles' lines on x >= 0 (ties: the flatter line continues)."""
    if not profiles:
        raise ValueError("lower_envelope needs at least one profile")
    current = min(profiles, key=lambda p: (p.intercept, p.slope))
    xs, env = [0.0], [current]
    while True:
        best = None
        for p in profiles:
            if p.slope >= current.slope:
                continue
            x = (p.intercept - current.intercept) / (current.slope - p.slope)
            key = (max(x, xs[-1]), p.slope)
            if best is None or key < best[0]:
                best = (key, p)
        if best is None:
            return Envelope(tuple(xs), tuple(env))
        (x, _), current = best
        if x <= xs[-1]:  # takes over where the previous segment started: that segment is empty
            env[-1] = current
        else:
            xs.append(x)
            env.append(current)


def predicted_time(p: Profile, ctx: Context, bandwidth_Bps: float, overlap: bool = False) -> float:
    """Eq. 1: T_model + V/s_p + V/(B cr_p); overlap (and T_model > 0): max(T_model + V/s_p, V/(B cr_p))."""
    if overlap and ctx.t_model_s > 0:
        # Departs from Eq. 1's sum: the layer-wise push overlaps the prefill, which the inline codec
        # (prefill-side on_layer) extends, so only transfer beyond T_model + V/s_p adds to the JCT.
        return max(ctx.t_model_s + ctx.kv_bytes * p.intercept, ctx.kv_bytes * p.slope / bandwidth_Bps)
    return ctx.t_model_s + ctx.kv_bytes * (p.intercept + p.slope / bandwidth_Bps)


@dataclass(frozen=True)
class Decision:
    profile: Profile
    predicted_s: float  # analytical T_hat (Eq. 1, or its overlap-aware form)
    corrected_s: float  # T_hat + residual (Eq. 8)
    bandwidth_Bps: float
    candidates: tuple[str, ...]
    env_key: tuple  # (workload, bucket, interval)
    t_slo_s: float
    reason: str  # "greedy" | "explore" | "fallback: ..."


@dataclass
class _Arm:
    residual: float = 0.0
    uses: int = 0


@dataclass
class _ProfileHealth:
    recent: deque = field(default_factory=deque)  # bools: SLO violated, last M uses
    cooldown_until: int = -1


class Controller:
    """Picks one profile per request; see the module docstring for the algorithm."""

    def __init__(self, profiles: Mapping[str, Sequence[Profile]], config: ControllerConfig = ControllerConfig(),
                 estimator: BandwidthEstimator | None = None):
        self.config = config
        self.estimator = estimator
        self.buckets = tuple(sorted(set(config.quality_buckets) | {1.0}))  # ascending
        self._envelopes: dict[tuple[str, float], Envelope] = {}
        self._by_name: dict[str, dict[str, Profile]] = {}
        for workload, plist in profiles.items():
            named = {p.name: p for p in plist if p.name != BASELINE}
            if len(named) != len([p for p in plist if p.name != BASELINE]):
                raise ValueError(f"workload {workload!r}: duplicate profile names")
            self._by_name[workload] = {BASELINE: BASELINE_PROFILE, **named}
            for bucket in self.buckets:
                lines = [BASELINE_PROFILE] + [p for p in named.values() if p.quality >= bucket]
                self._envelopes[(workload, bucket)] = lower_envelope(lines)
            if config.fallback not in self._by_name[workload]:
                raise ValueError(f"fallback profile {config.fallback!r} is not among workload {workload!r}'s profiles")
        self._arms: dict[tuple, _Arm] = {}
        self._health: dict[str, _ProfileHealth] = {}
        self._decisions = 0
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    @classmethod
    def from_profile_files(cls, files, config: ControllerConfig = ControllerConfig(),
                           estimator: BandwidthEstimator | None = None) -> "Controller":
        """Build from `profiling.ProfileFile`s (one per workload); accuracy becomes q_p."""
        return cls({f.workload: [Profile(p.spec_id, p.cr, p.throughput_Bps, p.accuracy) for p in f.points]
                    for f in files}, config, estimator)

    def bucket_for(self, q_min: float) -> float:
        """Strictest bucket threshold that still guarantees q_min (1.0 = lossless only)."""
        i = bisect.bisect_left(self.buckets, q_min)
        if i == len(self.buckets):
            raise ValueError(f"{q_min=} exceeds 1.0")
        return self.buckets[i]

    def envelope(self, workload: str, q_min: float) -> Envelope:
        try:
            return self._envelopes[(workload, self.bucket_for(q_min))]
        except KeyError:
            raise ValueError(f"unknown workload {workload!r}; profiled: {sorted(self._by_name)}") from None

    def decide(self, ctx: Context) -> Decision:
        """Choose the profile for one request (fixed for all of its KV movement)."""
        bandwidth = ctx.bandwidth_Bps if ctx.bandwidth_Bps is not None else (
            self.estimator.estimate() if self.estimator else None)
        if bandwidth is None:
            raise ValueError("no bandwidth: pass Context(bandwidth_Bps=...) or feed the controller's estimator")
        bucket = self.bucket_for(ctx.q_min)
        env = self.envelope(ctx.workload, ctx.q_min)
        i = env.index(1.0 / bandwidth)
        lo, hi = max(0, i - self.config.neighbours), min(len(env.profiles), i + self.config.neighbours + 1)
        key = (ctx.workload, bucket, i)
        overlap = self.config.overlap_push and ctx.t_model_s > 0
        candidates = list(env.profiles[lo:hi])
        if overlap:
            t_base = predicted_time(BASELINE_PROFILE, ctx, bandwidth, True)
            if BASELINE_PROFILE not in candidates:
                candidates.insert(0, BASELINE_PROFILE)
        with self._lock:
            now = self._decisions
            self._decisions += 1
            scored = []
            for p in candidates:
                t_hat = predicted_time(p, ctx, bandwidth, overlap)
                # Theorem 6.1, or its overlap-aware form with the break-even margin
                pays_off = (t_hat <= (1 - self.config.min_gain) * t_base) if overlap else bandwidth < p.threshold_Bps
                if p.name != BASELINE and not pays_off:
                    continue
                health = self._health.get(p.name)
                if health is not None and health.cooldown_until > now:
                    continue
                if t_hat > ctx.t_slo_s:  # guardrail: predicted T must meet the SLO
                    continue
                arm = self._arms.get(key + (p.name,))
                scored.append((t_hat + (arm.residual if arm else 0.0), t_hat, p))
            if not scored:
                p = self._by_name[ctx.workload][self.config.fallback]
                t_hat = predicted_time(p, ctx, bandwidth, overlap)
                return Decision(p, t_hat, t_hat, bandwidth, (), key, ctx.t_slo_s,
                                "fallback: no candidate predicted to meet the SLO")
            scored.sort(key=lambda s: s[0])
            choice, reason = scored[0], "greedy"
            if len(scored) > 1 and self._rng.random() < self.config.epsilon:
                choice, reason = self._rng.choice(scored[1:]), "explore"
            return Decision(choice[2], choice[1], choice[0], bandwidth, tuple(s[2].name for s in scored), key,
                            ctx.t_slo_s, reason)

    def observe(self, decision: Decision, observed_s: float) -> None:
        """Feed back the request's observed JCT: residual EWMA (Eq. 7) and SLO-violation history."""
        if not math.isfinite(observed_s) or observed_s < 0:
            raise ValueError(f"{observed_s=} must be a finite time >= 0")
        cfg = self.config
        name = decision.profile.name
        with self._lock:
            if not decision.reason.startswith("fallback"):
                arm = self._arms.setdefault(decision.env_key + (name,), _Arm())
                delta = observed_s - decision.predicted_s
                # The first residual initializes the EWMA (no bias toward 0 for rarely used arms).
                arm.residual = delta if arm.uses == 0 else (1 - cfg.residual_alpha) * arm.residual + cfg.residual_alpha * delta
                arm.uses += 1
            health = self._health.setdefault(name, _ProfileHealth(deque(maxlen=cfg.violation_window)))
            health.recent.append(observed_s > decision.t_slo_s)
            if sum(health.recent) >= cfg.violation_k:
                health.cooldown_until = self._decisions + cfg.cooldown_decisions
                health.recent.clear()
                log.warning("profile %s: %d SLO violations in its last %d uses; cooling down for %d decisions",
                            name, cfg.violation_k, cfg.violation_window, cfg.cooldown_decisions)

    def in_cooldown(self, name: str) -> bool:
        with self._lock:
            health = self._health.get(name)
            return health is not None and health.cooldown_until > self._decisions

    def residual(self, env_key: tuple, name: str) -> float | None:
        with self._lock:
            arm = self._arms.get(env_key + (name,))
            return arm.residual if arm else None
