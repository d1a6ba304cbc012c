"""Decision latency of the online compression controller (KVServe §6; target < 1 ms per request).

Builds a controller over `--profiles` synthetic Pareto profiles per workload (4 workloads), then
times `decide` and `decide + observe` over random contexts (bandwidth 0.1-100 Gbit/s, random SLO
and quality budgets). Prints p50/p99/max in microseconds and writes
experiments/results/bench_controller.csv.

    python experiments/bench_controller.py [--profiles 40] [--decisions 20000]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from jkv.compression.bandwidth import BandwidthEstimator
from jkv.compression.controller import Context, Controller, ControllerConfig, Profile

from experiments.common import RESULTS, add_out_arg, write_csv


def synthetic_profiles(n: int, rng: random.Random) -> list[Profile]:
    """Pareto-like: higher CR costs throughput and quality."""
    out = []
    for i in range(n):
        cr = 1.2 + 14 * rng.random()
        out.append(Profile(f"p{i}", cr, rng.uniform(0.5e9, 40e9) / cr ** 0.5, 1.0 - 0.004 * cr * rng.random()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=int, default=40)
    ap.add_argument("--decisions", type=int, default=20000)
    add_out_arg(ap, RESULTS / "bench_controller.csv")
    args = ap.parse_args()
    rng = random.Random(0)
    workloads = ["code", "qa", "needle", "summary"]
    t0 = time.perf_counter()
    ctl = Controller({w: synthetic_profiles(args.profiles, rng) for w in workloads}, ControllerConfig(),
                     BandwidthEstimator(initial_Bps=1.25e9))
    build_ms = (time.perf_counter() - t0) * 1e3
    sizes = [len(ctl.envelope(w, 0.9).profiles) for w in workloads]
    contexts = [Context(rng.choice(workloads), t_slo_s=rng.uniform(0.05, 5), q_min=rng.choice([0.9, 0.95, 0.97, 0.99]),
                        kv_bytes=rng.randint(10**6, 10**9), t_model_s=rng.uniform(0, 0.5),
                        bandwidth_Bps=10 ** rng.uniform(np.log10(0.1e9 / 8), np.log10(100e9 / 8)))
                for _ in range(args.decisions)]
    decide_us, loop_us = [], []
    for ctx in contexts:
        t0 = time.perf_counter_ns()
        d = ctl.decide(ctx)
        t1 = time.perf_counter_ns()
        ctl.observe(d, d.predicted_s * rng.uniform(0.9, 1.3))
        t2 = time.perf_counter_ns()
        decide_us.append((t1 - t0) / 1e3)
        loop_us.append((t2 - t0) / 1e3)
    rows = []
    for name, values in (("decide", decide_us), ("decide+observe", loop_us)):
        v = np.asarray(values)
        row = {"op": name, "profiles_per_workload": args.profiles, "decisions": args.decisions,
               "p50_us": round(float(np.percentile(v, 50)), 2), "p99_us": round(float(np.percentile(v, 99)), 2),
               "max_us": round(float(v.max()), 2)}
        rows.append(row)
        print(f"{name:15s} p50 {row['p50_us']:8.2f} us  p99 {row['p99_us']:8.2f} us  max {row['max_us']:9.2f} us  "
              f"(p99 / 1 ms budget = {row['p99_us'] / 1000:.3f})")
    print(f"controller build (envelopes for {len(workloads)} workloads x {len(ctl.buckets)} buckets): {build_ms:.1f} ms; "
          f"envelope sizes at q>=0.9: {sizes}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
