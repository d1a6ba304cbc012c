"""Prefill and decode at different tensor-parallel degrees, for test_smartgen_tensor_parallel.py,
in a process of its own with 4 CPU devices (XLA fixes the host device count when jax initialises).

One in-process prefill worker (real TCP endpoints on loopback) per prefill degree, and a fresh
decode worker per (decode degree, transfer mode), on the tiny Qwen2 of the SmartGen tests (6 query
/ 2 KV heads: TP 2 splits the KV cache by KV head on both sides). The pairs run are
prefill TP -> decode TP 1 -> 1 (the reference), 2 -> 1 and 1 -> 2, each in every transfer mode.
Prints one line "TP-DISAGG <json>".

Usage: python tests/smartgen/tp_disagg_worker.py
"""
from __future__ import annotations

import json
import sys

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
    finally:
        for w in prefill.values():
            w.close()
    result["prefill_leaked"] = any(worker.held() or worker.pool.bytes_in_use
                                   for w in prefill.values() for worker in w.workers)
    print("TP-DISAGG " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
