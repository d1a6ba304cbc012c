"""The real-model compute stage: prefilling a suffix on top of a loaded prefix equals a full
prefill, and the model's stage functions in the pipeline equal the serialized reference
token for token (tiny random-init model)."""
import numpy as np
import pytest

from jkv.kvpool import HostKVPool
from jkv.kvpool.hashing import ChunkNamespace, chunk_keys
from jkv.scheduling import (LoadingPipeline, PipelineConfig, PipelineRequest, RequestInfo,
                            StageFunctions, make_policy, run_serialized)
from jkv.scheduling.pool_stages import pool_fetch, write_back
from jkv.scheduling.prefix_prefill import ModelStages, PrefixPrefill, chunk_shape, split_chunks
from models.model import tiny_model

C = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def prefill(model):
    return PrefixPrefill(model, prefix_bucket=16, suffix_buckets=(8, 16, 32, 64))


def full_kv(model, tokens):
    logits, kv = model.prefill(np.asarray(tokens, np.int32)[None], np.array([len(tokens)]))
    return np.asarray(logits)[0], np.stack([np.stack([np.asarray(k)[0], np.asarray(v)[0]])
                                            for k, v in kv])


@pytest.mark.parametrize("n, prefix_len", [(37, 0), (37, 24), (64, 56)])
def test_suffix_on_prefix_equals_full_prefill(model, prefill, n, prefix_len):
    tokens = np.random.default_rng(n).integers(3, 300, n).astype(np.int32)
    ref_logits, ref_kv = full_kv(model, tokens)
    prefix = ref_kv[:, :, :, :prefix_len] if prefix_len else None
    logits, kv = prefill(prefix, prefix_len, tokens[prefix_len:])
    np.testing.assert_allclose(logits, ref_logits, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(kv, ref_kv[:, :, :, prefix_len:], rtol=2e-4, atol=2e-4)
    assert np.argmax(logits) == np.argmax(ref_logits)


def test_suffix_errors_are_clear(prefill):
    with pytest.raises(ValueError, match="largest bucket"):
        prefill(None, 0, np.ones(65, np.int32))
    with pytest.raises(ValueError, match="at least one token"):
        prefill(None, 0, np.ones(0, np.int32))


def test_model_stages_in_the_pipeline_equal_serialized_and_full_prefill(model, prefill):
    cfg = model.cfg
    ns = ChunkNamespace("tiny", "float32", C)
    rng = np.random.default_rng(0)
    contexts = [rng.integers(3, 300, n).astype(np.int32) for n in (32, 48, 24)]
    pool = HostKVPool(1 << 26)
    for i, ctx in enumerate(contexts):       # cache each context (context 1: only 2 chunks)
        _, kv = full_kv(model, ctx)
        keys = chunk_keys(ctx, ns)[:2] if i == 1 else chunk_keys(ctx, ns)
        assert write_back(pool, keys, split_chunks(kv, C)[:len(keys)]) == len(keys)
    prompts, requests = {}, []
    for rid in range(6):
        ctx = contexts[rid % 3]
        prompt = np.concatenate([ctx, rng.integers(3, 300, 5 + rid).astype(np.int32)])
        prompts[rid] = prompt
        keys = chunk_keys(prompt, ns)
        hit = pool.longest_prefix_keys(keys)
        info = RequestInfo(rid, float(rid), hit * C, len(prompt) - hit * C)
        requests.append(PipelineRequest(info, hit, compute_slots=-(-(len(prompt) - hit * C) // C),
                                        payload={"keys": keys}))
    host = np.zeros((4,) + chunk_shape(cfg, C), np.float32)
    device = np.zeros((32,) + chunk_shape(cfg, C), np.float32)
    stages = ModelStages(prefill, host, device, C, lambda r: prompts[r.request_id])
    functions = StageFunctions(pool_fetch(pool, host, lambda r: r.payload["keys"]),
                               stages.upload, stages.compute)
    serial = run_serialized(requests, functions, 4, 32)
    with LoadingPipeline(functions, PipelineConfig(4, 32),
                         make_policy("sjf-pt")) as pipeline:
        results = [f.result(60) for f in pipeline.submit_many(requests)]
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}
    assert [r.loaded_chunks for r in results] == [4, 2, 3, 4, 2, 3]
    assert [r.value[0] for r in results] == [s.value[0] for s in serial]
    for r in results:
        ref_logits, _ = full_kv(model, prompts[r.request_id])
        assert r.value[0] == int(np.argmax(ref_logits))
        np.testing.assert_allclose(r.value[1], ref_logits, rtol=2e-4, atol=2e-4)
