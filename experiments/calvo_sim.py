"""CALVO policy comparison on the discrete-event simulator (paper Figs. 7, 8, 10 without a model).

Serialized FIFO (vLLM + LMCache-like baseline) vs the pipelined engine under FIFO, SJF-PT, SJF,
SRPT (SJF on the remaining modelled cost), EDF and LSTF, on long-context / short-query workloads
built from local documents:

  full-hit   every request's context is in the pool (Figs. 7, 8)
  mixed-hit  each request's hit ratio drawn from {25, 50, 75, 100}% (Fig. 10)

each on the paper's 400 Gbps pool link and on a 25 Gbps thin link. Stage times come from
`StageTimes.paper_like(link_gbps=...)` (CALVO's testbed scaled per token); the cost model used
by SJF/LSTF is *fitted* per link by profiling the simulated engine in isolation, as a deployment
would. QPS is swept as a fraction of the baseline's capacity in each scenario. SLOs are
factor {2, 4, 8} x the request's interference-free TTFT on the baseline (the lenient choice).

    python experiments/calvo_sim.py [--seed 0] [--contexts 16] [--queries 16]

Writes experiments/results/calvo_sim.csv, calvo_sim.png and calvo_sim_cost_model_<link>g.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jkv.scheduling import make_policy  # noqa: E402
from jkv.scheduling.metrics import summarize  # noqa: E402
from jkv.scheduling.simulator import (StageTimes, isolated_ttft_s, profile_cost_model,  # noqa: E402
                                      simulate_pipelined, simulate_serialized)
from jkv.scheduling.workload import WorkloadConfig, build_workload, with_deadlines  # noqa: E402

from experiments.common import RESULTS, add_out_arg, add_seed_arg, write_csv  # noqa: E402

POLICIES = ("serialized-fifo", "fifo", "sjf-pt", "sjf", "srpt", "edf", "lstf", "lstf-static")
# name -> (pool link Gbps, hit ratios)
SCENARIOS = {"full-hit 400G": (400.0, (1.0,)),
             "mixed-hit 400G": (400.0, (0.25, 0.5, 0.75, 1.0)),
             "full-hit 25G": (25.0, (1.0,)),
             "mixed-hit 25G": (25.0, (0.25, 0.5, 0.75, 1.0))}
LOADS = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2)   # offered load relative to the baseline's capacity


def run_point(config: WorkloadConfig, times: StageTimes, cost_model, host_slots: int,
              device_slots: int) -> list[dict]:
    requests = build_workload(config)
    infos = with_deadlines(requests, lambda r: isolated_ttft_s(r.info(), times, pipelined=False))
    slo = [info.deadline_s - info.arrival_s for info in infos]
    rows = []
    for name in POLICIES:
        if name == "serialized-fifo":
            records = simulate_serialized(infos, times)
        else:
            records = simulate_pipelined(infos, times, make_policy(name, cost_model),
                                         host_slots=host_slots, device_slots=device_slots)
        summary = summarize([r.ttft_s for r in records], slo)
        rows.append(dict(policy=name, **summary.as_row()))
    return rows


def baseline_capacity_qps(config: WorkloadConfig, times: StageTimes) -> float:
    """1 / mean serialized service time of this workload's requests."""
    requests = build_workload(dataclasses.replace(config, qps=1.0))
    return 1.0 / float(np.mean([isolated_ttft_s(r.info(), times, pipelined=False)
                                for r in requests]))


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(SCENARIOS), figsize=(5 * len(SCENARIOS), 8), squeeze=False)
    for col, scenario in enumerate(SCENARIOS):
        for policy in POLICIES:
            pts = sorted((r["qps"], r["mean_s"], r["slo_attainment"]) for r in rows
                         if r["scenario"] == scenario and r["policy"] == policy)
            qps, mean, slo = zip(*pts)
            style = "--" if policy == "serialized-fifo" else "-"
            axes[0][col].plot(qps, mean, style, marker="o", label=policy)
            axes[1][col].plot(qps, [100 * s for s in slo], style, marker="o", label=policy)
        axes[0][col].set(title=f"{scenario}: mean TTFT", xlabel="QPS", ylabel="mean TTFT (s)",
                         yscale="log")
        axes[1][col].set(title=f"{scenario}: SLO attainment", xlabel="QPS",
                         ylabel="SLO attainment (%)", ylim=(0, 102))
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_arg(parser)
    parser.add_argument("--contexts", type=int, default=16, help="distinct contexts")
    parser.add_argument("--queries", type=int, default=16, help="queries per context")
    parser.add_argument("--min-context", type=int, default=4096)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--host-slots", type=int, default=512, help="L2 capacity in chunks")
    parser.add_argument("--device-slots", type=int, default=2048, help="L1 capacity in chunks")
    add_out_arg(parser, RESULTS, flag="--out-dir")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    rows = []
    for scenario, (link_gbps, hits) in SCENARIOS.items():
        times = StageTimes.paper_like(args.chunk_tokens, link_gbps=link_gbps)
        cost_model = profile_cost_model(
            times, ctx_tokens=[args.chunk_tokens * k for k in (1, 16, 64, 128)],
            query_tokens=[16, 256, 4096, 16384], deployment=f"simulated paper_like {link_gbps}G")
        cost_model.save(out / f"calvo_sim_cost_model_{int(link_gbps)}g.json")
        base = WorkloadConfig(qps=1.0, num_contexts=args.contexts, queries_per_context=args.queries,
                              min_context_tokens=args.min_context, max_context_tokens=args.max_context,
                              chunk_tokens=args.chunk_tokens, hit_ratios=hits, seed=args.seed)
        capacity = baseline_capacity_qps(base, times)
        print(f"\n== {scenario}: hit ratios {hits}; baseline capacity {capacity:.2f} QPS; "
              f"{base.num_requests} requests per point ==")
        print(f"fitted cost model: T = {cost_model.a:.3e}*ctx + {cost_model.b:.3e} + "
              f"{cost_model.c:.3e}*query + {cost_model.d:.3e}   (cells: mean TTFT / SLO)")
        print(f"{'load':>5} {'QPS':>6} " + " ".join(f"{p:>21}" for p in POLICIES))
        for load in LOADS:
            qps = load * capacity
            point = run_point(dataclasses.replace(base, qps=qps), times, cost_model,
                              args.host_slots, args.device_slots)
            for row in point:
                rows.append(dict(scenario=scenario, link_gbps=link_gbps, load=load, qps=qps,
                                 **row))
            cells = " ".join(f"{r['mean_s']:>9.3f}s / {100 * r['slo_attainment']:>5.1f}%  "
                             for r in point)
            print(f"{load:>5.2f} {qps:>6.2f} {cells}")

    write_csv(out / "calvo_sim.csv", rows)
    plot(rows, out / "calvo_sim.png")

    def get(scenario, load, policy):
        return next(r for r in rows if r["scenario"] == scenario and r["load"] == load
                    and r["policy"] == policy)

    print("\n== ratios at the highest load the baseline sustains (< its capacity) ==")
    for scenario in SCENARIOS:
        sustained = max(load for load in LOADS if load < 1.0)
        b, s = get(scenario, sustained, "serialized-fifo"), get(scenario, sustained, "sjf")
        e, l = get(scenario, sustained, "edf"), get(scenario, sustained, "lstf")
        pt, f = get(scenario, sustained, "sjf-pt"), get(scenario, sustained, "fifo")
        r = get(scenario, sustained, "srpt")
        print(f"{scenario} @ load {sustained} ({b['qps']:.2f} QPS): pipelined SJF mean TTFT "
              f"{100 * (1 - s['mean_s'] / b['mean_s']):.1f}% lower than serialized FIFO; "
              f"LSTF SLO {100 * l['slo_attainment']:.1f}% vs EDF {100 * e['slo_attainment']:.1f}% "
              f"vs baseline {100 * b['slo_attainment']:.1f}%; SJF-PT/SJF mean TTFT "
              f"{pt['mean_s'] / s['mean_s']:.2f}x, SJF-PT/SRPT {pt['mean_s'] / r['mean_s']:.2f}x, "
              f"SJF-PT/FIFO {pt['mean_s'] / f['mean_s']:.2f}x")
    print(f"\nwrote {out / 'calvo_sim.csv'}, {out / 'calvo_sim.png'} "
          f"in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
