"""Per-request compression choice on the decode side: `compression="off" | "auto" | <pipeline id>`.

    policy = CompressionPolicy(CompressionConfig("auto", profiles=("code.json",)), bandwidth_bps=1e9)
    choice = policy.choose(kv_bytes=V, t_model_s=tp)      # once per request (KVServe §6)
    ...                                                    # the request's KV moves with choice.spec_id
    policy.observe_link(nbytes, busy_s)                    # the prefill side's busy-time goodput
    policy.observe(choice, seconds)                        # feedback for the residual bandit

"off" never builds a choice (the request's messages are byte-identical to the uncompressed path);
a pipeline id (a profile's `spec_id`) is used for every request; "auto" asks the `Controller`
with the context (workload, B from the live estimator, T_SLO, q_min) and the request's volume V
(float32 bytes). Profile files hold CR against fp16 KV; the wire carries fp16 containers instead
of float32 rows, so the controller's lines use cr_wire = cr * 4 / 2 (`kv_transfer.WIRE_ITEMSIZE`).

Concurrency: `choose` runs on the decode worker's generate thread, `observe_link` on its notify
thread; the estimator and the controller lock their own state. No threads are started here.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from jkv.compression.bandwidth import BandwidthEstimator
from jkv.compression.controller import BASELINE, Context, Controller, ControllerConfig, Decision, Profile
from jkv.compression.dropping import inner_pipeline, parse_drop, servable
from jkv.compression.kv_transfer import WIRE_ITEMSIZE
from jkv.compression.paths import PathChoice, PathCosts, check_metadata_option, choose_paths
from jkv.compression.profiling import ProfileFile, load_profile
from jkv.compression.spec import PipelineSpec

log = logging.getLogger(__name__)

POOL_ITEMSIZE = 4  # the host pools hold float32 KV
WARM_RECEIVE_TOKENS = 4096  # a decode worker compiles the chunk decode of prompts up to this at start
CALIBRATION_TOKENS = 128  # `calibrate_for`'s probe: one container per layer at the default chunking
TIERS_PREFIX = "tiers:"  # `tokens.TierConfig` ids; hi-only ones are servable (`dropping.py`)


@dataclass(frozen=True)
class CompressionConfig:
    """mode: "off" | "auto" | a pipeline id; profiles: profile files (`jkv compress-profile`) for
    "auto"; workload: which file's Pareto set (default: the first); q_min: quality the request
    needs; t_slo_s: its KV-movement SLO (guardrail); min_sample_bytes: link samples smaller than this
    are ignored (a paced link's token bucket lets a burst of >= 64 KiB pass at memory speed, so a
    small transfer says nothing about the link rate); calibrate: "auto" measures the transfer path
    of every profile it may choose on this machine when a decode worker starts (`calibrate_for`)
    instead of charging the profile file's codec speed, which was measured elsewhere (the committed
    file's 1.2-10 MB/s came from a box at load 15-50: on a quiet one the controller then chose the
    1.9x codec over the 3.2x one, whose real path runs several times faster); metadata: the selector
    metadata's codec, "auto" (lossless with a fixed pipeline; in "auto" mode the per-path envelope,
    with lossy `q8+zstd1` offered only to requests whose push is lossy, `paths.choose_paths`) or
    one codec for every request ("none", "zstd1", "q8+zstd1")."""

    mode: str = "off"
    profiles: tuple[str, ...] = ()
    workload: str | None = None
    q_min: float = 0.97
    t_slo_s: float = math.inf
    min_sample_bytes: int = 128 << 10
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    path_costs: PathCosts = field(default_factory=PathCosts)  # (cr, s) of the on-demand / metadata options
    calibrate: bool = True
    metadata: str = "auto"  # selector metadata codec: "auto" (paths.choose_paths), "none", "zstd1", "q8+zstd1"

    def __post_init__(self):
        if self.mode not in ("off", "auto"):
            try:
                if parse_drop(self.mode) is None:
                    PipelineSpec.parse(self.mode)
            except ValueError as e:
                raise ValueError(f"compression={self.mode!r} must be 'off', 'auto', a pipeline id such as "
                                 f"'hadamard+kivi4g32+zstd3' or a token-dropping id such as "
                                 f"'duo50s16w64:hadamard+kivi4g128+zstdh3' ({e})") from None
        if self.mode == "auto" and not self.profiles:
            raise ValueError("compression='auto' needs profile files: compression_options={'profiles': [path]} "
                             "(make one with `jkv compress-profile`)")
        check_metadata_option(self.metadata)
        if not 0 < self.q_min <= 1 or not self.t_slo_s > 0:
            raise ValueError(f"need 0 < {self.q_min=} <= 1 and {self.t_slo_s=} > 0")

    @classmethod
    def from_options(cls, mode: str, options: dict) -> "CompressionConfig":
        known = {"profiles", "workload", "q_min", "t_slo_s", "min_sample_bytes", "calibrate", "metadata"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown compression options {sorted(unknown)}; known: {sorted(known)}")
        opts = dict(options)
        if "profiles" in opts:
            p = opts["profiles"]
            opts["profiles"] = (p,) if isinstance(p, str) else tuple(p)
        return cls(mode, **opts)


@dataclass(frozen=True)
class Choice:
    spec_id: str  # BASELINE ("identity+none+none") = uncompressed block writes
    decision: Decision | None = None  # the controller's, in "auto"
    t_model_known: bool = False  # T_model was given: an observed JCT is comparable with the prediction
    reason: str = "fixed"  # why: "fixed" (a configured pipeline), "no_estimate", or the controller's reason
    paths: PathChoice | None = None  # the on-demand and metadata choice that goes with it (`paths.choose_paths`)

    @property
    def on_demand(self) -> str | None:
        return self.paths.on_demand if self.paths is not None else None

    @property
    def metadata(self) -> str | None:
        return self.paths.metadata if self.paths is not None else None


def wire_profiles(profile: ProfileFile) -> list[Profile]:
    """Controller lines for float32 pools sending fp16 containers. Profile files count fp16 bytes;
    V is float32 bytes here, so both cr and s_p (bytes per second of codec time) scale by 4 / 2."""
    scale = POOL_ITEMSIZE / WIRE_ITEMSIZE
    kept = [p for p in profile.points if servable(p.spec_id)]  # token-dropping ones too (`dropping.py`)
    if len(kept) < len(profile.points):
        log.info("profile %s: %d points skipped as not servable (token tiers with a lo tier, or per-head bit "
                 "tables with dropping): %s", profile.workload, len(profile.points) - len(kept),
                 sorted({p.spec_id for p in profile.points} - {p.spec_id for p in kept}))
    return [Profile(p.spec_id, p.cr * scale, p.throughput_Bps * scale, p.accuracy) for p in kept]


def path_profiles(profile: ProfileFile, path_Bps: dict[str, float]) -> list[Profile]:
    """`wire_profiles` with s_p replaced by the measured transfer-path throughput (float32 bytes per
    second of encode + prefill-side decode + framing + receiver decode, `kv_transfer.path_throughput_Bps`)
    where one is given. The profile file's round-trip s_p undercharges the path: the prefill side also
    decodes every chunk (`RequestCodec.absorb`, for the transfer-mode invariant), so a profile the
    round trip calls worth it at a fast link can cost more than it saves (Theorem 6.1's B*_p moves)."""
    bad = {k: v for k, v in path_Bps.items() if not v > 0}
    if bad:
        raise ValueError(f"path throughputs must be > 0 B/s, got {bad}")
    return [Profile(p.name, p.cr, path_Bps.get(p.name, p.throughput_Bps), p.quality) for p in wire_profiles(profile)]


class CompressionPolicy:
    def __init__(self, config: CompressionConfig, *, bandwidth_bps: float | None = None,
                 profiles: list[ProfileFile] | None = None, path_Bps: dict[str, float] | None = None):
        self.config = config
        self.estimator = BandwidthEstimator(initial_Bps=bandwidth_bps / 8 if bandwidth_bps else None)
        self.controller = None
        self.files: list[ProfileFile] = []
        self.workload = config.workload
        if config.mode == "auto":
            self.files = profiles if profiles is not None else [load_profile(p) for p in config.profiles]
            self.workload = config.workload or self.files[0].workload
            self.path_Bps: dict[str, float] = dict(path_Bps or {})  # measured path s_p (`calibrate_path`)
            self._build_controller()

    def _build_controller(self) -> None:
        self.controller = Controller({f.workload: path_profiles(f, self.path_Bps) for f in self.files},
                                     self.config.controller, self.estimator)
        self.controller.envelope(self.workload, self.config.q_min)  # raises naming an unknown workload

    def calibrate_for(self, cfg, tokens: int = CALIBRATION_TOKENS, seed: int = 0) -> dict[str, float]:
        """`calibrate_path` for a model of config `cfg` (num_layers, num_kv_heads, head_dim) on a
        synthetic probe f32[2, L, H_kv, tokens, D] (standard normal: the quantizers' work does not
        depend on the values; an entropy coder may run a little faster on real KV's codes), for the
        profiles the quality floor lets the controller choose. A decode worker calls it at start;
        a no-op ({}) unless mode "auto" with `calibrate`, or when already measured."""
        if self.controller is None or not self.config.calibrate or not self._unmeasured(self.config.q_min):
            return {}  # a policy shared by several workers is measured once, its controller kept
        started = time.perf_counter()
        probe = np.random.default_rng(seed).standard_normal(
            (2, cfg.num_layers, cfg.num_kv_heads, tokens, cfg.head_dim), dtype=np.float32)
        measured = self.calibrate_path(probe, min_quality=self.config.q_min)
        log.info("compression: transfer paths of %d profiles measured in %.1f s (%s)", len(measured),
                 time.perf_counter() - started, ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in measured.items()))
        return measured

    def pipelines(self) -> list[str]:
        """The compressing pipelines this policy may choose (a token-dropping id: its kept rows'
        pipeline): a fixed one, or in "auto" each servable profile point at or above the quality
        floor. What the codecs of both sides warm up for (`warm_receive`, the prefill worker's
        "warm_codec" notification)."""
        if self.config.mode == "off":
            return []
        if self.config.mode == "auto":
            ids = {inner_pipeline(p.spec_id) for f in self.files for p in f.points
                   if servable(p.spec_id) and p.accuracy >= self.config.q_min}
        else:
            ids = {inner_pipeline(self.config.mode)}
        return sorted({PipelineSpec.parse(i).id for i in ids} - {BASELINE})

    def warm_receive(self, cfg, max_tokens: int = WARM_RECEIVE_TOKENS) -> int:
        """Compile the decode side of every pipeline this policy may choose (a fixed one, or in
        "auto" each servable profile point at or above the quality floor) for prompts of up to
        `max_tokens` (`kv_transfer.warm_receive`). A decode worker calls it at start, so no frame
        compiles on the notify thread while requests wait on it. Returns programs compiled."""
        from jkv.compression.kv_transfer import KVCodec, warm_receive

        ids = self.pipelines()
        codec, started, compiled = KVCodec(), time.perf_counter(), 0
        for spec_id in ids:
            compiled += warm_receive(codec.pipeline(spec_id), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                     max_tokens)
        log.info("compression: %d receive programs of %d pipelines compiled in %.1f s", compiled, len(ids),
                 time.perf_counter() - started)
        return compiled

    def calibrate_path(self, kv_probe, *, codec=None, min_chunk_tokens: int = 128,
                       blocks_per_layer: int | None = None, repeats: int = 2,
                       min_quality: float = 0.0) -> dict[str, float]:
        """Measure every profile's real transfer-path cost on kv_probe f32[2, L, H_kv, N, D] (ideally
        one request's KV at its real geometry) and charge it instead of the profile file's round trip
        (`path_profiles`). Call before serving: it rebuilds the controller (bandit state is reset).
        min_quality: skip profiles below it (the controller never chooses them under that floor).
        Returns {spec_id: float32 bytes / s}."""
        from jkv.compression.kv_transfer import KVCodec, path_throughput_Bps

        if self.controller is None:
            raise ValueError(f"calibrate_path needs compression='auto', not {self.config.mode!r}")
        codec = codec or KVCodec(min_chunk_tokens=min_chunk_tokens)
        for p in self._unmeasured(min_quality):
            # a dropping profile is charged its kept rows' pipeline over every row: an upper
            # bound of its codec work (the keep decision's replay is not charged)
            self.path_Bps[p.spec_id] = path_throughput_Bps(
                codec.pipeline(inner_pipeline(p.spec_id)), kv_probe, min_chunk_tokens=min_chunk_tokens,
                blocks_per_layer=blocks_per_layer, repeats=repeats)
            log.info("compression profile %s: transfer path %.1f MB/s (float32), round trip %.1f MB/s",
                     p.spec_id, self.path_Bps[p.spec_id] / 1e6, p.throughput_Bps * POOL_ITEMSIZE / WIRE_ITEMSIZE / 1e6)
        self._build_controller()
        return dict(self.path_Bps)

    def _unmeasured(self, min_quality: float) -> list:
        """The servable profile points of at least `min_quality` whose transfer path is not measured yet."""
        return [p for f in self.files for p in f.points
                if p.spec_id not in self.path_Bps and servable(p.spec_id) and p.accuracy >= min_quality]

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off"

    def choose(self, kv_bytes: int, t_model_s: float = 0.0) -> Choice | None:
        """One choice per request (None when off). kv_bytes: the request's float32 KV bytes."""
        mode = self.config.mode
        if mode == "off":
            return None
        if mode != "auto":
            spec_id = mode if parse_drop(mode) is not None else PipelineSpec.parse(mode).id
            return Choice(spec_id, paths=choose_paths(spec_id, None, self.config.path_costs, fixed=True,
                                                      metadata=self.config.metadata))
        bandwidth = self.estimator.estimate()
        if bandwidth is None:
            log.warning("compression='auto': no bandwidth estimate yet (unpaced link, no transfer observed); "
                        "this request moves uncompressed")
            return Choice(BASELINE, reason="no_estimate",
                          paths=choose_paths(BASELINE, None, metadata=self.config.metadata))
        d = self.controller.decide(Context(self.workload, self.config.t_slo_s, self.config.q_min, int(kv_bytes),
                                           float(t_model_s)))
        # per path (KVServe §6.1 on each path's own lines): on-demand replies and metadata at the same B
        paths = choose_paths(d.profile.name, d.bandwidth_Bps, self.config.path_costs, metadata=self.config.metadata)
        return Choice(d.profile.name, d, t_model_s > 0, d.reason.split(":")[0], paths)  # "fallback: why" -> "fallback"

    def wire_bytes(self, choice: Choice | None, kv_bytes: int, metadata_bytes: int) -> tuple[float, float]:
        """(KV, metadata) bytes the request puts on its link under `choice`, for Eq. 2's Kr: with
        the push compressed cr times, cr times more blocks fit in the prefill window. The KV's cr is
        the controller's line for the chosen profile ("auto"; cr_wire against float32); a fixed
        pipeline has no measured cr here and counts as uncompressed (Kr as without compression,
        the conservative side). Metadata: the cr of its codec (`PathCosts.metadata_line`)."""
        if choice is None:
            return float(kv_bytes), float(metadata_bytes)
        d = choice.decision
        cr = d.profile.cr if d is not None and d.profile.name != BASELINE else 1.0
        meta_cr = self.config.path_costs.metadata_line(choice.metadata)[0]
        return kv_bytes / cr, metadata_bytes / meta_cr

    def observe_link(self, nbytes: int, busy_s: float) -> None:
        """A busy-time goodput sample of the link (bytes the prefill worker sent, seconds busy)."""
        if nbytes >= max(1, self.config.min_sample_bytes) and busy_s > 0:
            self.estimator.observe(nbytes, busy_s)

    def observe(self, choice: Choice | None, seconds: float) -> None:
        """Observed JCT of a request (Eq. 7 residual). Ignored without a T_model in its prediction:
        the residual of the arm that was tried would absorb the model time and bias the bandit
        against it (the untried arms keep residual 0)."""
        if choice is not None and choice.decision is not None and choice.t_model_known and self.controller:
            self.controller.observe(choice.decision, seconds)
