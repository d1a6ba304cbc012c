"""Token-importance precision tiers (SnapKV observation window): plans, importance, byte-exact
round trips with every byte counted, the objective on a tiny model and the profile search's view."""
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.compression.profiling import SearchConfig, bayesian_search, encode_space, nominal_cr
from jkv.compression.spec import PipelineSpec
from jkv.compression.tokens import (TierConfig, decode_request, encode_request, importance_from_queries, plan_tiers,
                                    request_bytes, tier_counts, token_importance)
from jkv.compression.workloads import ModelObjective, WorkloadSample
from models import tiny_model
from tests.compression_tests.conftest import kv_like

LOSSLESS = "identity+none+none"


def _kv(layers=2, n=200, seed=0):
    return [(kv_like(seed + 2 * i, (3, n, 64)), kv_like(seed + 2 * i + 1, (3, n, 64))) for i in range(layers)]


def test_plan_keeps_sinks_recent_and_each_heads_most_important_tokens():
    L, H, n = 2, 3, 200
    cfg = TierConfig(LOSSLESS, LOSSLESS, hi_frac=0.1, lo_frac=0.2, sink=4, recent=16)
    imp = np.zeros((L, H, n), np.float32)
    planted = {(0, 1): [50, 51, 120], (1, 2): [30, 99, 150]}
    for (layer, head), pos in planted.items():
        imp[layer, head, pos] = 1.0
    tiers = plan_tiers(imp, cfg)
    n_hi, n_lo = tier_counts(cfg, n)
    assert (n_hi, n_lo) == (20 + 18, 36)  # middle = 180 tokens: 10 % hi, 20 % lo
    assert np.all((tiers == 2).sum(-1) == n_hi) and np.all((tiers == 1).sum(-1) == n_lo)
    assert np.all(tiers[:, :, :4] == 2) and np.all(tiers[:, :, -16:] == 2)
    for (layer, head), pos in planted.items():
        assert np.all(tiers[layer, head, pos] == 2)
    # ties (all-zero importance elsewhere) go to the earlier tokens: deterministic
    assert tiers[0, 0, 4:22].tolist() == [2] * 18 and tiers[0, 0, 22] == 1
    with pytest.raises(ValueError, match="finite"):
        plan_tiers(np.full((1, 1, 10), np.nan), cfg)


def test_lossless_round_trip_is_exact_on_kept_tokens_and_counts_every_byte():
    kv = _kv()
    cfg = TierConfig(LOSSLESS, LOSSLESS, hi_frac=0.15, lo_frac=0.25, sink=4, recent=16)
    rng = np.random.default_rng(1)
    tiers = plan_tiers(rng.random((2, 3, 200)).astype(np.float32), cfg)
    blobs = encode_request(cfg, tiers, kv)
    out, keep = decode_request(blobs)
    np.testing.assert_array_equal(keep, tiers > 0)
    for (k, v), (k2, v2), kp in zip(kv, out, keep):
        np.testing.assert_array_equal(k2[kp], k.astype(np.float32)[kp])
        np.testing.assert_array_equal(v2[kp], v.astype(np.float32)[kp])
        assert np.all(k2[~kp] == 0) and np.all(v2[~kp] == 0)
    kept_raw = int(keep.sum()) * 64 * 2 * 2
    total = request_bytes(blobs)
    assert total == sum(len(b) for b in blobs) > kept_raw  # the manifest, tier table and headers on top
    assert total < kept_raw + 4 * 2 * 2 * 500 + 2000  # ... and little else (4 containers per layer)


def test_quantized_tiers_hi_is_finer_than_lo_and_cr_follows_the_budget():
    kv = _kv(n=256)
    imp = np.random.default_rng(2).random((2, 3, 256)).astype(np.float32)
    cfg = TierConfig("hadamard+kivi8g128+none", "hadamard+kivi2g128+none", hi_frac=0.3, lo_frac=0.3)
    tiers = plan_tiers(imp, cfg)
    out, keep = decode_request(encode_request(cfg, tiers, kv))
    err = {t: np.mean([np.abs(k2 - k.astype(np.float32))[tiers[i] == t].mean() for i, ((k, _), (k2, _))
                       in enumerate(zip(kv, out))]) for t in (1, 2)}
    assert err[2] < err[1] / 10
    raw = sum(k.nbytes + v.nbytes for k, v in kv)
    crs = []
    for keep_frac in (0.6, 0.3):
        c = TierConfig("hadamard+kivi4g128+zstdh3", None, hi_frac=keep_frac, lo_frac=0.0)
        crs.append(raw / request_bytes(encode_request(c, plan_tiers(imp, c), kv)))
    assert crs[1] > 1.3 * crs[0]  # 186 vs 133 kept tokens per head (80 sink + recent each)
    with pytest.raises(ValueError, match="lo pipeline"):
        encode_request(TierConfig(LOSSLESS, None, 0.5, 0.0), tiers, kv)


def test_decode_rejects_damaged_requests():
    kv = _kv(layers=1, n=100)
    cfg = TierConfig(LOSSLESS, None, hi_frac=0.5, lo_frac=0.0, sink=4, recent=8)
    blobs = encode_request(cfg, plan_tiers(np.ones((1, 3, 100), np.float32), cfg), kv)
    with pytest.raises(ValueError, match="manifest"):
        decode_request([b"{}"] + blobs[1:])
    with pytest.raises(ValueError, match="tier table"):
        decode_request([blobs[0], blobs[1][:-3]] + blobs[2:])
    with pytest.raises(ValueError, match="missing"):
        decode_request(blobs[:-1])
    with pytest.raises(ValueError, match="more containers"):
        decode_request(blobs + blobs[-1:])


def test_config_validation_and_ids():
    with pytest.raises(ValueError, match="hi_frac"):
        TierConfig(hi_frac=0.7, lo_frac=0.5)
    with pytest.raises(ValueError, match="pipeline id"):
        TierConfig(hi="kivi4")
    with pytest.raises(ValueError, match="odd pool"):
        TierConfig(pool=4)
    with pytest.raises(ValueError, match="mixed-"):
        TierConfig(hi="hadamard+mixhq4s2r25g32+zstd3")
    a, b = TierConfig(hi_frac=0.2, lo_frac=0.3), TierConfig(hi_frac=0.2, lo_frac=0.4)
    assert a.id != b.id and a.id.startswith("tiers:hi20:") and a.family == "tiers/kivi"


def test_importance_is_observation_window_attention_max_pooled():
    rng = np.random.default_rng(3)
    L, H, H_kv, W, n, D = 1, 4, 2, 3, 40, 16
    k = rng.standard_normal((H_kv, n, D)).astype(np.float32) * 0.1
    q = rng.standard_normal((L, H, W, D)).astype(np.float32) * 0.1
    k[1, 10] = 4.0 * q[0, 2:4].mean(axis=(0, 1)) / np.linalg.norm(q[0, 2:4].mean(axis=(0, 1))) * 4
    imp = importance_from_queries(q, [k], pool=1)
    assert imp.shape == (L, H_kv, n) and np.argmax(imp[0, 1]) == 10
    np.testing.assert_allclose(imp.sum(-1), H // H_kv * W, rtol=1e-5)  # every query's mass is 1
    pooled = importance_from_queries(q, [k], pool=5)
    assert np.all(pooled[0, 1, 8:13] == imp[0, 1, 10])  # the neighbours of a selected token come along


def test_objective_and_profile_search_take_token_tiers():
    model = tiny_model("llama", 0)
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, model.cfg.vocab_size, 150).tolist()
    _, kv = model.prefill(jnp.asarray([prompt], jnp.int32), jnp.asarray([150], jnp.int32))
    kv16 = [(np.asarray(k[0], np.float16), np.asarray(v[0], np.float16)) for k, v in kv]
    imp = token_importance(model, prompt, kv16, window=4, pool=3)
    assert imp.shape == (3, 2, 150) and np.all(np.isfinite(imp))
    sample = WorkloadSample("continuation", prompt, rng.integers(3, model.cfg.vocab_size, 6).astype(np.int32))
    obj = ModelObjective(model, [sample], chunk_tokens=64)
    full = obj.measure(TierConfig(LOSSLESS, None, hi_frac=1.0, lo_frac=0.0, sink=4, recent=16, window=4))
    assert full.accuracy == 1.0 and full.kl < 1e-6
    pruned = TierConfig(LOSSLESS, None, hi_frac=0.2, lo_frac=0.0, sink=4, recent=16, window=4)
    r = obj.measure(pruned)
    assert r.cr > 2.5 * full.cr and r.kl > 1e-5 and r.spec_id == pruned.id
    assert len(obj.task_scores(pruned)) == 1
    # The profile search over a mixed space (pipelines + tiers): features, priors, evaluation.
    space = [PipelineSpec.parse("identity+kivi4g32+none"), PipelineSpec.parse("hadamard+kivi2g128+zstdh3"),
             pruned, TierConfig("hadamard+kivi4g128+zstdh3", None, 0.3, 0.0, 4, 16, 4)]
    x = encode_space(space)
    assert x.shape[0] == 4 and np.all((x >= 0) & (x <= 1))
    prior = [nominal_cr(s, (2, 64, 16), n_tokens=150) for s in space]
    assert prior[2] > 2.5 and prior[3] > prior[0]
    result = bayesian_search(space, obj, SearchConfig(acc_threshold=0.0, max_iters=4, n_init=4),
                             cr_prior=lambda s: nominal_cr(s, (2, 64, 16), n_tokens=150))
    assert {e.spec_id for e in result.evaluations} <= {s.id for s in space}
    assert result.best.spec_id == space[3].id  # the highest CR (prior 9.4x: 39 % of tokens at 4 bits)


def test_serving_policy_skips_token_tier_profile_points():
    from jkv.compression.policy import CompressionConfig, CompressionPolicy, wire_profiles
    from jkv.compression.profiling import ProfileFile, ProfilePoint

    tier = TierConfig()
    prof = ProfileFile("code", 0.9, 10**6, (ProfilePoint("hadamard+kivi4g128+zstdh3", 0.95, 3.9, 0.1, 1e7),
                                            ProfilePoint(tier.id, 0.93, 8.5, 0.2, 5e6)))
    assert [p.name for p in wire_profiles(prof)] == ["hadamard+kivi4g128+zstdh3"]
    policy = CompressionPolicy(CompressionConfig("auto", profiles=("code.json",)), bandwidth_bps=1e8, profiles=[prof])
    probe = np.stack([np.stack([k, v]).astype(np.float32) for k, v in _kv(layers=2, n=128)], 1)
    calibrated = policy.calibrate_path(probe, min_chunk_tokens=64, repeats=1)
    assert set(calibrated) == {"hadamard+kivi4g128+zstdh3"}
    assert policy.choose(10**8, 0.0).spec_id in ("hadamard+kivi4g128+zstdh3", "identity+none+none")


def test_layer_sensitivity_and_the_tier_space_give_sensitive_layers_more_bits():
    from jkv.compression.cli import strategy_space, tier_space
    from jkv.compression.workloads import layer_sensitivity

    model = tiny_model("llama", 0)
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, model.cfg.vocab_size, 96).tolist()
    obj = ModelObjective(model, [WorkloadSample("continuation", prompt, rng.integers(3, 50, 6).astype(np.int32))])
    sens = layer_sensitivity(obj, "identity+kivi2g32+none", group=2)  # 3 layers: groups {0, 1}, {2}
    assert sens.shape == (3,) and sens[0] == sens[1] and np.all(sens > 0)
    with pytest.raises(ValueError, match="probe"):
        layer_sensitivity(obj, "identity+none+none")
    space = tier_space(np.array([0.3, 0.01, 0.2]), n_heads=2)
    mixed = [t for t in space if "mixed-" in t.hi]
    assert mixed and all(t.hi_spec.quantizer.table[1][0] < t.hi_spec.quantizer.table[0][0] for t in mixed)
    full = strategy_space(np.random.default_rng(0).random((3, 2)), False, space)
    assert len({s.id for s in full}) == len(full) and sum(isinstance(s, TierConfig) for s in full) == len(space)
