"""Bayesian profiling (Alg. 1) vs exhaustive search, Pareto set, profile files, fidelity objective."""
import json
import zlib

import numpy as np
import pytest

from jkv.compression import Calibration, Pipeline, PipelineSpec, enumerate_space
from jkv.compression.profiling import (Evaluation, FidelityObjective, SearchConfig, bayesian_search, build_profile,
                                       encode_space, exhaustive_search, load_profile, nominal_cr, pareto_front,
                                       save_profile)
from jkv.compression.spec import CodecSpec, QuantizerSpec, TransformSpec

from .conftest import kv_like
from .test_codecs_container import _split

SPACE = enumerate_space(
    [TransformSpec(), TransformSpec("hadamard"), TransformSpec("delta", 16), TransformSpec("affine")],
    [QuantizerSpec(m, b, g) for m in ("tok", "ch", "kivi") for b in (2, 3, 4, 8) for g in (32, 64)]
    + [QuantizerSpec("mixhq", 8, 32, low_bits=2, retrieval_pct=r) for r in (25, 50)],
    [CodecSpec(), CodecSpec("zstd", 3), CodecSpec("lz4")])
THRESHOLD = 0.97


def synthetic(spec: PipelineSpec):
    """Accuracy falls with fewer bits (method/transform/group factors); CR = layout CR x codec gain."""
    q = spec.quantizer
    err = 0.6 * 2.0 ** -q.mean_bits() * {"tok": 1.6, "ch": 1.3, "kivi": 1.0, "mixhq": 0.5}[q.method]
    err *= {"identity": 1.0, "hadamard": 0.7, "delta": 1.2, "affine": 0.9}[spec.transform.name]
    err *= 1.0 if q.group == 32 else 1.25
    err += (zlib.crc32(spec.id.encode()) % 1000) / 1000 * 0.002  # deterministic "measurement noise"
    cr = nominal_cr(spec) * {"none": 1.0, "lz4": 1.02, "zstd": 1.08}[spec.codec.name]
    if spec.transform.name == "delta" and spec.codec.name == "zstd":
        cr *= 1.1
    latency = 0.01 + {"none": 0, "lz4": 0.005, "zstd": 0.02}[spec.codec.name]
    return 1 - err, cr, latency


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, spec):
        self.calls.append(spec.id)
        return self.fn(spec)


@pytest.fixture(scope="module")
def exhaustive():
    return exhaustive_search(SPACE, synthetic, THRESHOLD)


@pytest.mark.parametrize("seed, use_prior", [(0, True), (4, True), (1, False)])
def test_bo_finds_the_feasible_optimum_with_far_fewer_evaluations(exhaustive, seed, use_prior):
    objective = Counting(synthetic)
    result = bayesian_search(SPACE, objective, SearchConfig(THRESHOLD, seed=seed),
                             cr_prior=nominal_cr if use_prior else None)
    optimum = exhaustive.best
    assert len(exhaustive.evaluations) == len(SPACE) == 312
    assert result.best is not None and result.best.accuracy >= THRESHOLD
    assert result.best.cr >= 0.97 * optimum.cr  # the stated margin: within 3 % of the optimal CR
    assert len(objective.calls) == len(result.evaluations) <= 0.15 * len(SPACE)
    assert len(set(objective.calls)) == len(objective.calls)  # never evaluates a spec twice
    assert result.stopped.startswith("no better feasible CR")


def _family(spec_id):
    spec = PipelineSpec.parse(spec_id)
    return spec.transform.name, spec.quantizer.method


def test_pruning_is_bidirectional_and_respects_the_margin():
    objective = Counting(synthetic)
    cfg = SearchConfig(THRESHOLD, seed=3, n_init=len(SPACE), max_iters=len(SPACE), patience=len(SPACE),
                       prune_margin=0.25)
    result = bayesian_search(SPACE, objective, cfg, cr_prior=nominal_cr)
    assert result.stopped == "space exhausted" and result.pruned > 0
    assert len(result.evaluations) + result.pruned == len(SPACE)
    evals = result.evaluations
    for i, e in enumerate(evals):  # nothing evaluated later lies in a region an earlier result pruned
        for later in evals[i + 1:]:
            if e.accuracy >= THRESHOLD:
                assert later.cr >= e.cr - 0.25 - 0.1 * later.cr  # prior is codec-rescaled, not exact
            elif e.accuracy < THRESHOLD - cfg.fail_margin and _family(later.spec_id) == _family(e.spec_id):
                assert later.cr <= e.cr + 0.25 + 0.1 * later.cr


def test_family_scoped_pruning_keeps_a_better_family_that_global_pruning_loses():
    """identity+kivi fails clearly at CR ~3.4 while hadamard+kivi passes at higher CR (as on real KV)."""
    space = enumerate_space([TransformSpec(), TransformSpec("hadamard")],
                            [QuantizerSpec("kivi", b, g) for b in (2, 4, 8) for g in (32, 128)], [CodecSpec()])

    def objective(spec):
        q = spec.quantizer
        acc = {8: 0.999, 4: 0.80, 2: 0.5}[q.bits] if spec.transform.name == "identity" else \
            {8: 0.999, 4: 0.95, 2: 0.6}[q.bits]
        return acc, nominal_cr(spec), 0.01

    first = [s.id for s in space].index("identity+kivi4g32+none")
    # A seed whose single initial point is identity+kivi4g32 (the search draws it with this rng).
    seed = next(x for x in range(1000) if np.random.default_rng(x).choice(len(space), size=1)[0] == first)
    found = {}
    for scope in ("global", "family"):
        cfg = SearchConfig(0.9, seed=seed, n_init=1, max_iters=len(space), patience=len(space), prune_scope=scope)
        result = bayesian_search(space, objective, cfg, cr_prior=nominal_cr)
        assert result.evaluations[0].spec_id == "identity+kivi4g32+none"
        found[scope] = result.best.spec_id
    assert found["family"] == "hadamard+kivi4g128+none"  # the true optimum
    assert found["global"] == "hadamard+kivi4g32+none"  # its higher-CR sibling was pruned by the identity failure


def test_without_pruning_or_patience_the_search_is_exhaustive(exhaustive):
    cfg = SearchConfig(THRESHOLD, seed=0, n_init=4, max_iters=len(SPACE), patience=len(SPACE),
                       prune_margin=1e9, fail_margin=1e9)
    result = bayesian_search(SPACE[:40], synthetic, cfg, cr_prior=nominal_cr)
    assert len(result.evaluations) == 40 and result.stopped == "space exhausted"


def test_infeasible_space_runs_to_max_iterations():
    result = bayesian_search(SPACE[:30], synthetic, SearchConfig(1.01, max_iters=10, seed=0), cr_prior=nominal_cr)
    assert result.best is None and result.stopped == "max iterations" and len(result.evaluations) == 10


def test_bad_objective_values_are_rejected():
    with pytest.raises(ValueError, match="need finite values"):
        bayesian_search(SPACE[:5], lambda s: (float("nan"), 2.0, 0.1), SearchConfig(0.9))
    with pytest.raises(ValueError, match="duplicate"):
        bayesian_search(SPACE[:2] * 2, synthetic, SearchConfig(0.9))
    with pytest.raises(ValueError):
        SearchConfig(0.9, lambda_decay=0)


def test_encode_space_is_one_hot_plus_min_max():
    x = encode_space(SPACE)
    # sorted keys: bits | codec x3 | codec_level | delta_group | ec_step | group | low_bits | mean_bits |
    # quantizer x4 | retrieval_pct | transform x4
    assert x.shape == (len(SPACE), 19) and x.min() == 0 and x.max() == 1
    bits = {s.quantizer.bits: v for s, v in zip(SPACE, x[:, 0])}
    assert bits == {2: 0.0, 3: pytest.approx(1 / 6), 4: pytest.approx(1 / 3), 8: 1.0}
    np.testing.assert_array_equal(x[:, 1:4].sum(axis=1), 1)  # one codec category each
    np.testing.assert_array_equal(x[:, 6], 0)  # no ec quantizer in SPACE: a constant column
    np.testing.assert_array_equal(x[:, 10:14].sum(axis=1), 1)  # one quantizer category each
    np.testing.assert_array_equal(x[:, 15:19].sum(axis=1), 1)  # one transform category each
    assert np.unique(x, axis=0).shape[0] == len(SPACE)  # distinct specs stay distinct


@pytest.mark.parametrize("sid", ["identity+kivi4g32+none", "delta8+tok4g32+none", "affine+kivi2g32+none",
                                 "hadamard+mixed-842-g32+none"])  # jit-compiled shapes shared with other tests
def test_nominal_cr_is_the_exact_payload_ratio(sid):
    spec = PipelineSpec.parse(sid)
    shape = (3, 40, 64)
    x = kv_like(2, shape=shape)
    pipe = Pipeline(spec, Calibration(kv={(0, "k"): x, (0, "v"): x}))
    payload = 0
    for layer in range(len(spec.quantizer.table) or 1):
        for kind in "kv":
            header, body = _split(pipe.encode_block(x, layer=layer, kind=kind))
            payload += len(body) / (len(spec.quantizer.table) or 1)
    assert nominal_cr(spec, shape) == pytest.approx(2 * x.nbytes / payload, rel=1e-9)


def test_pareto_front_in_three_dimensions():
    evals = [Evaluation("a", 0.99, 2.0, 0.010), Evaluation("b", 0.98, 4.0, 0.020), Evaluation("c", 0.98, 3.0, 0.030),
             Evaluation("d", 0.97, 4.0, 0.005), Evaluation("e", 0.99, 2.0, 0.010), Evaluation("f", 0.96, 1.5, 0.2)]
    front = pareto_front(evals)
    assert [e.spec_id for e in front] == ["a", "e", "d", "b"]  # c dominated by b, f by a; a/e tie kept


def test_profile_file_round_trip_and_validation(tmp_path, exhaustive):
    profile = build_profile(exhaustive, "code", probe_bytes=1 << 20)
    assert profile.points and all(p.accuracy >= THRESHOLD for p in profile.points)
    assert {p.spec_id for p in profile.points} == {e.spec_id for e in pareto_front(exhaustive.feasible)}
    assert profile.points[0].throughput_Bps == pytest.approx((1 << 20) / profile.points[0].latency_s)
    path = tmp_path / "code.json"
    save_profile(path, profile)
    loaded = load_profile(path)
    assert loaded.points == profile.points and loaded.workload == "code" and loaded.search["evaluations"] == 312
    obj = json.loads(path.read_text())
    obj["version"] = 99
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="version 99 unsupported"):
        load_profile(path)
    obj["version"] = 1
    obj["points"][0]["spec_id"] = "nope"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="malformed profile"):
        load_profile(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not a JSON profile"):
        load_profile(path)


def test_fidelity_objective_measures_reconstruction_and_attention_error():
    kv = [(kv_like(10 + layer), kv_like(20 + layer)) for layer in range(2)]  # shapes shared with other tests
    calib = Calibration(kv={(l, kind): kv[l][i] for l in range(2) for i, kind in enumerate("kv")})
    objective = FidelityObjective(kv, calibration=calib)
    exact = objective.measure(PipelineSpec())
    assert exact.rel_error_k == exact.rel_error_v == exact.attn_rel_error == 0 and exact.accuracy == 1.0
    assert 0.95 < exact.cr < 1.0
    results = {b: objective.measure(PipelineSpec.parse(f"identity+kivi{b}g32+zstd3")) for b in (2, 4, 8)}
    assert results[2].accuracy < results[4].accuracy < results[8].accuracy <= 1.0
    assert results[2].rel_error_k > results[4].rel_error_k > results[8].rel_error_k > 0
    assert results[2].cr > results[4].cr > results[8].cr > 1.5
    acc, cr, latency = objective(PipelineSpec.parse("affine+kivi2g32+lz4"))
    assert 0.5 < acc < 1 and cr > 2.5 and latency > 0
    assert objective.probe_bytes == sum(k.nbytes + v.nbytes for k, v in kv)


def test_fidelity_objective_validates_inputs():
    with pytest.raises(ValueError, match="at least one layer"):
        FidelityObjective([])
    with pytest.raises(ValueError, match="must both be"):
        FidelityObjective([(np.zeros((3, 4, 8)), np.zeros((3, 5, 8)))])
