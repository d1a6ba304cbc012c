"""Is b=1 decode at this box's memory bandwidth, or at one core's share of it? And which XLA:CPU
flags or program shapes let decode's matrix-vector products use both cores?

Part 1 (one process, side by side): read a SmolLM2-sized float32 array (135M floats, ~540 MB) with
a jitted XLA reduction, the same reduction split into two independent halves (the thunk runtime
may run them on two threads), numpy (one thread) and torch at 1 and 2 threads. GB/s from wall
time, and CPU seconds (all threads) per pass.

Part 2: a synthetic decode step at SmolLM2's weight shapes (30 layers of q/k/v 576x960, o 576x576,
gate+up 576x3072, down 1536x576, then the 576x49152 LM head; no attention), batch 1 and 8, as one
jitted program: `plain` (each product one dot), `split` (each weight stored as two column halves,
two independent dots whose results are concatenated).

Part 3 (`steps`, loads SmolLM2): the real decode step's programs, see `step_cases`.

Flag comparison: the parent process runs a child per XLA_FLAGS variant (XLA reads the flags once,
when its backend starts), alternating variants for --rounds rounds, and prints medians. Each child
records the 1-minute load average; on a shared box compare variants only within a round.

    PYTHONPATH=. python experiments/decode_bw.py [--rounds 3] [--variants default xla_cpu_use_xnnpack=true]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, FFN, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30  # SmolLM2-135M
WEIGHT_FLOATS = 135_000_000
# XLA_FLAGS per child, without the leading "--" (argparse would take them for options); "default"
# is no flag.
DEFAULT_VARIANTS = ("default", "xla_cpu_use_xnnpack=true", "xla_cpu_use_onednn=true",
                    "xla_cpu_multi_thread_eigen=false", "xla_cpu_prefer_vector_width=512")


def per_pass(fn, iters: int) -> tuple[float, float]:
    """(wall s, CPU s) per call: the median wall of iters calls after a warm-up, mean CPU."""
    fn()
    walls = []
    c = time.process_time()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls), (time.process_time() - c) / iters


def bandwidth_cases(iters: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    host = np.random.default_rng(0).standard_normal(WEIGHT_FLOATS, dtype=np.float32)
    dev = jnp.asarray(host)
    halves = (jnp.asarray(host[: WEIGHT_FLOATS // 2]), jnp.asarray(host[WEIGHT_FLOATS // 2:]))
    xla_sum = jax.jit(jnp.sum)
    xla_halves = jax.jit(lambda a, b: jnp.sum(a) + jnp.sum(b))
    t = torch.from_numpy(host)
    out = {}

    def torch_sum(n):
        torch.set_num_threads(n)
        return lambda: float(t.sum())

    for name, fn in (("xla_sum", lambda: xla_sum(dev).block_until_ready()),
                     ("xla_sum_halves", lambda: xla_halves(*halves).block_until_ready()),
                     ("numpy_sum", lambda: host.sum()),
                     ("torch_sum_1thread", torch_sum(1)), ("torch_sum_2threads", torch_sum(2))):
        wall, cpu = per_pass(fn, iters)
        out[name] = dict(wall_s=wall, cpu_s=cpu, gb_s=host.nbytes / wall / 1e9)
    torch.set_num_threads(os.cpu_count() or 1)
    return out


def synthetic_weights(split: bool):
    import jax.numpy as jnp

    rng = np.random.default_rng(1)

    def w(k, n):
        a = (rng.standard_normal((k, n), dtype=np.float32) * k ** -0.5)
        return (jnp.asarray(a[:, : n // 2]), jnp.asarray(a[:, n // 2:])) if split else jnp.asarray(a)

    layers = [dict(qkv=w(HIDDEN, QKV), o=w(HIDDEN, HIDDEN), gate_up=w(HIDDEN, 2 * FFN), down=w(FFN, HIDDEN))
              for _ in range(LAYERS)]
    return layers, w(HIDDEN, VOCAB)


def decode_chain(layers, head, x):
    """x: [B, HIDDEN] through every weight once (a decode step's weight reads) -> [B, VOCAB]."""
    import jax
    import jax.numpy as jnp

    def dot(x, w):
        if isinstance(w, tuple):
            return jnp.concatenate([x @ w[0], x @ w[1]], axis=-1)
        return x @ w

    for p in layers:
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
        qkv = dot(h, p["qkv"])
        x = x + dot(qkv[:, :HIDDEN], p["o"])
        gu = dot(x, p["gate_up"])
        x = x + dot(jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:], p["down"])
    return dot(x, head)


def decode_cases(iters: int) -> dict:
    import jax
    import jax.numpy as jnp

    out = {}
    step = jax.jit(decode_chain)
    for split in (False, True):
        layers, head = synthetic_weights(split)
        for B in (1, 8):
            x = jnp.ones((B, HIDDEN), jnp.float32)
            wall, cpu = per_pass(lambda: step(layers, head, x).block_until_ready(), iters)
            out[f"decode_{'split' if split else 'plain'}_b{B}"] = dict(
                wall_s=wall, cpu_s=cpu, gb_s=4 * WEIGHT_FLOATS / wall / 1e9)
        del layers, head
    return out


def step_cases(iters: int) -> dict:
    """SmolLM2's real decode step at 1,024 tokens of context, batch 1 and 8: the read-only compute
    program of the dense cache (`Model.decode_step`, what bench_generate measured before
    2026-12-02) and of the paged cache (`Model.paged_decode_step`, what `LLM` and `jkv serve` run),
    and the per-step host work around the dense one (the in-place KV write program and the argmax
    brought to the host)."""
    import jax
    import jax.numpy as jnp

    from models import load_model

    m, N, P = load_model("smollm2-135m-instruct"), 1024, 16
    out = {}
    for B in (1, 8):
        lengths = np.full(B, N, np.int32)
        _, kv = m.prefill(np.random.default_rng(0).integers(0, 49000, (B, N)).astype(np.int32), lengths)
        cache = m.cache_from_prefill(kv, N + 64)
        pages_per_row = (N + 64) // P
        table = jnp.asarray(1 + np.arange(B * pages_per_row).reshape(B, pages_per_row), jnp.int32)
        pages = m.write_prefill_pages(m.init_paged_kv(1 + B * pages_per_row, P), table, kv, lengths)
        tok, pos = jnp.full((B,), 42, jnp.int32), jnp.asarray(lengths)
        logits, new_k, new_v = m._decode_compute(m.params, cache, tok, pos)
        state = {"cache": cache}

        def write():
            state["cache"] = jax.block_until_ready(m._write_kv(state["cache"], new_k, new_v, pos))

        for name, fn in (
                ("dense_compute", lambda: jax.block_until_ready(m._decode_compute(m.params, state["cache"], tok, pos))),
                ("paged_compute", lambda: jax.block_until_ready(m._paged_decode_compute(m.params, pages, table, tok,
                                                                                        pos))),
                ("dense_write", write), ("argmax_to_host", lambda: np.asarray(logits.argmax(-1)))):
            wall, cpu = per_pass(fn, iters)
            out[f"step_{name}_b{B}"] = dict(wall_s=wall, cpu_s=cpu, gb_s=4 * WEIGHT_FLOATS / wall / 1e9)
        del cache, pages, kv, state
    return out


def child(iters: int, parts: list[str]) -> None:
    from jkv.xla_options import require_optimized

    require_optimized("decode_bw")
    load = os.getloadavg()[0]
    result = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "load_before": load}
    if "bandwidth" in parts:
        result.update(bandwidth_cases(iters))
    if "decode" in parts:
        result.update(decode_cases(iters))
    if "steps" in parts:
        result.update(step_cases(iters))
    result["load_after"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(result), flush=True)


def csv_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per (variant, round, case): wall and CPU ms per pass, GB/s, the load around the child."""
    from experiments.common import machine_info

    info = machine_info()
    return [dict(variant=v, round=r, case=case, wall_ms=res[case]["wall_s"] * 1e3, cpu_ms=res[case]["cpu_s"] * 1e3,
                 gb_s=res[case]["gb_s"], xla_flags=res["xla_flags"], loadavg_1m=round(res["load_before"], 2),
                 loadavg_1m_after=round(res["load_after"], 2), cpu_model=info["cpu_model"],
                 vector_extensions=info["vector_extensions"], cores=info["cores"])
            for v, results in runs.items() for r, res in enumerate(results)
            for case in res if isinstance(res[case], dict)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS), help="XLA_FLAGS per child")
    ap.add_argument("--parts", nargs="+", choices=("bandwidth", "decode", "steps"),
                    default=["bandwidth", "decode", "steps"])
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/decode_bw.csv)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.iters, args.parts)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            env = {**os.environ, "XLA_FLAGS": "" if v == "default" else " ".join("--" + f for f in v.split())}
            p = subprocess.run([sys.executable, __file__, "--child", "--iters", str(args.iters),
                                "--parts", *args.parts], env=env,
                               capture_output=True, text=True, check=True)
            res = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
            runs[v].append(res)
            print(f"round {r} {v}: " + json.dumps(res), flush=True)
    print(f"\nmedians over {args.rounds} rounds; wall ms / CPU ms per pass / GB/s")
    for v, results in runs.items():
        loads = [x["load_before"] for x in results] + [x["load_after"] for x in results]
        print(f"== {v}  load {min(loads):.1f}-{max(loads):.1f}")
        for case in (k for k in results[0] if isinstance(results[0][k], dict)):
            med = {m: statistics.median(x[case][m] for x in results) for m in ("wall_s", "cpu_s", "gb_s")}
            print(f"  {case:<24} {med['wall_s'] * 1e3:8.1f} {med['cpu_s'] * 1e3:8.1f} {med['gb_s']:6.1f}")
    from experiments.common import RESULTS, write_csv

    out = Path(args.out or RESULTS / "decode_bw.csv")
    write_csv(out, csv_rows(runs))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
