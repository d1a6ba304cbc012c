"""Per-op CPU cost, XLA:CPU (jax) vs torch, at SmolLM2-135M's shapes in float32, side by side in one
process: the matmuls of a prefill (T tokens) and of decode steps at batch 1 and 8, the LM head, and
prefill attention (`models.transformer.prefill_attention(native=True)`, what `Model.prefill` runs: the
native CPU kernel, vs torch's scaled_dot_product_attention).

Per op: CPU milliseconds per call (time.process_time: user+sys of every thread of this process, so
a thread spinning at an OpenMP barrier counts) and wall milliseconds, means over
--iters calls after a warm-up. docs/performance.md reads these to explain where bench_generate's
ratio comes from. Writes experiments/results/cpu_ops.csv (or --out) with the machine and load.

    PYTHONPATH=. python experiments/cpu_ops.py [--tokens 1024] [--torch-threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import RESULTS, describe_machine, machine_info, write_csv  # noqa: E402
from jkv.xla_options import require_optimized  # noqa: E402

H, D, H_KV, HIDDEN, FFN, VOCAB = 9, 64, 3, 576, 1536, 49152  # SmolLM2-135M


def per_call_ms(fn, iters: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per call, averaged over iters calls after one warm-up call."""
    fn()
    c, w = time.process_time(), time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.process_time() - c) / iters * 1e3, (time.perf_counter() - w) / iters * 1e3


def matmul_pair(rng, M: int, K: int, N: int):
    import jax
    import jax.numpy as jnp
    import torch

    a, b = rng.standard_normal((M, K), np.float32), rng.standard_normal((K, N), np.float32)
    ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
    f = jax.jit(lambda x, y: x @ y)
    return (lambda: f(ja, jb).block_until_ready()), (lambda: ta @ tb)


def attention_pair(rng, T: int):
    import jax
    import jax.numpy as jnp
    import torch

    from models.transformer import prefill_attention

    q = rng.standard_normal((1, T, H, D), np.float32)
    kv = rng.standard_normal((2, 1, H_KV, T, D), np.float32)
    jq, jk, jv = jnp.asarray(q), jnp.asarray(kv[0]), jnp.asarray(kv[1])
    pos, lengths = jnp.arange(T, dtype=jnp.int32)[None], jnp.array([T], jnp.int32)
    f = jax.jit(lambda *a: prefill_attention(*a, native=True))  # as Model.prefill: the CPU kernel
    tq = torch.from_numpy(q).transpose(1, 2)
    tk, tv = (torch.from_numpy(x).repeat_interleave(H // H_KV, 1) for x in kv)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return (lambda: f(jq, jk, jv, pos, lengths).block_until_ready()), (lambda: sdpa(tq, tk, tv, is_causal=True))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="prefill length T")
    ap.add_argument("--iters", type=int, default=3, help="calls per op for T-token ops (x10 for decode ops)")
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS / "cpu_ops.csv"))
    args = ap.parse_args(argv)
    require_optimized("cpu_ops")
    import torch

    torch.set_grad_enabled(False)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    info = machine_info()
    print(f"{describe_machine(info)}; torch threads {torch.get_num_threads()}")
    rng = np.random.default_rng(0)
    cases = []
    for stage, M in (("prefill", args.tokens), ("decode b=1", 1), ("decode b=8", 8)):
        iters = args.iters if M > 8 else 10 * args.iters
        for name, K, N in (("q/k/v", HIDDEN, (H + 2 * H_KV) * D), ("gate+up", HIDDEN, 2 * FFN), ("down", FFN, HIDDEN)):
            cases.append((f"{stage} {name} {M}x{K}x{N}", matmul_pair(rng, M, K, N), iters))
    for M in (1, 8):
        cases.append((f"lm_head {M}x{HIDDEN}x{VOCAB}", matmul_pair(rng, M, HIDDEN, VOCAB), 5 * args.iters))
    cases.append((f"prefill attention T={args.tokens}", attention_pair(rng, args.tokens), args.iters))
    rows = []
    for name, (jax_fn, torch_fn), iters in cases:
        load = os.getloadavg()[0]
        (jc, jw), (tc, tw) = per_call_ms(jax_fn, iters), per_call_ms(torch_fn, iters)
        rows.append(dict(op=name, xla_cpu_ms=jc, torch_cpu_ms=tc, cpu_ratio=jc / tc, xla_wall_ms=jw, torch_wall_ms=tw,
                         loadavg_1m=round(load, 2), torch_threads=torch.get_num_threads(),
                         xla_flags=os.environ.get("XLA_FLAGS", ""), cpu_model=info["cpu_model"],
                         vector_extensions=info["vector_extensions"], cores=info["cores"]))
        print(f"{name:<34} XLA {jc:8.3f} CPU-ms {jw:8.3f} wall-ms | torch {tc:8.3f} CPU-ms {tw:8.3f} wall-ms | "
              f"CPU ratio {jc / tc:5.2f}  load {load:.1f}")
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
