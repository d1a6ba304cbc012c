"""Streaming-head pruning (DuoAttention-like): plans, honest byte accounting, per-head masked decode,
observation-window head scores, and the objective on a tiny random model."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.compression import Pipeline, PipelineSpec
from jkv.compression.heads import observation_queries, observation_scores
from jkv.compression.streaming import (MaskedDecoder, StreamingConfig, StreamingPlan, decode_request,
                                       encode_request, request_bytes)
from jkv.compression.workloads import ModelObjective, WorkloadSample
from models import tiny_model

from .conftest import random_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0)


@pytest.fixture(scope="module")
def prefilled(model):
    [prompt] = random_prompts(model, [150], seed=4)
    _, kv = model.prefill(jnp.asarray([prompt], jnp.int32), jnp.asarray([150], jnp.int32))
    return prompt, [(np.asarray(k[0], np.float16), np.asarray(v[0], np.float16)) for k, v in kv]


def test_plan_from_scores_streams_the_lowest_scored_heads_and_keeps_sink_plus_recent():
    scores = np.array([[0.9, 0.1], [0.5, 0.3], [0.05, 0.7]])
    plan = StreamingPlan.from_scores(scores, 0.5, sink=2, recent=3)
    assert plan.retrieval == ((True, False), (True, False), (False, True))
    keep = plan.keep_mask(10)
    assert keep.shape == (3, 2, 10) and keep[0, 0].all()
    np.testing.assert_array_equal(np.flatnonzero(keep[0, 1]), [0, 1, 7, 8, 9])
    assert StreamingPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert StreamingConfig(0.25, 16, 64).id == "duo25s16w64"
    with pytest.raises(ValueError, match="fraction"):
        StreamingConfig(1.5)
    with pytest.raises(ValueError, match="rectangular"):
        StreamingPlan(((True,), (True, False)))


def test_round_trip_sends_only_kept_tokens_and_counts_every_byte(prefilled):
    _, kv16 = prefilled
    retrieval = ((True, False), (False, False), (True, True))
    plan = StreamingPlan(retrieval, sink=4, recent=16)
    pipe = Pipeline(PipelineSpec.parse("identity+none+none"))
    blobs = encode_request(pipe, plan, kv16, chunk_tokens=64)
    kv, keep = decode_request(blobs)
    np.testing.assert_array_equal(keep, plan.keep_mask(150))
    for (k, v), (k0, v0), m in zip(kv, kv16, keep):
        for x, x0 in ((k, k0), (v, v0)):
            np.testing.assert_array_equal(x[m], x0.astype(np.float32)[m])  # lossless where kept
            assert not x[~m].any()  # nothing of a dropped token arrives
    raw = sum(k.nbytes + v.nbytes for k, v in kv16)
    kept_fraction = keep.mean()
    assert request_bytes(blobs) == sum(map(len, blobs)) > kept_fraction * raw  # headers + manifest counted
    assert request_bytes(blobs) < 1.1 * kept_fraction * raw + 4000
    # composes with quantization; per-head tables do not apply to head subsets
    q = encode_request(Pipeline(PipelineSpec.parse("hadamard+kivi4g32+zstdh3")), plan, kv16, 64)
    assert request_bytes(q) < 0.5 * request_bytes(blobs)  # D=16: the ~300-byte headers weigh more
    with pytest.raises(ValueError, match="per-head-uniform"):
        encode_request(Pipeline(PipelineSpec.parse("identity+mixed-84.84.84-g32+none")), plan, kv16, 64)
    with pytest.raises(ValueError, match="bad manifest"):
        decode_request([b"{}"] + blobs[1:])
    with pytest.raises(ValueError, match="more containers"):
        decode_request(blobs + blobs[1:2])


def test_masked_decoder_matches_dense_decode_and_ignores_dropped_tokens(model, prefilled):
    _, kv16 = prefilled
    n, steps = 150, [5, 17, 40]
    kv = [(k.astype(np.float32), v.astype(np.float32)) for k, v in kv16]
    cache = model.cache_from_prefill([(jnp.asarray(k)[None], jnp.asarray(v)[None]) for k, v in kv], n + 8)
    dense = []
    for i, tok in enumerate(steps):
        logits, cache = model.decode_step(cache, jnp.asarray([tok]), jnp.asarray([n + i]))
        dense.append(np.asarray(logits[0]))
    full = MaskedDecoder(model, kv, np.ones((3, 2, n), bool), len(steps))
    np.testing.assert_allclose(np.stack([full.step(t) for t in steps]), np.stack(dense), atol=2e-4, rtol=1e-4)

    keep = StreamingPlan(((True, False), (False, True), (False, False)), sink=4, recent=16).keep_mask(n)
    pruned = np.stack([d.step(t) for d in [MaskedDecoder(model, kv, keep, 3)] for t in steps])
    rng = np.random.default_rng(0)
    noisy = [(np.where(m[:, :, None], k, rng.standard_normal(k.shape) * 5), np.where(m[:, :, None], v, 3.0))
             for (k, v), m in zip(kv, keep)]
    dec = MaskedDecoder(model, noisy, keep, 3)
    np.testing.assert_allclose(np.stack([dec.step(t) for t in steps]), pruned, atol=1e-5)
    assert np.abs(pruned - np.stack(dense)).max() > 1e-3  # dropping tokens really changes attention


def test_observation_queries_are_the_models_own_queries(model, prefilled):
    prompt, kv16 = prefilled
    q = observation_queries(model, prompt, kv16, window=4)
    assert q.shape == (3, model.cfg.num_heads, 4, model.cfg.head_dim)
    # layer 0's query of the last token depends only on its embedding and position
    x = model.embed(jnp.asarray([prompt[-1]]))
    q0, _, _ = model.qkv(0, x, jnp.asarray([149]))
    np.testing.assert_allclose(q[0, :, 3], np.asarray(q0[0]), atol=1e-5)
    scores = observation_scores(model, prompt, kv16, window=4, sink=4, recent=16)
    assert scores.shape == (3, 2) and np.all((scores >= 0) & (scores <= 1 + 1e-6))
    with pytest.raises(ValueError, match="prompt has"):
        observation_queries(model, prompt[:-1], kv16)


def test_objective_with_streaming_pruning(model, prefilled):
    prompt, _ = prefilled
    rng = np.random.default_rng(8)
    sample = WorkloadSample("continuation", prompt, rng.integers(3, model.cfg.vocab_size, 6).astype(np.int32))
    obj = ModelObjective(model, [sample], chunk_tokens=64)
    spec = PipelineSpec.parse("identity+none+none")
    none = obj.measure(spec, StreamingConfig(0.0, 4, 16))
    assert none.accuracy == 1.0 and none.kl < 1e-6 and none.spec_id == "duo0s4w16:identity+none+none"
    half = obj.measure(spec, StreamingConfig(0.5, 4, 16))
    assert half.cr > 1.5 * none.cr and half.kl > 1e-4
    assert len(obj.task_scores(spec, StreamingConfig(0.5, 4, 16))) == 1
