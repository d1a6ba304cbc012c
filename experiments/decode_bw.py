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

Part 4 (`paged`, not in the default parts): the paged decode attention, the XLA gather reference
against the native CPU kernel (and a `promise_in_bounds` gather), one layer alone and in the real
step, alternated in one process at b=1 / 8 and 1K / 2K tokens, see `paged_cases`:

    PYTHONPATH=. python experiments/decode_bw.py --parts paged --variants default --rounds 1 --iters 3 \
        --out experiments/results/decode_bw_paged.csv

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


def _gather_promise_in_bounds(q, k_pages, v_pages, page_table, lengths):
    """The XLA reference with its page gather flagged `promise_in_bounds` (a candidate of issue
    18: clip / fill modes add per-index work); the table is clipped first, as the reference does."""
    import jax.numpy as jnp

    from pallas_kernels.sparse_attention import sparse_decode_attention_partials_reference

    num_pages, kv_heads, _, head_dim = k_pages.shape
    table = jnp.where(jnp.isnan(q[:, 0, :1]), 0, jnp.clip(page_table, 0, num_pages - 1))

    def rows(pages):
        g = pages.at[table].get(mode="promise_in_bounds").transpose(0, 2, 1, 3, 4)
        return g.reshape(q.shape[0] * kv_heads, -1, head_dim)

    return sparse_decode_attention_partials_reference(q, rows(k_pages), rows(v_pages),
                                                      jnp.repeat(lengths.astype(jnp.int32), kv_heads))


def paged_cases(iters: int, rounds: int = 3) -> dict:
    """Paged decode attention, old (XLA gather + attention) against new (the native CPU kernel,
    `pallas_kernels.cpu_paged_attention`), SmolLM2's geometry (H=9, H_kv=3, D=64, P=16, 30
    layers), b=1 and 8, 1,024 and 2,048 tokens of context, alternated in this one process.

    - `paged_layer_<variant>`: one layer's attention alone (reference, reference with a
      `promise_in_bounds` gather, native with rows split over XLA's pool threads, native on one
      thread), CPU-ms a call;
    - `paged_step_<variant>`: the real compute program `Model.paged_decode_step` runs, traced with
      `dispatch.cpu_kernels(False)` (reference) and `(True)` (native), CPU-ms a step.

    Pages hold random KV (attention's cost does not depend on the values; a prefill of 8 x 2K
    tokens would cost minutes here), each layer its own arrays, rows' pages contiguous runs as the
    allocator hands a fresh pool out. Each round runs every variant `iters` times in turn; a case's
    figure is the median over rounds, and `_min` / `_max` give the spread. The step's logits of
    both variants are compared (the CSV's `max_abs_logit_diff` on the step rows)."""
    import functools

    import jax
    import jax.numpy as jnp

    from models import load_model, paged
    from pallas_kernels import dispatch, mosaic_attention
    from pallas_kernels.cpu_paged_attention import available, paged_decode_attention_partials_cpu

    if not available():
        raise RuntimeError("the CPU paged attention kernel could not be built (see the log)")
    m, P = load_model("smollm2-135m-instruct"), 16
    cfg = m.cfg
    layer_fns = {"reference": jax.jit(mosaic_attention.paged_decode_attention_partials_reference),
                 "promise_in_bounds": jax.jit(_gather_promise_in_bounds),
                 "native": jax.jit(paged_decode_attention_partials_cpu),
                 "native_1thread": jax.jit(functools.partial(paged_decode_attention_partials_cpu, max_threads=1))}
    step_fns = {"reference": False, "native": True}  # dispatch.cpu_kernels setting
    out = {}
    rng = np.random.default_rng(0)
    for N in (1024, 2048):
        for B in (1, 8):
            pages_per_row = (N + 64) // P
            num_pages = 1 + B * pages_per_row
            shape = (num_pages, cfg.num_kv_heads, P, cfg.head_dim)
            base = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
            kv = tuple((base * (1 + 0.01 * l), base * (1 - 0.01 * l)) for l in range(cfg.num_layers))  # distinct buffers
            table = jnp.asarray(1 + np.arange(B * pages_per_row).reshape(B, pages_per_row), jnp.int32)
            pos = jnp.full((B,), N, jnp.int32)
            tok = jnp.full((B,), 42, jnp.int32)
            q = jnp.asarray(rng.standard_normal((B, cfg.num_heads, cfg.head_dim), dtype=np.float32))
            kv_bytes = 2 * B * cfg.num_kv_heads * N * cfg.head_dim * 4
            calls = {f"paged_layer_{v}": (functools.partial(fn, q, kv[0][0], kv[0][1], table, pos), kv_bytes)
                     for v, fn in layer_fns.items()}
            for v, enabled in step_fns.items():
                with dispatch.cpu_kernels(enabled):  # read at trace time: trace and compile inside
                    step = jax.jit(functools.partial(paged.paged_decode_step_compute, cfg)).lower(
                        m.params, kv, table, tok, pos).compile()
                calls[f"paged_step_{v}"] = (functools.partial(step, m.params, kv, table, tok, pos),
                                            4 * WEIGHT_FLOATS + cfg.num_layers * kv_bytes)
            logits = {v: np.asarray(calls[f"paged_step_{v}"][0]()[0]) for v in step_fns}
            logit_diff = float(np.abs(logits["native"] - logits["reference"]).max())
            samples: dict[str, list] = {c: [] for c in calls}
            for _ in range(rounds):
                for case, (fn, _) in calls.items():
                    samples[case].append(per_pass(lambda: jax.block_until_ready(fn()), iters))
            for case, runs in samples.items():
                walls, cpus = [w for w, _ in runs], [c for _, c in runs]
                name = f"{case}_b{B}_n{N}"
                out[name] = dict(wall_s=statistics.median(walls), cpu_s=statistics.median(cpus),
                                 gb_s=calls[case][1] / statistics.median(walls) / 1e9)
                if case.startswith("paged_step_"):
                    out[name]["max_abs_logit_diff"] = logit_diff
                out[name + "_min"] = dict(wall_s=min(walls), cpu_s=min(cpus), gb_s=calls[case][1] / min(walls) / 1e9)
                out[name + "_max"] = dict(wall_s=max(walls), cpu_s=max(cpus), gb_s=calls[case][1] / max(walls) / 1e9)
            del kv, base, calls
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
    if "paged" in parts:
        result.update(paged_cases(iters))
    result["load_after"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(result), flush=True)


def csv_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per (variant, round, case): wall and CPU ms per pass, GB/s, the load around the child."""
    from experiments.common import machine_info

    info = machine_info()
    return [dict(variant=v, round=r, case=case, wall_ms=res[case]["wall_s"] * 1e3, cpu_ms=res[case]["cpu_s"] * 1e3,
                 gb_s=res[case]["gb_s"], xla_flags=res["xla_flags"], loadavg_1m=round(res["load_before"], 2),
                 loadavg_1m_after=round(res["load_after"], 2), cpu_model=info["cpu_model"],
                 vector_extensions=info["vector_extensions"], cores=info["cores"],
                 max_abs_logit_diff=res[case].get("max_abs_logit_diff", ""))
            for v, results in runs.items() for r, res in enumerate(results)
            for case in res if isinstance(res[case], dict)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS), help="XLA_FLAGS per child")
    ap.add_argument("--parts", nargs="+", choices=("bandwidth", "decode", "steps", "paged"),
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
