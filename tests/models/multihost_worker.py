"""One rank of a 2-process replica for test_multihost.py: 2 CPU devices per process, one model at
tensor_parallel=4 over the 4 global devices (jax.distributed on loopback, gloo collectives).

The rank and the coordinator come from JKV_COORDINATOR_ADDRESS / JKV_NUM_PROCESSES / JKV_PROCESS_ID
(jkv/multihost.py); XLA_FLAGS=--xla_force_host_platform_device_count=2 from the test. Prints one
line "MULTIHOST <json>": the greedy tokens of the shared batch, where the KV cache's shards live,
and the error each rank raised for a batch that differs on rank 1.

Usage: python tests/models/multihost_worker.py
"""
from __future__ import annotations

import json
import sys

PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 40))]
MAX_TOKENS = 8
# 8 query / 4 KV heads: TP 4 splits attention and the KV cache by KV head across both processes
MODEL = dict(family="qwen3", seed=0, num_heads=8, num_kv_heads=4)


def main() -> int:
    import jkv.cli  # noqa: F401  (jkv generate's import order: the package first, then initialize)
    from jkv.multihost import MultiHost, MultiHostError, initialize

    mh = MultiHost.from_values()
    initialize(mh)
    import jax

    from jkv import LLM, SamplingParams
    from models import tiny_model

    model = tiny_model(MODEL["family"], MODEL["seed"], tensor_parallel=jax.device_count(),
                       **{k: v for k, v in MODEL.items() if k not in ("family", "seed")})
    llm = LLM(model, max_batch_size=2)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, sp)]
    K = llm._engine.kv_cache.kv[0][0]  # read now: the next step donates it
    kv = dict(kv_spec=str(K.sharding.spec), kv_processes=sorted({d.process_index for d in K.sharding.device_set}),
              kv_local_shards=len(K.addressable_shards))
    try:  # rank 1 asks for another batch: every rank must refuse before any step
        llm.generate(PROMPTS if mh.process_id == 0 else PROMPTS[::-1], sp)
        refused = None
    except MultiHostError as e:
        refused = str(e)
    again = [r.token_ids for r in llm.generate(PROMPTS, sp)]  # the replica still works afterwards
    print("MULTIHOST " + json.dumps(dict(
        rank=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
        local_devices=jax.local_device_count(), tokens=tokens, again=again, refused=refused, **kv)), flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
