"""SmartGen TTST/TBT benchmark (SmartGen §5.2–5.4; DESIGN.md "Emulating the papers' testbed").

SmolLM2, one decode + two prefill worker processes on this machine. The harness measures the
batch's prefill time Tp, then paces each prefill worker so full transfer takes --ratio x Tp
(6.5, the paper's 48K-token case). Measured side by side on the same workers:

  modes     full, partial, +profile, +parallel, smartgen     -> Fig. 9 (CTL), Fig. 13 (factors)
  spec      smartgen with spec_ratio 0.05 / 0.10 / 0.20       -> Fig. 14
  strategy  +parallel with proactive profile / sequential / random / streaming / oracle
            (no speculation, so the on-demand ratio reflects the proactive choice) -> Fig. 15

    python experiments/smartgen_ttst.py --quick      # 4 x 512 tokens, 24 new tokens
    python experiments/smartgen_ttst.py              # 4 x 2048 tokens, 64 new tokens

Writes experiments/results/smartgen_ttst{_quick}_*.csv and fig9/13/14/15 PNGs; prints the
ratios TTST(full)/TTST(smartgen), mean TBT smartgen/full over steps 11-64, partial vs smartgen
TBT over steps 2-10, and whether every mode generated the same tokens.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import numpy as np

from jkv.disagg.harness import Harness, summarize
from models import DEFAULT_MODEL

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("full", "partial", "+profile", "+parallel", "smartgen")
SPEC_RATIOS = (0.05, 0.10, 0.20)
STRATEGIES = ("profile", "sequential", "random", "streaming", "oracle")


def tbt_window(outs, first: int, last: int) -> float:
    """Mean gap between token i-1 and token i for i in [first, last] (1-based token numbers;
    token 2's gap is the TTST stall), averaged over requests."""
    gaps = [g for o in outs for i, g in enumerate(o.metrics.tbt, start=2) if first <= i <= last]
    return float(np.mean(gaps)) if gaps else float("nan")


def phase_table(outs, windows=((1, 1), (2, 10), (11, 64))) -> dict:
    """Mean per-step phase seconds and counters of one run (DecodeWorker step_phases) per
    window of decode steps (step 1 produces token 2)."""
    steps = outs[0].metrics.extra["step_phases"]
    out = {}
    for lo, hi in windows:
        chunk = steps[lo - 1:hi]
        if chunk:
            keys = sorted({k for st in chunk for k in st})
            out[f"{lo}-{hi}"] = {k: float(np.mean([st.get(k, 0) for st in chunk])) for k in keys}
    return out


def link_bounds(runs, bw_bps: float, workers: int, max_tokens: int) -> dict:
    """What the paced link alone allows (every byte of the emulated link is booked in one token
    bucket per prefill worker; the requests split evenly over the workers):
      TTST(mode) >= (metadata + proactive + step-1 on-demand bytes) / link,
      TTST(full) ~= (metadata + all KV) / link, so the ratio is at most their quotient;
      smartgen's TBT >= its per-step on-demand bytes / link."""
    rate = workers * bw_bps / 8  # bytes/s over all workers
    full, smart = runs[("mode", "full")], runs[("mode", "smartgen")]

    def tot(outs, key):
        return sum(o.metrics.extra["bytes"][key] for o in outs)

    step1 = smart[0].metrics.extra["step_phases"][0].get("od_bytes_n", 0)
    kv_all = tot(full, "proactive")
    meta = tot(full, "metadata")
    ttst_full_link = (meta + kv_all) / rate
    ttst_smart_link = (tot(smart, "metadata") + tot(smart, "proactive") + step1) / rate
    later = [st.get("od_bytes_n", 0) for st in smart[0].metrics.extra["step_phases"][10:max_tokens]]
    tbt_full = tbt_window(full, 11, max_tokens)
    od_later = float(np.mean(later)) if later else 0.0
    return dict(link_MBps=rate / 1e6, kv_MB=kv_all / 1e6, metadata_MB=meta / 1e6,
                smartgen_proactive_MB=tot(smart, "proactive") / 1e6, smartgen_step1_on_demand_MB=step1 / 1e6,
                ttst_full_link_s=ttst_full_link, ttst_smartgen_link_s=ttst_smart_link,
                ttst_ratio_link_bound=ttst_full_link / ttst_smart_link,
                smartgen_on_demand_MB_per_step_11_64=od_later / 1e6,
                tbt_smartgen_link_floor_s=od_later / rate,
                tbt_ratio_link_floor=(od_later / rate) / tbt_full if tbt_full else float("nan"),
                link_share_of_kv_per_full_step=rate * tbt_full / kv_all if kv_all else float("nan"),
                steps_to_move_rest_at_full_tbt=(kv_all - tot(smart, "proactive") - step1) / rate / tbt_full
                if tbt_full else float("nan"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="SmartGen TTST/TBT benchmark")
    p.add_argument("--quick", action="store_true", help="4 x 512-token prompts, 24 new tokens")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--selector", default="infinigen")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--ratio", type=float, default=6.5)
    p.add_argument("--max-blocks", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="prefill worker processes")
    p.add_argument("--skip", default="", help="comma list of parts to skip: spec,strategy")
    args = p.parse_args(argv)
    prompt_len = args.prompt_len or (512 if args.quick else 2048)
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    tag = "smartgen_ttst_quick" if args.quick else "smartgen_ttst"
    os.makedirs(RESULTS, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.perf_counter()
    h = Harness(args.model, args.selector, args.workers, max_blocks=args.max_blocks)
    runs = {}
    try:
        prompts = h.eval_prompts(args.requests, prompt_len)
        h.build_profile(prompt_len)
        tp, bw = h.pace_link(prompts, args.ratio)
        for mode in MODES:
            t = time.perf_counter()
            runs[("mode", mode)] = h.run(mode, prompts, max_tokens)
            print(f"  {mode:<10} {time.perf_counter() - t:6.1f}s", flush=True)
        if "spec" not in skip:
            for r in SPEC_RATIOS:
                runs[("spec", r)] = (runs[("mode", "smartgen")] if r == 0.10
                                     else h.run("smartgen", prompts, max_tokens, spec_ratio=r))
                print(f"  spec {r:.2f} done", flush=True)
        if "strategy" not in skip:
            h.build_oracle_profile(prompts)
            for s in STRATEGIES:
                runs[("strategy", s)] = h.run("+parallel", prompts, max_tokens, strategy=s)
                print(f"  strategy {s} done", flush=True)
    finally:
        h.close()

    full, smart, partial = runs[("mode", "full")], runs[("mode", "smartgen")], runs[("mode", "partial")]
    same = all([o.token_ids for o in outs] == [o.token_ids for o in full] for outs in
               (v for k, v in runs.items()))
    summary = {mode: summarize(runs[("mode", mode)]) for mode in MODES}
    hi = min(64, max_tokens)
    figures = dict(
        ttst_full_over_smartgen=summary["full"]["ttst"] / summary["smartgen"]["ttst"],
        tbt_smartgen_over_full_11_64=tbt_window(smart, 11, hi) / tbt_window(full, 11, hi),
        tbt_partial_3_10=tbt_window(partial, 3, 10), tbt_smartgen_3_10=tbt_window(smart, 3, 10),
        tp_s=tp, bandwidth_mbit=bw / 1e6, identical_tokens=same)
    figures.update(link_bounds(runs, bw, args.workers, max_tokens))

    with open(os.path.join(RESULTS, f"{tag}_modes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        keys = list(summary["full"])
        w.writerow(["mode"] + keys + ["tbt_steps_3_10", f"tbt_steps_11_{hi}"])
        for mode in MODES:
            outs = runs[("mode", mode)]
            w.writerow([mode] + [summary[mode][k] for k in keys] + [tbt_window(outs, 3, 10), tbt_window(outs, 11, hi)])
    with open(os.path.join(RESULTS, f"{tag}_ctl.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "request", "token", "ctl_s", "step_on_demand_ratio"])
        for (kind, name), outs in runs.items():
            for o in outs:
                ratios = [None] + o.metrics.extra["step_on_demand_ratio"]
                for i, c in enumerate(o.metrics.ctl):
                    w.writerow([f"{kind}:{name}", o.request_id, i + 1, c, ratios[i] if i < len(ratios) else None])
    with open(os.path.join(RESULTS, f"{tag}_summary.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["figure", "value"])
        for k, v in figures.items():
            w.writerow([k, v])
        for (kind, name), outs in runs.items():
            if kind != "mode":
                s = summarize(outs)
                w.writerow([f"{kind}:{name}:ttst", s["ttst"]])
                w.writerow([f"{kind}:{name}:mean_tbt", s["mean_tbt"]])
                w.writerow([f"{kind}:{name}:on_demand_ratio", s["on_demand_ratio"]])
    with open(os.path.join(RESULTS, f"{tag}_phases.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "steps", "phase", "mean_per_step"])
        for mode in MODES:
            for window, phases in phase_table(runs[("mode", mode)]).items():
                for k, v in phases.items():
                    w.writerow([mode, window, k, v])
    plot(runs, summary, tag, max_tokens)

    print(f"\nTp={tp:.2f}s, paced {bw / 1e6:.1f} Mbit/s per prefill worker, {args.requests} x {prompt_len} tokens")
    print(f"{'mode':<10} {'TTFT':>6} {'TTST':>7} {'meanTBT ms':>10} {'on-demand':>9}")
    for mode in MODES:
        s = summary[mode]
        print(f"{mode:<10} {s['ttft']:6.2f} {s['ttst']:7.2f} {s['mean_tbt'] * 1e3:10.1f} {s['on_demand_ratio']:9.3f}")
    print(f"TTST(full)/TTST(smartgen) = {figures['ttst_full_over_smartgen']:.2f}x")
    print(f"mean TBT smartgen/full over tokens 11-{hi} = {figures['tbt_smartgen_over_full_11_64']:.2f}")
    print(f"TBT over tokens 3-10: partial {figures['tbt_partial_3_10'] * 1e3:.1f} ms, smartgen "
          f"{figures['tbt_smartgen_3_10'] * 1e3:.1f} ms")
    print("\nper decode step, seconds (counters: on-demand MB, remote/selected entries):")
    for mode in MODES:
        for window, ph in phase_table(runs[("mode", mode)]).items():
            t = {k: v for k, v in ph.items() if not k.endswith("_n")}
            print(f"  {mode:<10} steps {window:<6} total {sum(t.values()):6.2f}: " +
                  " ".join(f"{k} {v:.3f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:5]) +
                  f" | od {ph.get('od_bytes_n', 0) / 1e6:.2f} MB, remote/selected "
                  f"{ph.get('remote_n', 0) / max(ph.get('selected_n', 1), 1):.3f}")
    print(f"link bound: full TTST >= {figures['ttst_full_link_s']:.1f}s, smartgen TTST >= "
          f"{figures['ttst_smartgen_link_s']:.1f}s (metadata {figures['metadata_MB']:.1f} MB + proactive "
          f"{figures['smartgen_proactive_MB']:.1f} MB + step-1 on-demand {figures['smartgen_step1_on_demand_MB']:.1f} MB"
          f" at {figures['link_MBps']:.2f} MB/s): ratio <= {figures['ttst_ratio_link_bound']:.2f}x")
    print(f"link floor of smartgen TBT, steps 11-{hi}: {figures['smartgen_on_demand_MB_per_step_11_64']:.2f} MB "
          f"on demand per step -> >= {figures['tbt_smartgen_link_floor_s'] * 1e3:.0f} ms = "
          f"{figures['tbt_ratio_link_floor']:.2f}x full's TBT; one full-mode step moves "
          f"{figures['link_share_of_kv_per_full_step']:.2%} of the KV, so the rest needs "
          f"{figures['steps_to_move_rest_at_full_tbt']:.0f} such steps")
    for (kind, name), outs in runs.items():
        if kind == "strategy":
            print(f"on-demand ratio, proactive {name:<10}: {summarize(outs)['on_demand_ratio']:.3f}")
    print(f"identical tokens in every run: {same}; total {time.perf_counter() - t_start:.0f}s")
    if not same:  # the mode invariant: any difference is a bug, whatever the timings say
        bad = [f"{k[0]}:{k[1]}" for k, v in runs.items() if [o.token_ids for o in v] != [o.token_ids for o in full]]
        print(f"ERROR: runs {bad} generated different tokens from full", file=sys.stderr)
        return 1
    return 0


def plot(runs, summary, tag, max_tokens):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_ctl(outs):
        n = min(len(o.metrics.ctl) for o in outs)
        return np.mean([o.metrics.ctl[:n] for o in outs], axis=0)

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        c = mean_ctl(runs[("mode", mode)])
        ax.plot(np.arange(1, len(c) + 1), c, label=mode)
    ax.set_xlabel("token"), ax.set_ylabel("cumulative latency (s)"), ax.set_title("Fig. 9: CTL per mode")
    ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, f"{tag}_fig9_ctl.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(MODES, [summary[m]["ttst"] for m in MODES]), axes[0].set_ylabel("TTST (s)")
    axes[1].bar(MODES, [summary[m]["mean_tbt"] * 1e3 for m in MODES]), axes[1].set_ylabel("mean TBT (ms)")
    for a in axes:
        a.tick_params(axis="x", rotation=30)
    fig.suptitle("Fig. 13: factor analysis"), fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{tag}_fig13_factors.png"), dpi=120)
    plt.close(fig)

    spec = [(k[1], v) for k, v in runs.items() if k[0] == "spec"]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r, outs in spec:
            n = min(len(o.metrics.tbt) for o in outs)
            ax.plot(np.arange(3, n + 2), np.mean([o.metrics.tbt[1:n] for o in outs], axis=0) * 1e3,
                    label=f"spec {r:.0%}")
        full = runs[("mode", "full")]
        n = min(len(o.metrics.tbt) for o in full)
        ax.plot(np.arange(3, n + 2), np.mean([o.metrics.tbt[1:n] for o in full], axis=0) * 1e3, "k--", label="full")
        ax.set_xlabel("token"), ax.set_ylabel("TBT (ms)"), ax.set_title("Fig. 14: speculative ratio")
        ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, f"{tag}_fig14_spec.png"), dpi=120)
        plt.close(fig)

    strat = [(k[1], v) for k, v in runs.items() if k[0] == "strategy"]
    if strat:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([s for s, _ in strat], [summarize(v)["on_demand_ratio"] for _, v in strat])
        ax.set_ylabel("on-demand ratio"), ax.set_title("Fig. 15: proactive strategy (no speculation)")
        fig.tight_layout(), fig.savefig(os.path.join(RESULTS, f"{tag}_fig15_ondemand.png"), dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
