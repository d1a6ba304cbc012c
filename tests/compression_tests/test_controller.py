"""Online controller on synthetic profiles: envelope, Theorem 6.1 filter, bandit, guardrails, cooldown."""
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.compression.bandwidth import BandwidthEstimator
from jkv.compression.controller import (BASELINE, BASELINE_PROFILE, Context, Controller, ControllerConfig, Profile,
                                        lower_envelope, predicted_time)
from jkv.compression.profiling import ProfileFile, ProfilePoint

GB = 1e9
# Fast-but-weak to slow-but-strong compressors (all quality 0.98 unless noted).
FAST = Profile("fast", cr=2.0, throughput_Bps=20 * GB, quality=0.98)
MID = Profile("mid", cr=4.0, throughput_Bps=8 * GB, quality=0.98)
STRONG = Profile("strong", cr=8.0, throughput_Bps=2 * GB, quality=0.96)
USELESS = Profile("useless", cr=1.05, throughput_Bps=1 * GB, quality=0.999)  # B* = 48 MB/s
PROFILES = {"code": [FAST, MID, STRONG, USELESS]}


def _brute_force_min(lines, x):
    return min(p.intercept + p.slope * x for p in lines)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1.01, 50), st.floats(0.05, 100)), min_size=1, max_size=12), st.integers(0, 10**6))
def test_envelope_breakpoints_match_brute_force(params, seed):
    lines = [BASELINE_PROFILE] + [Profile(f"p{i}", cr, s * GB, 1.0) for i, (cr, s) in enumerate(params)]
    env = lower_envelope(lines)
    xs = env.breakpoints
    assert xs[0] == 0 and all(a < b for a, b in zip(xs, xs[1:]))
    assert all(a.slope > b.slope for a, b in zip(env.profiles, env.profiles[1:]))  # convexity
    rng = random.Random(seed)
    probes = [0.0] + [rng.uniform(0, 2 * (xs[-1] + 1e-9) + 1e-9) for _ in range(50)]
    probes += [(a + b) / 2 for a, b in zip(xs, xs[1:])] + [x * (1 + 1e-9) for x in xs]
    for x in probes:
        p = env.profiles[env.index(x)]
        best = _brute_force_min(lines, x)
        assert p.intercept + p.slope * x <= best * (1 + 1e-9) + 1e-18
    # Each breakpoint is where two consecutive envelope lines cross.
    for x, a, b in zip(xs[1:], env.profiles, env.profiles[1:]):
        assert a.intercept + a.slope * x == pytest.approx(b.intercept + b.slope * x, rel=1e-9)


def test_envelope_of_the_synthetic_profiles():
    env = lower_envelope([BASELINE_PROFILE, FAST, MID, STRONG, USELESS])
    assert [p.name for p in env.profiles] == [BASELINE, "fast", "mid", "strong"]
    # baseline/fast cross where x = intercept_fast / (1 - 1/2): that is B = B*_fast.
    assert 1 / env.breakpoints[1] == pytest.approx(FAST.threshold_Bps)
    assert "useless" not in [p.name for p in env.profiles]


def test_theorem_61_threshold_is_exact():
    ctx = Context("code", t_slo_s=1e9, q_min=0.9, kv_bytes=10**9)
    for p in (FAST, MID, STRONG, USELESS):
        b_star = p.threshold_Bps
        t0 = lambda b: predicted_time(BASELINE_PROFILE, ctx, b)  # noqa: E731
        assert predicted_time(p, ctx, b_star * 0.99) < t0(b_star * 0.99)
        assert predicted_time(p, ctx, b_star * 1.01) > t0(b_star * 1.01)


def test_filter_removes_non_beneficial_profiles_from_candidates():
    ctl = Controller(PROFILES, ControllerConfig(neighbours=5, epsilon=0.0))
    high = ctl.decide(Context("code", t_slo_s=100, q_min=0.95, kv_bytes=10**9, bandwidth_Bps=50 * GB))
    assert high.profile.name == BASELINE and high.candidates == (BASELINE,)  # 50 GB/s > every B*
    mid_bw = 5 * GB  # above B*_strong = 1.75 GB/s, below B*_fast = 10 GB/s and B*_mid = 6 GB/s
    d = ctl.decide(Context("code", t_slo_s=100, q_min=0.95, kv_bytes=10**9, bandwidth_Bps=mid_bw))
    assert "strong" not in d.candidates and {"fast", "mid"} <= set(d.candidates)
    assert d.profile.name == min((FAST, MID), key=lambda p: predicted_time(p, Context("code", 100, 0.95, 10**9), mid_bw)).name
    # 'useless' is never beneficial above 48 MB/s and is not on the envelope anyway.
    strict = Controller(PROFILES, ControllerConfig(quality_buckets=(0.999, 0.9), epsilon=0.0))
    ctx = dict(workload="code", t_slo_s=1e4, q_min=0.999, kv_bytes=10**9)
    assert strict.decide(Context(bandwidth_Bps=0.01 * GB, **ctx)).profile.name == "useless"  # 10 MB/s < B* = 48 MB/s
    assert strict.decide(Context(bandwidth_Bps=0.06 * GB, **ctx)).profile.name == BASELINE


def test_decision_matches_the_analytical_optimum_over_a_bandwidth_sweep():
    ctl = Controller(PROFILES, ControllerConfig(epsilon=0.0, overlap_push=False))  # Eq. 1 as written
    lines = [BASELINE_PROFILE, FAST, MID, STRONG]
    for b in np.geomspace(0.1 * GB, 100 * GB, 60):
        ctx = Context("code", t_slo_s=1e6, q_min=0.95, kv_bytes=10**9, t_model_s=0.5, bandwidth_Bps=b)
        d = ctl.decide(ctx)
        best = min(predicted_time(p, ctx, b) for p in lines)
        assert d.predicted_s == pytest.approx(best, rel=1e-12)


def test_quality_buckets_restrict_profiles():
    ctl = Controller(PROFILES)
    assert ctl.bucket_for(0.98) == 0.99 and ctl.bucket_for(0.97) == 0.97 and ctl.bucket_for(0.5) == 0.9
    assert ctl.bucket_for(0.9999) == 1.0
    assert [p.name for p in ctl.envelope("code", 0.97).profiles] == [BASELINE, "fast", "mid"]
    assert [p.name for p in ctl.envelope("code", 0.995).profiles] == [BASELINE]
    d = ctl.decide(Context("code", t_slo_s=1e6, q_min=0.97, kv_bytes=10**9, bandwidth_Bps=0.1 * GB))
    assert d.profile.name == "mid"  # strong is faster at 100 MB/s but below the quality bucket
    with pytest.raises(ValueError, match="unknown workload"):
        ctl.decide(Context("chat", t_slo_s=1, q_min=0.9, kv_bytes=1, bandwidth_Bps=GB))
    with pytest.raises(ValueError, match="exceeds 1.0"):
        ctl.bucket_for(1.5)


def _simulate(ctl, n, bandwidth, true_throughput, rng, t_slo=1e6, kv=10**9):
    chosen = []
    for _ in range(n):
        ctx = Context("code", t_slo_s=t_slo, q_min=0.95, kv_bytes=kv, t_model_s=0.2, bandwidth_Bps=bandwidth)
        d = ctl.decide(ctx)
        p = d.profile
        s = true_throughput.get(p.name, p.throughput_Bps)
        observed = ctx.t_model_s + kv / s + kv / (bandwidth * p.cr) if p.name != BASELINE else ctx.t_model_s + kv / bandwidth
        ctl.observe(d, observed * (1 + rng.gauss(0, 0.02)))
        chosen.append(p.name)
    return chosen


def test_bandit_converges_to_the_truly_fastest_under_injected_drift():
    ctl = Controller(PROFILES, ControllerConfig(epsilon=0.1, residual_alpha=0.3, seed=1, overlap_push=False))
    rng = random.Random(0)
    bandwidth = 2.5 * GB  # model-optimal: mid (T~ = 0.125 + 0.1) vs fast (0.05 + 0.2)
    ctx = Context("code", 1e6, 0.95, 10**9, bandwidth_Bps=bandwidth)
    assert ctl.decide(ctx).profile.name == "mid"
    before = _simulate(ctl, 150, bandwidth, {}, rng)
    assert before[-100:].count("mid") >= 80
    # Drift: mid's real throughput collapses to a third (GPU contention); fast is now truly fastest.
    after = _simulate(ctl, 250, bandwidth, {"mid": 8 * GB / 3}, rng)
    assert after[-100:].count("fast") >= 80
    # Drift gone: the residual decays back and mid wins again.
    recovered = _simulate(ctl, 250, bandwidth, {}, rng)
    assert recovered[-100:].count("mid") >= 80


def test_without_exploration_a_drifted_arm_is_still_abandoned():
    ctl = Controller(PROFILES, ControllerConfig(epsilon=0.0, overlap_push=False))
    chosen = _simulate(ctl, 20, 2.5 * GB, {"mid": 1 * GB}, random.Random(0))
    assert chosen[0] == "mid" and set(chosen[-10:]) == {"fast"}


def test_guardrail_uses_a_neighbour_that_meets_the_slo_else_the_fallback():
    ctl = Controller(PROFILES, ControllerConfig(epsilon=0.0, overlap_push=False))
    b = 0.5 * GB  # envelope optimum: strong (0.5 + 0.25 = 0.75 s/GB) vs mid (0.125 + 0.5)
    ctx = dict(workload="code", q_min=0.95, kv_bytes=10**9, t_model_s=0.1, bandwidth_Bps=b)
    assert ctl.decide(Context(t_slo_s=10, **ctx)).profile.name == "mid"  # mid 0.725 s beats strong 0.85 s
    # Residual makes mid look slow; SLO of 0.8 s leaves only mid by prediction (strong 0.85 > 0.8).
    d = ctl.decide(Context(t_slo_s=0.8, **ctx))
    assert d.profile.name == "mid" and "strong" not in d.candidates
    d = ctl.decide(Context(t_slo_s=0.5, **ctx))  # nothing can make it
    assert d.profile.name == BASELINE and d.reason.startswith("fallback") and d.candidates == ()
    ctl2 = Controller(PROFILES, ControllerConfig(epsilon=0.0, fallback="strong", overlap_push=False))
    assert ctl2.decide(Context(t_slo_s=0.5, **ctx)).profile.name == "strong"
    with pytest.raises(ValueError, match="fallback profile"):
        Controller(PROFILES, ControllerConfig(fallback="nope"))


def test_cooldown_after_k_violations_in_the_last_m_uses():
    cfg = ControllerConfig(epsilon=0.0, neighbours=0, violation_k=2, violation_window=3, cooldown_decisions=5)
    ctl = Controller(PROFILES, cfg)
    ctx = Context("code", t_slo_s=2.0, q_min=0.95, kv_bytes=10**9, bandwidth_Bps=2.5 * GB)

    def use(observed):
        d = ctl.decide(ctx)
        assert d.profile.name == "mid" and d.reason == "greedy"
        ctl.observe(d, observed)
        return d

    for observed in (3.0, 0.2, 0.2, 0.2, 3.0):  # violations 4 uses apart: never 2 within a window of 3
        use(observed)
    assert not ctl.in_cooldown("mid")
    use(0.2)
    d = use(3.0)  # window [viol, ok, viol]: K = 2 reached
    assert ctl.in_cooldown("mid")
    during = [ctl.decide(ctx) for _ in range(5)]
    assert all(x.profile.name == BASELINE and x.reason.startswith("fallback") for x in during)
    assert not ctl.in_cooldown("mid")
    use(0.2)  # back after exactly `cooldown_decisions` decisions, with a fresh violation window
    use(3.0)
    assert not ctl.in_cooldown("mid")
    assert ctl.residual(d.env_key, "mid") is not None


def test_bandwidth_estimator_ewma_and_controller_integration():
    est = BandwidthEstimator(alpha=0.5)
    assert est.estimate() is None
    ctl = Controller(PROFILES, ControllerConfig(epsilon=0.0), est)
    ctx = Context("code", t_slo_s=1e6, q_min=0.95, kv_bytes=10**9)
    with pytest.raises(ValueError, match="no bandwidth"):
        ctl.decide(ctx)
    assert est.observe(2 * 10**9, 1.0) == 2e9 and est.estimate() == 2e9
    est.observe(10**9, 1.0)
    assert est.estimate() == pytest.approx(1.5e9) and est.samples == 2
    assert ctl.decide(ctx).bandwidth_Bps == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="busy_s"):
        est.observe(10, 0.0)
    with pytest.raises(ValueError):
        BandwidthEstimator(alpha=0)
    est.reset(4e8)  # the link was re-paced to a known rate: start from it, samples forgotten
    assert est.estimate() == 4e8 and est.samples == 0
    assert ctl.decide(ctx).bandwidth_Bps == pytest.approx(4e8)
    with pytest.raises(ValueError, match="initial_Bps"):
        est.reset(0.0)


def test_from_profile_files_and_validation():
    f = ProfileFile("code", 0.97, 1 << 20, (ProfilePoint("hadamard+kivi4g32+zstd3", 0.98, 3.5, 0.01, 5e9),))
    ctl = Controller.from_profile_files([f])
    d = ctl.decide(Context("code", t_slo_s=1e3, q_min=0.97, kv_bytes=10**9, bandwidth_Bps=0.5 * GB))
    assert d.profile.name == "hadamard+kivi4g32+zstd3" and d.profile.cr == 3.5
    with pytest.raises(ValueError, match="need cr > 0"):
        Profile("x", 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="duplicate"):
        Controller({"w": [FAST, FAST]})
    with pytest.raises(ValueError):
        ControllerConfig(violation_k=6, violation_window=5)
    with pytest.raises(ValueError):
        Context("code", t_slo_s=0, q_min=0.9, kv_bytes=1)
    assert math.isclose(BASELINE_PROFILE.intercept, 0.0)


def _pipelined_jct(t_model, codec_s, link_s, layers=30):
    """Ground truth of a layer-wise push: layer l's prefill (+ its inline codec share) ends at
    (l+1)(t_model + codec_s)/L, then its KV (link_s / L) queues on the link behind the previous layer's."""
    step, done = (t_model + codec_s) / layers, 0.0
    for layer in range(layers):
        done = max(done, (layer + 1) * step) + link_s / layers
    return done


def test_overlap_aware_prediction_skips_compression_that_eq1_would_pick_on_a_fast_link():
    # The JCT sweep's 100 Gbit/s-eq point: V = 11.8 MB, Tp = 0.22 s, V/B = 0.355 s, the profile's cr 7.66
    # and its codec 0.15 s in place. Eq. 1 adds Tp to the transfer and predicts a 1.4x gain; the push
    # overlaps the prefill, so compression is in truth slower.
    v, tp, codec_s, cr = 11_800_000, 0.22, 0.15, 7.66
    prof = {"code": [Profile("kivi4", cr=cr, throughput_Bps=v / codec_s, quality=0.95)]}
    fast, slow = v / 0.355, v / 7.1
    truth = {b: (_pipelined_jct(tp, 0.0, v / b), _pipelined_jct(tp, codec_s, v / (b * cr))) for b in (fast, slow)}
    assert truth[fast][1] > truth[fast][0] and truth[slow][1] < truth[slow][0] / 5
    ctx = dict(workload="code", t_slo_s=1e6, q_min=0.9, kv_bytes=v, t_model_s=tp)
    eq1 = Controller(prof, ControllerConfig(epsilon=0.0, overlap_push=False))
    overlap = Controller(prof, ControllerConfig(epsilon=0.0))
    assert eq1.decide(Context(bandwidth_Bps=fast, **ctx)).profile.name == "kivi4"  # the additive model's mistake
    d = overlap.decide(Context(bandwidth_Bps=fast, **ctx))
    assert d.profile.name == BASELINE and d.predicted_s == pytest.approx(0.355)
    assert d.predicted_s == pytest.approx(truth[fast][0], rel=0.05)  # within the last layer's share
    d = overlap.decide(Context(bandwidth_Bps=slow, **ctx))
    assert d.profile.name == "kivi4" and d.predicted_s == pytest.approx(truth[slow][1], rel=0.05)


def test_overlap_aware_decision_is_the_best_predicted_and_eq1_without_t_model():
    ctl = Controller(PROFILES, ControllerConfig(epsilon=0.0))
    lines = [BASELINE_PROFILE, FAST, MID, STRONG]
    for b in np.geomspace(0.1 * GB, 100 * GB, 60):
        ctx = Context("code", t_slo_s=1e6, q_min=0.95, kv_bytes=10**9, t_model_s=0.5, bandwidth_Bps=b)
        d = ctl.decide(ctx)
        t0 = predicted_time(BASELINE_PROFILE, ctx, b, overlap=True)
        assert t0 == pytest.approx(max(0.5, 1e9 / b))
        assert d.predicted_s <= t0 and (d.profile.name == BASELINE or d.predicted_s < t0)
        # Never worse than the envelope neighbourhood's best under the overlap model.
        env = ctl.envelope("code", 0.95)
        i = env.index(1 / b)
        near = env.profiles[max(0, i - 1):i + 2] + (BASELINE_PROFILE,)
        assert d.predicted_s == pytest.approx(min(predicted_time(p, ctx, b, overlap=True) for p in near))
    # T_model unknown (0): Eq. 1's sum, the conservative additive charge.
    ctx = Context("code", t_slo_s=1e6, q_min=0.95, kv_bytes=10**9, bandwidth_Bps=GB)
    assert predicted_time(MID, ctx, GB, overlap=True) == predicted_time(MID, ctx, GB) == pytest.approx(0.125 + 0.25)


def test_overlap_margin_keeps_break_even_requests_uncompressed():
    prof = {"code": [Profile("p", cr=8.0, throughput_Bps=10 * GB, quality=0.95)]}
    # V = 1 GB, T_model 0.1 s, codec V/s = 0.1 s: T_p = max(0.2, V/(8B)).
    ctx = dict(workload="code", t_slo_s=1e6, q_min=0.9, kv_bytes=10**9, t_model_s=0.1)
    b = GB / 0.42  # T_0 = 0.42 s, T_p = max(0.2, 0.0525) = 0.2 s: a 2x gain, compress
    assert Controller(prof, ControllerConfig(epsilon=0.0)).decide(Context(bandwidth_Bps=b, **ctx)).profile.name == "p"
    b = GB / 0.205  # T_0 = 0.205 s vs T_p = 0.2 s: a 2.4 % predicted gain, inside the 5 % margin
    d = Controller(prof, ControllerConfig(epsilon=0.0)).decide(Context(bandwidth_Bps=b, **ctx))
    assert d.profile.name == BASELINE
    assert Controller(prof, ControllerConfig(epsilon=0.0, min_gain=0.0)).decide(
        Context(bandwidth_Bps=b, **ctx)).profile.name == "p"
    with pytest.raises(ValueError, match="min_gain"):
        ControllerConfig(min_gain=1.0)


def test_identity_when_every_predicted_gain_is_below_min_gain_even_while_exploring():
    # Profiles whose overlap-aware predicted gain over T_0 is below min_gain never pass the filter,
    # so neither greedy choice nor epsilon exploration (among the filtered candidates) can pick them.
    v, tp = 10**9, 0.2
    prof = {"code": [Profile("a", cr=8.0, throughput_Bps=v / 0.01, quality=0.95),   # T_p = 0.21
                     Profile("b", cr=4.0, throughput_Bps=v / 0.005, quality=0.95)]}  # T_p = 0.205
    ctl = Controller(prof, ControllerConfig(epsilon=1.0, min_gain=0.05, seed=3))
    b = v / 0.214  # T_0 = 0.214: gains 1.9 % and 4.2 %, both below 5 %
    ctx = Context("code", t_slo_s=1e6, q_min=0.9, kv_bytes=v, t_model_s=tp, bandwidth_Bps=b)
    for _ in range(50):
        d = ctl.decide(ctx)
        assert d.profile.name == BASELINE and d.candidates == (BASELINE,)
        ctl.observe(d, d.predicted_s)
    # Raise the gain above the margin: "b" (T_p 0.205 vs T_0 0.25, 18 %) becomes the greedy choice.
    d = Controller(prof, ControllerConfig(epsilon=0.0, min_gain=0.05)).decide(
        Context("code", t_slo_s=1e6, q_min=0.9, kv_bytes=v, t_model_s=tp, bandwidth_Bps=v / 0.25))
    assert d.profile.name == "b"


def test_long_lived_controller_abandons_a_profile_whose_codec_cost_was_underpredicted():
    # The profile's charged codec cost is 0.01 s; in place it costs 0.08 s (shared cores). It passes
    # the filter (T_p 0.21 vs T_0 0.25), is chosen once, and its residual (+0.07 s plus the shared
    # 0.13 s tail) makes it lose to the baseline, whose own residual is only the tail: from then on a
    # long-lived controller keeps the request uncompressed (the residual correction of Eqs. 7-8).
    v, tp, tail = 10**9, 0.2, 0.13
    prof = {"code": [Profile("p", cr=8.0, throughput_Bps=v / 0.01, quality=0.95)]}
    ctl = Controller(prof, ControllerConfig(epsilon=0.0))
    ctx = Context("code", t_slo_s=1e6, q_min=0.9, kv_bytes=v, t_model_s=tp, bandwidth_Bps=v / 0.25)

    def truth(name):
        return max(tp + 0.08, 0.25 / 8) + tail if name == "p" else max(tp, 0.25) + tail

    chosen = []
    for _ in range(20):
        d = ctl.decide(ctx)
        chosen.append(d.profile.name)
        ctl.observe(d, truth(d.profile.name))
    assert chosen[0] == "p" and set(chosen[1:]) == {BASELINE}
    assert ctl.residual(d.env_key, "p") == pytest.approx(0.07 + tail)
    assert ctl.residual(d.env_key, BASELINE) == pytest.approx(tail)
    # A fresh controller per request (what the JCT sweep did before) repeats the mistake every time.
    assert all(Controller(prof, ControllerConfig(epsilon=0.0)).decide(ctx).profile.name == "p" for _ in range(3))
