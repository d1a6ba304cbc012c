"""Prefill and decode at different tensor-parallel degrees, for test_smartgen_tensor_parallel.py,
in a process of its own with 4 CPU devices (XLA fixes the host device count when jax initialises).

One in-process prefill worker (real TCP endpoints on loopback) per prefill degree, and a fresh
decode worker per (decode degree, transfer mode), on the tiny Qwen2 of the SmartGen tests (6 query
/ 2 KV heads: TP 2 splits the KV cache by KV head on both sides). The pairs run are
prefill TP -> decode TP 1 -> 1 (the reference), 2 -> 1 and 1 -> 2, each in every transfer mode,
then 2 -> 2 (`slice_runs`, with the TP 2 prefill's per-slice counters).
Prints one line "TP-DISAGG <json>".

Usage: python tests/smartgen/tp_disagg_worker.py
"""
from __future__ import annotations

import json
import sys
import threading

import numpy as np

PAIRS = ((1, 1), (2, 1), (1, 2))
MODES = ("full", "partial", "+profile", "+parallel", "smartgen")
PROMPT_LENS = (70, 45)
MAX_TOKENS = 6


def _spec(arr) -> str:
    return str(getattr(arr.sharding, "spec", "single-device"))


def main() -> int:
    import jax

    from jkv.disagg.decode_worker import DecodeWorker
    from jkv.disagg.selectors import build_selector, calibration_ids
    from jkv.transfer.plan import TransferConfig
    from jkv.transfer.profile import build_profile
    from models import tiny_model
    from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

    models = {tp: tiny_model("qwen2", 0, tensor_parallel=tp) for tp in (1, 2)}
    # the decode side builds the selector and the profile once and ships them (jkv serve does the same)
    selector = build_selector(models[1], "infinigen")
    profile = build_profile(models[1], selector, "infinigen", {64: [calibration_ids(models[1], 64, seed=99)]},
                            steps=2, max_blocks=16)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, models[1].cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
    prefill = {tp: InProcessWorkers(models[tp], selector, 1) for tp in (1, 2)}
    result = {"devices": len(jax.devices()), "runs": {}}
    try:
        for p_tp, d_tp in PAIRS:
            for mode in MODES:
                decode = DecodeWorker(models[d_tp], selector, TransferConfig(mode=mode, kr_fraction=0.3,
                                                                             max_blocks=16),
                                      secret=SECRET, profile=profile)
                try:
                    decode.connect(prefill[p_tp].addresses)
                    outs = decode.generate(make_requests(prompts, MAX_TOKENS))
                    K = decode.pages.cache.kv[0][0]
                    result["runs"][f"{p_tp}->{d_tp} {mode}"] = dict(
                        tokens=[o.token_ids for o in outs], finish=[o.finish_reason for o in outs],
                        on_demand_ratio=[o.metrics.extra["on_demand_ratio"] for o in outs],
                        peer_tp=[prefill[p_tp].workers[0].config.tensor_parallel, decode.config.tensor_parallel],
                        pages_spec=_spec(K), pages_devices=len(K.sharding.device_set),
                        mask_devices=len(decode.pages.mask.sharding.device_set),
                        leaked=bool(decode.pool.live() or decode.pages.cache.pages_in_use))
                finally:
                    decode.close()
        slice_runs(models, selector, profile, prompts, prefill, result["runs"])
        result["runs"]["export"] = export_checks()
    finally:
        for w in prefill.values():
            w.close()
    result["prefill_leaked"] = any(worker.held() or worker.pool.bytes_in_use
                                   for w in prefill.values() for worker in w.workers)
    print("TP-DISAGG " + json.dumps(result))
    return 0


def slice_runs(models, selector, profile, prompts, prefill, runs) -> None:
    """Prefill TP 2 -> decode TP 2 in every mode into runs["2->2 <mode>"], each with what the TP 2
    prefill worker exported and pushed per KV-head slice during it ("export", counter deltas) and
    the shapes of multi-device [B, H_kv, T, D] arrays its thread converted to numpy whole ("gathers":
    a sharded K or V taken whole would show here; the export copies shard by shard)."""
    from jax._src.array import ArrayImpl

    from jkv.disagg.decode_worker import DecodeWorker
    from jkv.transfer.plan import TransferConfig
    from tests.smartgen.smartgen_cases import SECRET, make_requests

    worker, threads = prefill[2].workers[0], set(prefill[2].threads)
    gathers, to_numpy = [], ArrayImpl.__array__

    cfg = models[2].cfg

    def recording(self, *args, **kw):  # only multi-device arrays get here (one device: buffer protocol)
        kv_shaped = self.ndim == 4 and self.shape[1] == cfg.num_kv_heads and self.shape[-1] == cfg.head_dim
        if kv_shaped and threading.current_thread() in threads:  # not selector metadata, logits, tokens
            gathers.append(list(self.shape))
        return to_numpy(self, *args, **kw)

    ArrayImpl.__array__ = recording
    try:
        for mode in MODES:
            before, gathers[:] = worker.kv_export.snapshot(), []
            decode = DecodeWorker(models[2], selector, TransferConfig(mode=mode, kr_fraction=0.3, max_blocks=16),
                                  secret=SECRET, profile=profile)
            try:
                decode.connect(prefill[2].addresses)
                outs = decode.generate(make_requests(prompts, MAX_TOKENS))
                after = worker.kv_export.snapshot()
                runs[f"2->2 {mode}"] = dict(
                    tokens=[o.token_ids for o in outs], finish=[o.finish_reason for o in outs],
                    on_demand_ratio=[o.metrics.extra["on_demand_ratio"] for o in outs],
                    peer_tp=[worker.config.tensor_parallel, decode.config.tensor_parallel],
                    leaked=bool(decode.pool.live() or decode.pages.cache.pages_in_use), gathers=list(gathers),
                    slices=[worker.config.kv_head_slices, decode.config.kv_head_slices],
                    export={k: after[k] - before[k] for k in ("copies", "layers")},
                    blocks={k: n - before["blocks"][k] for k, n in after["blocks"].items()},
                    held={k: n - before["held"][k] for k, n in after["held"].items()})
            finally:
                decode.close()
    finally:
        ArrayImpl.__array__ = to_numpy


def export_checks() -> dict:
    """head_slices and export_layer on K, V laid out over 4 devices: split by head (8 KV heads, 2 a
    shard) and replicated (2 KV heads on every shard: each head copied once). Per layout: its
    slices, the copies made, and whether the pools hold exactly K, V over each request's tokens."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jkv.disagg.head_slices import export_layer, head_slices

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4), ("data", "tensor"))
    lengths, out = np.asarray([8, 5]), {}
    for name, heads, spec in (("split", 8, PartitionSpec(None, "tensor")), ("replicated", 2, PartitionSpec())):
        sharding = NamedSharding(mesh, spec)
        K, V = (np.random.default_rng(i).standard_normal((2, heads, 8, 4)).astype(np.float32) for i in (0, 1))
        dests = [np.full((2, heads, n, 4), np.nan, np.float32) for n in lengths]
        copies = export_layer((jax.device_put(K, sharding), jax.device_put(V, sharding)), dests, lengths)
        exact = all(np.array_equal(dests[b], np.stack([K[b, :, :n], V[b, :, :n]])) for b, n in enumerate(lengths))
        out[name] = dict(slices=[list(r) for r in head_slices(sharding, heads)], copies=copies, exact=exact)
    return out


if __name__ == "__main__":
    sys.exit(main())
