"""The controller charges the compressed transfer path's real codec cost, not the profile file's
encode + decode round trip (the prefill side also decodes every chunk; the receiver decodes again)."""
import numpy as np
import pytest

from jkv.compression.controller import BASELINE, Context, Controller
from jkv.compression.kv_transfer import KVCodec, path_seconds, path_throughput_Bps
from jkv.compression.policy import CompressionConfig, CompressionPolicy, path_profiles, wire_profiles
from jkv.compression.profiling import ProfileFile, ProfilePoint

SPEC = "hadamard+kivi4g32+zstd3"


def profile_file(s_p: float, cr: float = 3.6) -> ProfileFile:
    return ProfileFile("continuation", 0.9, 1 << 20, (ProfilePoint(SPEC, 0.95, cr, (1 << 20) / s_p, s_p),))


def decide(profiles, bandwidth_Bps: float) -> str:
    ctl = Controller({"continuation": profiles})  # T_model unknown (0): Eq. 1's additive accounting
    return ctl.decide(Context("continuation", 1e9, 0.9, 12 << 20, 0.0, bandwidth_Bps)).profile.name


def test_path_cost_flips_a_round_trip_compress_decision_at_high_bandwidth():
    # Round trip (35 MB/s per fp16 byte = 70 MB/s per float32 byte, cr_wire 7.2): B*_p = 60 MB/s, so at
    # 32 MB/s the old accounting compresses. The real path (encode + 2 decodes + framing) at 25 MB/s
    # gives B*_p = 21.5 MB/s: compressing 12 MB would cost 0.48 s of codec against 0.38 s of link.
    f = profile_file(35e6)
    assert decide(wire_profiles(f), 32e6) == SPEC
    assert decide(path_profiles(f, {SPEC: 25e6}), 32e6) == BASELINE
    # ... and at a slow link the path cost still says compress (it pays off where it should).
    assert decide(path_profiles(f, {SPEC: 25e6}), 5e6) == SPEC
    # Unmeasured profiles keep their round-trip s_p; nonsense measurements are refused.
    assert path_profiles(f, {})[0].throughput_Bps == wire_profiles(f)[0].throughput_Bps
    with pytest.raises(ValueError, match="path throughputs"):
        path_profiles(f, {SPEC: 0.0})


def test_path_seconds_runs_the_real_transfer_path():
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 2, 2, 300, 16)).astype(np.float32)
    before = kv.copy()
    pipe = KVCodec().pipeline(SPEC)
    assert path_seconds(pipe, kv, min_chunk_tokens=64, blocks_per_layer=40) > 0
    np.testing.assert_array_equal(kv, before)  # the caller's probe is not overwritten
    assert path_throughput_Bps(pipe, kv, min_chunk_tokens=64, repeats=1) > 0
    with pytest.raises(ValueError, match="f32\\[2, L, H_kv, N, D\\]"):
        path_seconds(pipe, kv[0])


def test_calibrated_policy_stops_compressing_where_only_the_round_trip_said_it_pays():
    # A profile file claiming a free codec (s_p = 1e15 B/s) makes the round-trip accounting compress
    # even on a 10 GB/s link; the measured path (JAX on CPU, ~300 chunk containers) is far slower.
    f = profile_file(1e15)
    policy = CompressionPolicy(CompressionConfig("auto", profiles=("x.json",), q_min=0.9),
                               bandwidth_bps=80e9, profiles=[f])
    assert policy.choose(12 << 20).spec_id == SPEC
    rng = np.random.default_rng(1)
    measured = policy.calibrate_path(rng.standard_normal((2, 2, 2, 256, 16)).astype(np.float32),
                                     min_chunk_tokens=64, repeats=1)
    assert set(measured) == {SPEC} and measured[SPEC] < 1e10
    assert policy.choose(12 << 20).spec_id == BASELINE
    assert policy.controller.decide(Context("continuation", 1e9, 0.9, 12 << 20, 0.0, 1e5)).profile.name == SPEC
    with pytest.raises(ValueError, match="needs compression='auto'"):
        CompressionPolicy(CompressionConfig("off")).calibrate_path(np.zeros((2, 1, 1, 8, 4), np.float32))
