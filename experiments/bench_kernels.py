"""Micro-benchmark of the decode-path kernels at SmartGen's decode sizes.

    python experiments/bench_kernels.py                 # CPU: XLA reference path only
    python experiments/bench_kernels.py --device gpu    # GPU: Pallas vs XLA reference, side by side

Sizes (issue 3): R = B*H_kv = 8*8 rows, N = 32K cached tokens, k = ceil(0.2 N), D = 128, bf16,
H = 32 query heads (GQA group 4), InfiniGen partial dim d_p = ceil(0.3 D).

For every op it prints the median time, the achieved bandwidth over the op's *minimal* traffic
(each input read once, each output written once; `_BYTES` below) and, on a GPU, the fraction of
the HBM bandwidth measured in the same run (a large elementwise copy) and the speed-up over the
XLA reference. Results go to experiments/results/kernels_<device>.csv. Interpret mode is never
timed: on CPU only the reference path means anything.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments.common import RESULTS, write_csv  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` over `repeats` runs, after one compile + warm-up call."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _hbm_bandwidth(repeats: int) -> float:
    """Bytes/s of a 1 GiB read + 1 GiB write elementwise op: the attainable HBM bandwidth."""
    x = jnp.zeros((256 * 1024 * 1024,), jnp.float32)
    seconds = median_seconds(jax.jit(lambda a: a + 1.0), (x,), repeats)
    return 2 * x.nbytes / seconds


def _inputs(batch, kv_heads, group, n, k, head_dim, d_p, seed=0):
    rows = batch * kv_heads
    rng = np.random.default_rng(seed)
    bf16 = jnp.bfloat16
    scores = jnp.asarray(rng.standard_normal((rows, n), np.float32), bf16)
    valid_len = jnp.full((rows,), n, jnp.int32)
    q_partial = jnp.asarray(rng.standard_normal((rows, group, d_p), np.float32), bf16)
    k_partial = jnp.asarray(rng.standard_normal((rows, n, d_p), np.float32), bf16)
    # Selection as the engine produces it; a mask with ~30% of tokens still remote.
    with dispatch.backend("xla"):
        kv_index = jax.jit(dispatch.topk_select, static_argnums=2)(scores, valid_len, k)
    kv_mask = jnp.asarray(rng.choice(np.array([1, 2], np.int8), (batch, n), p=[0.7, 0.3]))
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim), np.float32), bf16)
    k_sel = jnp.asarray(rng.standard_normal((rows, k, head_dim), np.float32), bf16)
    v_sel = jnp.asarray(rng.standard_normal((rows, k, head_dim), np.float32), bf16)
    valid_count = jnp.full((rows,), k, jnp.int32)
    return {
        "topk_select": ((scores, valid_len), dict(k=k)),
        "topk_select_fused": ((q_partial, k_partial, valid_len), dict(k=k)),
        "split_reorder": ((kv_index, kv_mask), dict(heads_per_batch=kv_heads)),
        "sparse_decode_attention": ((q, k_sel, v_sel, valid_count), {}),
    }


def _bytes(name, args, k) -> int:
    """Minimal HBM traffic of an op: inputs read once, outputs written once."""
    rows = args[0].shape[0]
    if name == "topk_select":
        return args[0].nbytes + args[1].nbytes + rows * k * 4
    if name == "topk_select_fused":
        return sum(a.nbytes for a in args) + rows * k * 4
    if name == "split_reorder":
        kv_index = args[0]
        # index in, one mask byte gathered per entry, index out, two counts.
        return kv_index.nbytes + kv_index.size + kv_index.nbytes + 2 * rows * 4
    q = args[0]
    return sum(a.nbytes for a in args) + q.nbytes  # q, K_sel, V_sel, counts in; out


def _op(name, static):
    fn = getattr(dispatch, name)
    return jax.jit(lambda *a: fn(*a, **static))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--tokens", type=int, default=32 * 1024, help="N")
    parser.add_argument("--ratio", type=float, default=0.2, help="k = ceil(ratio * N)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=None, help="default: 20 on GPU, 3 on CPU")
    parser.add_argument("--out", default=RESULTS, help="folder for kernels_<device>.csv")
    args = parser.parse_args(argv)

    platform = jax.default_backend()
    if args.device == "gpu" and platform != "gpu":
        parser.error(f"--device gpu but jax's default backend is {platform!r}")
    repeats = args.repeats or (20 if args.device == "gpu" else 3)
    n = args.tokens
    k = math.ceil(args.ratio * n)
    d_p = math.ceil(0.3 * args.head_dim)
    rows = args.batch * args.kv_heads
    cases = _inputs(args.batch, args.kv_heads, args.group, n, k, args.head_dim, d_p)
    device = jax.devices()[0].device_kind
    if args.device == "gpu":  # Mosaic GPU attention on sm_90+ (dispatch's "auto" choice)
        with dispatch.backend("auto"):
            gpu_kernels = dispatch.resolved_backend()
        backends = ("mosaic", "pallas", "xla") if gpu_kernels == "mosaic" else ("pallas", "xla")
    else:
        backends = ("xla",)
    hbm = _hbm_bandwidth(repeats) if args.device == "gpu" else None
    print(f"# {device}, jax {jax.__version__}: R={rows} N={n} k={k} D={args.head_dim} "
          f"G={args.group} d_p={d_p} bf16, median of {repeats}")
    if hbm:
        print(f"# measured HBM bandwidth (1 GiB elementwise copy): {hbm / 1e9:.0f} GB/s")

    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records, seconds = [], {}
    for name, (op_args, static) in cases.items():
        traffic = _bytes(name, op_args, k)
        for backend in backends:
            with dispatch.backend(backend):
                seconds[name, backend] = median_seconds(_op(name, static), op_args, repeats)
            gbps = traffic / seconds[name, backend] / 1e9
            record = dict(
                utc=stamp, device=device, op=name, backend=backend, rows=rows, tokens=n, k=k,
                head_dim=args.head_dim, dtype="bfloat16", ms=seconds[name, backend] * 1e3,
                bytes=traffic, gbps=gbps, hbm_fraction=(gbps * 1e9 / hbm) if hbm else "",
                speedup_vs_xla="",
            )
            records.append(record)
        if args.device == "gpu":
            for record in records[-len(backends):]:
                record["speedup_vs_xla"] = seconds[name, "xla"] / seconds[name, record["backend"]]
        for record in records[-len(backends):]:
            extra = ""
            if hbm:
                extra = f"  {record['hbm_fraction']:6.1%} of HBM"
            if record["speedup_vs_xla"] != "":
                extra += f"  {record['speedup_vs_xla']:.2f}x vs xla"
            print(f"{name:26s} {record['backend']:7s} {record['ms']:9.3f} ms "
                  f"{record['gbps']:9.3g} GB/s{extra}")

    if args.device == "gpu":
        best = backends[0]  # the backend "auto" uses on this GPU
        attention = seconds["sparse_decode_attention", best]
        select = seconds["topk_select", "pallas"] + seconds["split_reorder", "pallas"]
        attention_fraction = next(
            r["hbm_fraction"] for r in records
            if r["op"] == "sparse_decode_attention" and r["backend"] == best
        )
        print("# goals (issue 3):")
        print(f"#   attention ({best}) >= 60% of HBM: {attention_fraction:.1%}")
        print(f"#   topk + split_reorder <= attention: {select * 1e3:.3f} ms vs {attention * 1e3:.3f} ms")
        for name in cases:
            ratio = seconds[name, "xla"] / seconds[name, best]
            print(f"#   {name} >= 1.0x xla: {ratio:.2f}x")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kernels_{args.device}.csv")
    write_csv(path, records)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
