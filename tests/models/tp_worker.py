"""Tensor-parallel runs for test_tensor_parallel.py, in a process of its own with 4 CPU devices.

XLA fixes the host device count when jax initialises, so the rest of the suite (one CPU device)
cannot host these runs: test_tensor_parallel.py starts this file with
XLA_FLAGS=--xla_force_host_platform_device_count=4 and reads the one JSON object it prints.

Usage: python tests/models/tp_worker.py [tiny] [serve] [smollm2]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

# (name, family, tiny_config overrides, degrees): awkward head counts on purpose.
TINY_CASES = [
    # 6 query / 2 KV heads: TP 2 splits heads and KV heads; TP 4 cannot split 6 heads, so only the MLP
    ("qwen3-6q2kv", "qwen3", dict(num_heads=6, num_kv_heads=2), (1, 2, 4)),
    # 8 query / 2 KV heads with q/k/v biases: TP 4 splits query heads, KV heads (2 < 4) replicated
    ("qwen2-8q2kv", "qwen2", dict(num_heads=8, num_kv_heads=2, num_layers=2), (1, 4)),
    # 8 query / 8 KV heads, every bias on, untied LM head: all split at TP 2
    ("llama-8q8kv-bias", "llama", dict(num_heads=8, num_kv_heads=8, qkv_bias=True, o_bias=True, mlp_bias=True,
                                       tie_word_embeddings=False, num_layers=2), (1, 2)),
]
PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 40))]
MAX_TOKENS = 10
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
SMOL_TOKENS = 8


def _spec(arr) -> str:
    s = arr.sharding
    return str(getattr(s, "spec", "single-device"))


def tiny_runs() -> dict:
    from jkv import LLM, SamplingParams
    from jkv.disagg.handshake import role_config
    from jkv.disagg.selectors import build_selector
    from models import tiny_model

    out = {}
    for name, family, overrides, degrees in TINY_CASES:
        runs = {}
        for tp in degrees:
            model = tiny_model(family, 0, tensor_parallel=tp, **overrides)
            llm = LLM(model, max_batch_size=2)
            res = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            # the dense (slots) cache: greedy decode steps after a prefill of the engine's shape
            # [2, 64] (its compiled program is reused)
            tokens = np.zeros((2, 64), np.int32)
            lengths = np.array([len(p) for p in PROMPTS], np.int32)
            for b, p in enumerate(PROMPTS):
                tokens[b, :len(p)] = p
            prefill_logits, kv = model.prefill(tokens, lengths)
            cache = model.cache_from_prefill(kv, 64)
            tok, pos, dense = np.argmax(prefill_logits, -1).astype(np.int32), lengths, []
            for _ in range(3):
                logits, cache = model.decode_step(cache, tok, pos)
                tok, pos = np.argmax(logits, -1).astype(np.int32), pos + 1
                dense.append(tok.tolist())
            layer0 = model.params["layers"][0]
            hs = role_config(model, "decode", build_selector(model, "streamingllm"), max_blocks=16)
            kv_cache = llm._engine.kv_cache
            z = np.zeros(2, np.int32)
            decode_hlo = model._paged_decode_compute.lower(model.params, kv_cache.kv, np.zeros((2, 4), np.int32),
                                                           z, z).compile().as_text()
            runs[tp] = dict(
                handshake_tp=hs.tensor_parallel, handshake_weights=hs.weights,
                decode_collectives={op: decode_hlo.count(f" {op}(") + decode_hlo.count(f" {op}-start(")
                                    for op in ("all-reduce", "all-gather")},
                tokens=[r.token_ids for r in res], dense_tokens=dense,
                prefill_logits=np.asarray(prefill_logits).tolist(),
                layout=model.sharding.layout.describe() if model.sharding else "tp1",
                paged_cache_spec=_spec(llm._engine.kv_cache.kv[0][0]), dense_cache_spec=_spec(cache[0][0]),
                q_spec=_spec(layer0["q_proj"]["kernel"]), o_spec=_spec(layer0["o_proj"]["kernel"]),
                k_spec=_spec(layer0["k_proj"]["kernel"]), up_spec=_spec(layer0["up_proj"]["kernel"]),
                down_spec=_spec(layer0["down_proj"]["kernel"]),
                cache_devices=len(llm._engine.kv_cache.kv[0][0].sharding.device_set))
        out[name] = runs
    return out


def serve_runs() -> dict:
    """`jkv serve --role all`'s engines (paged with chunked prefill, and slots) at TP 2 on the
    tiny Qwen3 of TINY_CASES (6 query / 2 KV heads: the KV cache splits), two requests at once;
    the test compares their tokens with the TP 1 `LLM` run of the same model."""
    import queue

    from jkv.sampling import SamplingParams
    from jkv.serving.batcher import BatcherConfig, EngineRequest, create_batcher
    from models import tiny_model

    out = {}
    for tp in (2,):
        model = tiny_model("qwen3", 0, tensor_parallel=tp, num_heads=6, num_kv_heads=2)
        for layout in ("paged", "slots"):
            engine = create_batcher(model, BatcherConfig(max_slots=2, max_model_len=64, kv_layout=layout,
                                                         prefill_chunk=16))
            engine.start()
            try:
                sinks = []
                for i, p in enumerate(PROMPTS):
                    q = queue.Queue()
                    engine.submit(EngineRequest(f"r{i}", list(p), SamplingParams(max_tokens=MAX_TOKENS,
                                                                                  ignore_eos=True), q.put))
                    sinks.append(q)
                tokens = []
                for q in sinks:
                    ids = []
                    while True:
                        ev = q.get(timeout=300)
                        ids.extend(ev.token_ids)
                        if ev.finish_reason is not None:
                            break
                    tokens.append(ids)
                cache = engine.kv.kv if layout == "paged" else engine._cache
                out[f"{layout}-{tp}"] = dict(tokens=tokens, cache_spec=_spec(cache[0][0]))
            finally:
                engine.stop()
    return out


def smollm2_runs() -> dict:
    """Greedy tokens of the real SmolLM2 weights at TP 1, 2, 4 by re-running prefill over the grown
    prompt (one compiled layer program per degree; the tiny runs cover the decode caches)."""
    from models import load_model

    base = load_model("smollm2-135m-instruct")
    ids = [base.tokenizer.encode(p) for p in SMOL_PROMPTS]
    T = max(len(i) for i in ids) + SMOL_TOKENS
    out = {}
    for tp in (1, 2, 4):
        model = base.with_tensor_parallel(tp)
        seqs = [list(i) for i in ids]
        for _ in range(SMOL_TOKENS):
            tokens = np.zeros((len(seqs), T), np.int32)
            for b, s in enumerate(seqs):
                tokens[b, :len(s)] = s
            logits, _ = model.prefill(tokens, np.array([len(s) for s in seqs], np.int32))
            for b, t in enumerate(np.argmax(np.asarray(logits), axis=-1)):
                seqs[b].append(int(t))
        emb = model.params["embed_tokens"]["embedding"]
        out[tp] = dict(tokens=[s[len(i):] for s, i in zip(seqs, ids)],
                       layout=model.sharding.layout.describe() if model.sharding else "tp1",
                       embed_spec=_spec(emb), up_spec=_spec(model.params["layers"][0]["up_proj"]["kernel"]),
                       q_spec=_spec(model.params["layers"][0]["q_proj"]["kernel"]))
    return out


def refusals() -> dict:
    from models import TensorParallelError, tiny_model

    out = {}
    for tp in (8, 3):  # 8 > the 4 devices; at 3 neither 6 heads/2 KV heads nor intermediate 160 split
        try:
            tiny_model("qwen3", 0, tensor_parallel=tp)
            out[tp] = None
        except TensorParallelError as e:
            out[tp] = str(e)
    return out


def main(argv: list[str]) -> int:
    import jax

    what = set(argv) or {"tiny", "serve", "smollm2"}
    result = {"devices": len(jax.devices()), "refusals": refusals(), "cpu_s": {}}
    for name, run in (("tiny", tiny_runs), ("serve", serve_runs), ("smollm2", smollm2_runs)):
        if name in what:
            t = time.process_time()
            result[name] = run()
            result["cpu_s"][name] = round(time.process_time() - t, 1)
    print("TP-RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
