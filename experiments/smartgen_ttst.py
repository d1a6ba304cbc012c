"""SmartGen TTST/TBT benchmark (SmartGen §5.2–5.4; DESIGN.md "Emulating the papers' testbed").

SmolLM2, one decode + two prefill worker processes on this machine. The harness measures the
batch's prefill time Tp, then paces each prefill worker so full transfer takes --ratio x Tp
(6.5, the paper's 48K-token case). Measured side by side on the same workers:

  modes     full, partial, +profile, +parallel, smartgen     -> Fig. 9 (CTL), Fig. 13 (factors)
  spec      smartgen with spec_ratio 0.05 / 0.10 / 0.20       -> Fig. 14
  strategy  +parallel with proactive profile / sequential / random / streaming / oracle at fixed
            proactive fractions (--strategy-fractions; no speculation, so the on-demand ratio
            reflects the proactive choice alone; fast link: it does not depend on timing) -> Fig. 15
  compression  (with --compression auto | <pipeline id>) full uncompressed (the pacing reference),
            full + compression, smartgen alone, smartgen + compression (KVServe x SmartGen,
            docs/compression.md) -> smartgen_ttst{_quick}_compression*.csv

    python experiments/smartgen_ttst.py --quick      # 4 x 512 tokens, 24 new tokens
    python experiments/smartgen_ttst.py              # 4 x 2048 tokens, 64 new tokens
    python experiments/smartgen_ttst.py --parts strategy   # one part only (its files only)
    python experiments/smartgen_ttst.py --compression auto # the compression part only

Writes experiments/results/smartgen_ttst{_quick}_*.csv and fig9/13/14/15 PNGs; prints the
ratios TTST(full)/TTST(smartgen), mean TBT smartgen/full over steps 11-64, partial vs smartgen
TBT over steps 2-10, and whether every mode generated the same tokens. The compression part prints
TTST(full)/TTST(run) and TBT 11-64 run/full for each of its runs, the controller's choice per path
and request with its profile quality, and the compressed runs' token agreement with the
uncompressed ones (lossy: they may differ) and with each other (the mode invariant: requests that
moved with the same pipeline must generate the same tokens in full and smartgen).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from jkv.disagg.harness import Harness, summarize
from models import DEFAULT_MODEL

from experiments.common import RESULTS, add_model_arg, machine_info, write_csv
MODES = ("full", "partial", "+profile", "+parallel", "smartgen")
SPEC_RATIOS = (0.05, 0.10, 0.20)
STRATEGIES = ("profile", "sequential", "random", "streaming", "oracle")
# the compression part: (run name, transfer mode, compressed)
COMPRESSION_RUNS = (("full", "full", False), ("full+comp", "full", True), ("smartgen", "smartgen", False),
                    ("smartgen+comp", "smartgen", True))
TABLE1_PROFILE = os.path.join(RESULTS, "kvserve_profile_table1_split.json")  # experiments/table1_profile.py: disjoint split


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


def link_bounds(runs, bw_bps: float, workers: int, max_tokens: int, full_key=("mode", "full"),
                smart_key=("mode", "smartgen")) -> dict:
    """What the paced link alone allows (every byte of the emulated link is booked in one token
    bucket per prefill worker; the requests split evenly over the workers):
      TTST(mode) >= (metadata + proactive + step-1 on-demand bytes) / link,
      TTST(full) ~= (metadata + all KV) / link, so the ratio is at most their quotient;
      smartgen's TBT >= its per-step on-demand bytes / link."""
    rate = workers * bw_bps / 8  # bytes/s over all workers
    full, smart = runs[full_key], runs[smart_key]

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
    add_model_arg(p, DEFAULT_MODEL)
    p.add_argument("--selector", default="infinigen")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--ratio", type=float, default=6.5)
    p.add_argument("--max-blocks", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="prefill worker processes")
    p.add_argument("--parts", default=None,
                   help="comma list of parts to run: modes (Figs. 9, 13), spec (Fig. 14), strategy (Fig. 15), "
                        "compression (needs --compression); a part's CSV/PNG files are written only when it runs "
                        "(default: modes,spec,strategy; compression alone when --compression is given)")
    p.add_argument("--compression", default="off",
                   help="off | auto | a pipeline id (docs/compression.md) for the compressed runs of the "
                        "compression part")
    p.add_argument("--compression-options", default=None,
                   help="JSON compression_options (profiles, workload, q_min, t_slo_s, min_sample_bytes); default "
                        f'for auto: {{"profiles": ["{os.path.relpath(TABLE1_PROFILE)}"], "q_min": 0.97}}')
    p.add_argument("--skip", default="", help="comma list of parts to skip (applied after --parts)")
    p.add_argument("--modes", default=",".join(MODES), help="modes of the 'modes' part (smoke runs)")
    p.add_argument("--lookahead", choices=("default", "on", "off"), default="default",
                   help="layer lookahead in every run (default: on in smartgen mode only)")
    p.add_argument("--strategy-fractions", default="0.1,0.25",
                   help="fixed proactive fractions of all blocks for the strategy sweep (Fig. 15)")
    p.add_argument("--spec-without-full", action="store_true",
                   help="spec part alone: skip the full-transfer reference run (tokens are compared among the "
                        "spec runs; Fig. 14 has no full line)")
    p.add_argument("--tp", type=float, default=None,
                   help="batch prefill time Tp in seconds to pace from (default: the minimum of --tp-runs warm "
                        "prefills); pass the Tp a first run printed to pace a second run the same way")
    p.add_argument("--tp-runs", type=int, default=3, help="warm prefills whose minimum is Tp")
    p.add_argument("--bandwidth-mbit", type=float, default=None,
                   help="pace each prefill worker to this many Mbit/s instead of ratio x Tp")
    p.add_argument("--save-runs", default=None,
                   help="pickle the 'modes' part's runs and pace to this file (first half of a split run)")
    p.add_argument("--merge-runs", default=None,
                   help="a --save-runs file: pace exactly as it did (same Tp and Mbit/s), run only the --modes it "
                        "lacks, and report all of them together (second half of a split run)")
    p.add_argument("--strategy-tokens", type=int, default=None, help="new tokens per strategy run (default 16/12)")
    args = p.parse_args(argv)
    prompt_len = args.prompt_len or (512 if args.quick else 2048)
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    tag = "smartgen_ttst_quick" if args.quick else "smartgen_ttst"
    os.makedirs(RESULTS, exist_ok=True)
    if args.parts is None:
        args.parts = "compression" if args.compression != "off" else "modes,spec,strategy"
    parts = set(filter(None, args.parts.split(","))) - set(filter(None, args.skip.split(",")))
    if "compression" in parts and args.compression == "off":
        raise SystemExit("--parts compression needs --compression auto | <pipeline id>")
    copts = compression_options(args)
    modes = tuple(m for m in args.modes.split(",") if m)
    saved = {}
    if args.merge_runs:
        import pickle
        with open(args.merge_runs, "rb") as f:
            saved = pickle.load(f)
        if (saved["requests"], saved["prompt_len"], saved["max_tokens"]) != (args.requests, prompt_len, max_tokens):
            raise SystemExit(f"--merge-runs {args.merge_runs}: saved with requests/prompt-len/max-tokens "
                             f"{saved['requests']}/{saved['prompt_len']}/{saved['max_tokens']}; pass the same")
        args.tp, args.bandwidth_mbit = saved["tp"], saved["bw"] / 1e6
        modes = tuple(m for m in MODES if m in set(modes) | {k[1] for k in saved["runs"]})
    if "modes" in parts and not {"full", "smartgen"} <= set(modes) and not args.save_runs:
        raise SystemExit("--modes must include full and smartgen (the ratios compare them)")
    common = {} if args.lookahead == "default" else dict(lookahead=args.lookahead == "on")
    fractions = [float(f) for f in args.strategy_fractions.split(",") if f]
    strategy_tokens = args.strategy_tokens or (12 if args.quick else 16)
    t_start = time.perf_counter()
    h = Harness(args.model, args.selector, args.workers, max_blocks=args.max_blocks)
    runs = dict(saved.get("runs", {}))
    tp = bw = None
    try:
        prompts = h.eval_prompts(args.requests, prompt_len)
        h.build_profile(prompt_len)
        if parts & {"modes", "spec", "compression"}:
            tp, bw = h.pace_link(prompts, args.ratio, tp_runs=args.tp_runs, tp=args.tp,
                                 bandwidth_bps=None if args.bandwidth_mbit is None else args.bandwidth_mbit * 1e6)
            args.tp_samples = list(saved.get("tp_samples", h.tp_samples))
            args.pace_load = saved.get("pace_load", os.getloadavg()[0])
        if "modes" in parts:
            for mode in modes:
                if ("mode", mode) in runs:  # from --merge-runs
                    continue
                t = time.perf_counter()
                kw = common if mode != "full" else {}
                runs[("mode", mode)] = h.run(mode, prompts, max_tokens, **kw)
                print(f"  {mode:<10} {time.perf_counter() - t:6.1f}s  (load {os.getloadavg()[0]:.1f})", flush=True)
        if args.save_runs and "modes" in parts:
            import pickle
            with open(args.save_runs, "wb") as f:
                pickle.dump(dict(tp=tp, bw=bw, tp_samples=args.tp_samples, pace_load=args.pace_load,
                                 requests=args.requests, prompt_len=prompt_len, max_tokens=max_tokens,
                                 runs={k: v for k, v in runs.items() if k[0] == "mode"}), f)
            print(f"saved the runs of {', '.join(modes)} to {args.save_runs}", flush=True)
        if "spec" in parts:
            for r in SPEC_RATIOS:
                runs[("spec", r)] = (runs[("mode", "smartgen")] if r == 0.10 and ("mode", "smartgen") in runs
                                     else h.run("smartgen", prompts, max_tokens, spec_ratio=r, **common))
                print(f"  spec {r:.2f} done", flush=True)
            if ("mode", "full") not in runs and not args.spec_without_full:
                runs[("mode", "full")] = h.run("full", prompts, max_tokens)
        if "compression" in parts:
            for name, mode, compressed in COMPRESSION_RUNS:
                t = time.perf_counter()
                comp = dict(compression=args.compression, compression_options=copts) if compressed else {}
                runs[("compression", name)] = h.run(mode, prompts, max_tokens, **comp, **(common if mode != "full" else {}))
                print(f"  {name:<13} {time.perf_counter() - t:6.1f}s  (load {os.getloadavg()[0]:.1f})", flush=True)
        if "strategy" in parts:
            # Fig. 15 compares strategies at one transfer budget: Kr is a fixed fraction of the blocks
            # (Eq. 2 clips to the dense layers or to all of the KV at these sizes). Without speculation
            # the on-demand ratio depends only on which blocks are local, not on timing, so these runs
            # use the fast link.
            h.build_oracle_profile(prompts)
            h.set_bandwidth(100e9)
            for frac in fractions:
                for s in STRATEGIES:
                    runs[("strategy", (frac, s))] = h.run("+parallel", prompts, strategy_tokens, strategy=s,
                                                          kr_fraction=frac, **common)
                    print(f"  strategy {s} at {frac:.0%} proactive done", flush=True)
    finally:
        h.close()

    # compressed runs are lossy: compared with the uncompressed ones and each other in write_compression
    token_runs = {k: v for k, v in runs.items() if k[0] != "strategy" and not str(k[1]).endswith("+comp")}
    ref = runs.get(("mode", "full")) or next(iter(token_runs.values()), None)
    same = all([o.token_ids for o in outs] == [o.token_ids for o in ref] for outs in token_runs.values())
    strategy_same = True
    if "strategy" in parts:  # same max_tokens within the sweep: every run against the first
        ref = next(v for k, v in runs.items() if k[0] == "strategy")
        strategy_same = all([o.token_ids for o in v] == [o.token_ids for o in ref]
                            for k, v in runs.items() if k[0] == "strategy")
        write_strategy(runs, tag, fractions)
    if "spec" in parts:
        write_spec(runs, tag)
    if "modes" in parts and {("mode", "full"), ("mode", "smartgen")} <= set(runs):
        write_modes(runs, modes, tag, max_tokens, tp, bw, same, args)
    if "compression" in parts:
        same = write_compression(runs, tag, max_tokens, tp, bw, args, copts) and same
    print(f"\nload average now {os.getloadavg()}")
    print(f"identical tokens in every run: {same and strategy_same}; total {time.perf_counter() - t_start:.0f}s")
    if not (same and strategy_same):  # the mode invariant: any difference is a bug, whatever the timings say
        print("ERROR: some runs generated different tokens from the others", file=sys.stderr)
        return 1
    return 0


def compression_options(args) -> dict:
    """--compression-options as a dict; "auto" without options uses Table 1's worst-workload profile."""
    import json
    if args.compression_options is not None:
        return json.loads(args.compression_options)
    return dict(profiles=[TABLE1_PROFILE], q_min=0.97) if args.compression == "auto" else {}


def token_agreement(a, b) -> list[dict]:
    """Per request: `jkv.eval.fidelity.generation_agreement` of run a's generated tokens with run b's
    (prefix = leading equal tokens, fraction = equal positions over the longer generation)."""
    from jkv.eval.fidelity import generation_agreement

    return [generation_agreement(ob.token_ids, oa.token_ids) for oa, ob in zip(a, b)]


def write_compression(runs, tag, max_tokens, tp, bw, args, options) -> bool:
    """The compression part's CSVs and printout. Returns the mode invariant: every request that moved
    with the same pipeline in full + compression and smartgen + compression generated the same tokens."""
    from jkv.compression.profiling import load_profile
    from jkv.compression.spec import UNCOMPRESSED

    r = {name: runs[("compression", name)] for name, _, _ in COMPRESSION_RUNS}
    hi = min(64, max_tokens)
    summary = {name: summarize(outs) for name, outs in r.items()}
    tbt_full = tbt_window(r["full"], 11, hi)
    quality = {UNCOMPRESSED.id: 1.0}
    for path in options.get("profiles", ()):
        quality.update({pt.spec_id: pt.accuracy for pt in load_profile(path).points})
    rows = [dict(run=name, **summary[name], ttst_full_over_run=summary["full"]["ttst"] / summary[name]["ttst"],
                 **{f"tbt_steps_11_{hi}": tbt_window(r[name], 11, hi),
                    f"tbt_11_{hi}_over_full": tbt_window(r[name], 11, hi) / tbt_full},
                 kr_mean=float(np.mean([o.metrics.extra["kr"] for o in r[name]])),
                 blocks_mean=float(np.mean([o.metrics.extra["blocks"] for o in r[name]]))) for name in r]
    write_csv(os.path.join(RESULTS, f"{tag}_compression.csv"), rows)
    reqs, same_choice_equal = [], True
    for run, ref in (("full+comp", "full"), ("smartgen+comp", "smartgen")):
        agree = token_agreement(r[run], r[ref])
        for o, a, other in zip(r[run], agree, r["smartgen+comp" if run == "full+comp" else "full+comp"]):
            x = o.metrics.extra
            paths = x.get("compression_paths", {})
            same_pipeline = x.get("compression") == other.metrics.extra.get("compression")
            if same_pipeline and o.token_ids != other.token_ids:
                same_choice_equal = False
            reqs.append(dict(run=run, request=o.request_id, push=paths.get("push", x.get("compression")),
                             on_demand=paths.get("on_demand"), metadata=paths.get("metadata"),
                             reason=x.get("compression_reason"), profile_quality=quality.get(x.get("compression")),
                             token_agreement_vs_uncompressed=a["fraction"], token_prefix_vs_uncompressed=a["prefix"],
                             same_pipeline_other_mode=same_pipeline,
                             same_tokens_other_mode=o.token_ids == other.token_ids,
                             encode_s=x.get("encode_s"), decode_s=x.get("decode_s"), kr=x["kr"], blocks=x["blocks"],
                             ttft=o.metrics.ttft, ttst=o.metrics.ttst))
    write_csv(os.path.join(RESULTS, f"{tag}_compression_requests.csv"), reqs)
    phases = {name: phase_table(outs) for name, outs in r.items()}
    write_csv(os.path.join(RESULTS, f"{tag}_compression_phases.csv"),
              [dict(run=name, steps=window, phase=k, mean_per_step=v) for name in r
               for window, table in phases[name].items() for k, v in table.items()],
              fields=["run", "steps", "phase", "mean_per_step"])
    bounds = link_bounds(runs, bw, args.workers, max_tokens, ("compression", "full"), ("compression", "smartgen+comp"))
    machine = machine_info()
    figures = dict(ttst_full_over_smartgen_comp=rows[3]["ttst_full_over_run"],
                   ttst_full_over_full_comp=rows[1]["ttst_full_over_run"],
                   ttst_full_over_smartgen=rows[2]["ttst_full_over_run"],
                   tbt_smartgen_comp_over_full_11_64=rows[3][f"tbt_11_{hi}_over_full"],
                   tbt_full_comp_over_full_11_64=rows[1][f"tbt_11_{hi}_over_full"],
                   tbt_smartgen_over_full_11_64=rows[2][f"tbt_11_{hi}_over_full"],
                   token_agreement_full_comp=float(np.mean([a["fraction"] for a in token_agreement(r["full+comp"], r["full"])])),
                   token_agreement_smartgen_comp=float(np.mean([a["fraction"] for a in token_agreement(r["smartgen+comp"], r["smartgen"])])),
                   min_profile_quality=min((q["profile_quality"] for q in reqs if q["profile_quality"] is not None),
                                           default=float("nan")),
                   same_pipeline_same_tokens=same_choice_equal, compression=args.compression,
                   cpu_model=machine["cpu_model"], cores=machine["cores"],
                   tp_s=tp, bandwidth_mbit=bw / 1e6, load_avg_at_pacing=args.pace_load,
                   load_avg_1min=os.getloadavg()[0], **bounds)
    write_csv(os.path.join(RESULTS, f"{tag}_compression_summary.csv"),
              [dict(figure=k, value=v) for k, v in figures.items()], fields=["figure", "value"])
    print(f"\ncompression part ({args.compression}): Tp={tp:.2f}s, paced {bw / 1e6:.2f} Mbit/s per prefill worker")
    print(f"{'run':<14} {'TTFT':>6} {'TTST':>7} {'full/run':>8} {'TBT11-' + str(hi):>9} {'x full':>6} {'Kr':>6} "
          f"{'proactive MB':>12} {'on-demand MB':>12} {'metadata MB':>11}")
    for row in rows:
        print(f"{row['run']:<14} {row['ttft']:6.2f} {row['ttst']:7.2f} {row['ttst_full_over_run']:8.2f} "
              f"{row[f'tbt_steps_11_{hi}'] * 1e3:7.1f}ms {row[f'tbt_11_{hi}_over_full']:6.2f} {row['kr_mean']:6.0f} "
              f"{row['bytes_proactive'] / 1e6:12.1f} {row['bytes_on_demand'] / 1e6:12.1f} {row['bytes_metadata'] / 1e6:11.1f}")
    for q in reqs:
        print(f"  {q['run']:<14} {q['request']:<12} push {q['push']} (quality {q['profile_quality']}, {q['reason']}), "
              f"on-demand {q['on_demand']}, metadata {q['metadata']}; tokens vs uncompressed "
              f"{q['token_agreement_vs_uncompressed']:.3f}; same tokens in the other mode {q['same_tokens_other_mode']}")
    print(f"smartgen+comp link bound: TTST >= {bounds['ttst_smartgen_link_s']:.1f}s, ratio <= "
          f"{bounds['ttst_ratio_link_bound']:.2f}x; on demand {bounds['smartgen_on_demand_MB_per_step_11_64']:.2f} MB "
          f"per step 11-{hi} -> TBT floor {bounds['tbt_ratio_link_floor']:.2f}x full's")
    for name in r:  # where step 1 (token 2) goes: the TTST stall after the first token
        step1 = phases[name].get("1-1", {})
        print(f"  step 1 of {name:<14} per request TTFT {' '.join(f'{o.metrics.ttft:.2f}' for o in r[name])} s, "
              f"TTST {' '.join(f'{o.metrics.ttst:.2f}' for o in r[name])} s; "
              + ", ".join(f"{k} {v:.3f}" if not k.endswith("_n") else f"{k} {v:.0f}" for k, v in step1.items()))
    print(f"mode invariant (same pipeline -> same tokens in full and smartgen): {same_choice_equal}")
    return same_choice_equal


def write_strategy(runs, tag, fractions):
    rows = [(frac, s, summarize(v)) for (kind, key), v in runs.items() if kind == "strategy" for frac, s in [key]]
    write_csv(os.path.join(RESULTS, f"{tag}_strategy.csv"),
              [dict(proactive_fraction=frac, strategy=s, on_demand_ratio=sm["on_demand_ratio"],
                    bytes_proactive=sm["bytes_proactive"], bytes_on_demand=sm["bytes_on_demand"])
               for frac, s, sm in rows],
              fields=["proactive_fraction", "strategy", "on_demand_ratio", "bytes_proactive", "bytes_on_demand"])
    for frac, s, sm in rows:
        print(f"on-demand ratio, proactive {s:<10} at {frac:.0%}: {sm['on_demand_ratio']:.3f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(fractions)
    for i, frac in enumerate(fractions):
        vals = [sm["on_demand_ratio"] for fr, s, sm in rows if fr == frac]
        ax.bar(np.arange(len(STRATEGIES)) + (i - (len(fractions) - 1) / 2) * width, vals, width,
               label=f"{frac:.0%} of blocks proactive")
    ax.set_xticks(np.arange(len(STRATEGIES)), STRATEGIES)
    ax.set_ylabel("on-demand ratio"), ax.set_title("Fig. 15: proactive strategy at a fixed budget (no speculation)")
    ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, f"{tag}_fig15_ondemand.png"), dpi=120)
    plt.close(fig)


def write_spec(runs, tag):
    rows = []
    for (kind, r), outs in runs.items():
        if kind == "spec":
            s = summarize(outs)
            rows.append(dict(spec_ratio=r, ttst=s["ttst"], mean_tbt=s["mean_tbt"],
                             tbt_steps_3_10=tbt_window(outs, 3, 10), tbt_steps_11_64=tbt_window(outs, 11, 64),
                             on_demand_ratio=s["on_demand_ratio"]))
            print(f"spec {r:.0%}: TTST {s['ttst']:.2f}s, mean TBT {s['mean_tbt'] * 1e3:.0f} ms, "
                  f"on-demand ratio {s['on_demand_ratio']:.3f}")
    write_csv(os.path.join(RESULTS, f"{tag}_spec.csv"), rows,
              fields=["spec_ratio", "ttst", "mean_tbt", "tbt_steps_3_10", "tbt_steps_11_64", "on_demand_ratio"])
    plot_spec(runs, tag)


def write_modes(runs, modes, tag, max_tokens, tp, bw, same, args):
    full, smart = runs[("mode", "full")], runs[("mode", "smartgen")]
    summary = {mode: summarize(runs[("mode", mode)]) for mode in modes}
    hi = min(64, max_tokens)
    figures = dict(
        ttst_full_over_smartgen=summary["full"]["ttst"] / summary["smartgen"]["ttst"],
        tbt_smartgen_over_full_11_64=tbt_window(smart, 11, hi) / tbt_window(full, 11, hi),
        tbt_smartgen_3_10=tbt_window(smart, 3, 10), tp_s=tp, bandwidth_mbit=bw / 1e6, identical_tokens=same,
        load_avg_1min=os.getloadavg()[0], tp_samples_s=" ".join(f"{t:.2f}" for t in args.tp_samples) or "given",
        load_avg_at_pacing=args.pace_load)
    if ("mode", "partial") in runs:
        figures["tbt_partial_3_10"] = tbt_window(runs[("mode", "partial")], 3, 10)
    figures.update(link_bounds(runs, bw, args.workers, max_tokens))

    keys = list(summary["full"])
    window_hi = f"tbt_steps_11_{hi}"
    write_csv(os.path.join(RESULTS, f"{tag}_modes.csv"),
              [dict(mode=mode, **summary[mode], tbt_steps_3_10=tbt_window(runs[("mode", mode)], 3, 10),
                    **{window_hi: tbt_window(runs[("mode", mode)], 11, hi)}) for mode in modes],
              fields=["mode"] + keys + ["tbt_steps_3_10", window_hi])
    ctl = []
    for (kind, name), outs in runs.items():
        if kind == "strategy":
            continue
        for o in outs:
            ratios = [None] + o.metrics.extra["step_on_demand_ratio"]
            ctl += [dict(run=f"{kind}:{name}", request=o.request_id, token=i + 1, ctl_s=c,
                         step_on_demand_ratio=ratios[i] if i < len(ratios) else None)
                    for i, c in enumerate(o.metrics.ctl)]
    write_csv(os.path.join(RESULTS, f"{tag}_ctl.csv"), ctl,
              fields=["run", "request", "token", "ctl_s", "step_on_demand_ratio"])
    write_csv(os.path.join(RESULTS, f"{tag}_summary.csv"),
              [dict(figure=k, value=v) for k, v in figures.items()], fields=["figure", "value"])
    write_csv(os.path.join(RESULTS, f"{tag}_phases.csv"),
              [dict(mode=mode, steps=window, phase=k, mean_per_step=v) for mode in modes
               for window, phases in phase_table(runs[("mode", mode)]).items() for k, v in phases.items()],
              fields=["mode", "steps", "phase", "mean_per_step"])
    plot(runs, summary, modes, tag)

    print(f"\nTp={tp:.2f}s (samples: {figures['tp_samples_s']}, load {args.pace_load:.1f}), paced "
          f"{bw / 1e6:.2f} Mbit/s per prefill worker ({figures['link_MBps']:.2f} MB/s for all), {args.requests} x "
          f"{len(full[0].prompt_token_ids)} tokens")
    print(f"{'mode':<10} {'TTFT':>6} {'TTST':>7} {'meanTBT ms':>10} {'on-demand':>9}")
    for mode in modes:
        s = summary[mode]
        print(f"{mode:<10} {s['ttft']:6.2f} {s['ttst']:7.2f} {s['mean_tbt'] * 1e3:10.1f} {s['on_demand_ratio']:9.3f}")
    print(f"TTST(full)/TTST(smartgen) = {figures['ttst_full_over_smartgen']:.2f}x")
    print(f"mean TBT smartgen/full over tokens 11-{hi} = {figures['tbt_smartgen_over_full_11_64']:.2f}")
    print(f"TBT over tokens 3-10: partial {figures.get('tbt_partial_3_10', float('nan')) * 1e3:.1f} ms, smartgen "
          f"{figures['tbt_smartgen_3_10'] * 1e3:.1f} ms")
    print("\nper decode step, seconds (counters: on-demand MB, remote/selected entries, prefetched MB, hits):")
    for mode in modes:
        for window, ph in phase_table(runs[("mode", mode)]).items():
            t = {k: v for k, v in ph.items() if not k.endswith("_n")}
            print(f"  {mode:<10} steps {window:<6} total {sum(t.values()):6.2f}: " +
                  " ".join(f"{k} {v:.3f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:6]) +
                  f" | od {ph.get('od_bytes_n', 0) / 1e6:.2f} MB, remote/selected "
                  f"{ph.get('remote_n', 0) / max(ph.get('selected_n', 1), 1):.3f}, prefetched "
                  f"{ph.get('prefetch_bytes_n', 0) / 1e6:.2f} MB, hits {ph.get('prefetch_hit_n', 0):.0f}/"
                  f"{ph.get('remote_n', 0):.0f} remote | CPU s: decode process {ph.get('cpu_us_n', 0) / 1e6:.3f} "
                  f"(engine thread {ph.get('engine_cpu_us_n', 0) / 1e6:.3f}, hint thread "
                  f"{ph.get('hint_cpu_us_n', 0) / 1e6:.3f}), prefill processes {ph.get('probe_cpu_us_n', 0) / 1e6:.3f}")
    print(f"link bound: full TTST >= {figures['ttst_full_link_s']:.1f}s, smartgen TTST >= "
          f"{figures['ttst_smartgen_link_s']:.1f}s (metadata {figures['metadata_MB']:.1f} MB + proactive "
          f"{figures['smartgen_proactive_MB']:.1f} MB + step-1 on-demand {figures['smartgen_step1_on_demand_MB']:.1f} MB"
          f" at {figures['link_MBps']:.2f} MB/s): ratio <= {figures['ttst_ratio_link_bound']:.2f}x")
    print(f"link floor of smartgen TBT, steps 11-{hi}: {figures['smartgen_on_demand_MB_per_step_11_64']:.2f} MB "
          f"on demand per step -> >= {figures['tbt_smartgen_link_floor_s'] * 1e3:.0f} ms = "
          f"{figures['tbt_ratio_link_floor']:.2f}x full's TBT; one full-mode step moves "
          f"{figures['link_share_of_kv_per_full_step']:.2%} of the KV, so the rest needs "
          f"{figures['steps_to_move_rest_at_full_tbt']:.0f} such steps")


def plot(runs, summary, modes, tag):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_ctl(outs):
        n = min(len(o.metrics.ctl) for o in outs)
        return np.mean([o.metrics.ctl[:n] for o in outs], axis=0)

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        c = mean_ctl(runs[("mode", mode)])
        ax.plot(np.arange(1, len(c) + 1), c, label=mode)
    ax.set_xlabel("token"), ax.set_ylabel("cumulative latency (s)"), ax.set_title("Fig. 9: CTL per mode")
    ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, f"{tag}_fig9_ctl.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(modes, [summary[m]["ttst"] for m in modes]), axes[0].set_ylabel("TTST (s)")
    axes[1].bar(modes, [summary[m]["mean_tbt"] * 1e3 for m in modes]), axes[1].set_ylabel("mean TBT (ms)")
    for a in axes:
        a.tick_params(axis="x", rotation=30)
    fig.suptitle("Fig. 13: factor analysis"), fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{tag}_fig13_factors.png"), dpi=120)
    plt.close(fig)


def plot_spec(runs, tag):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [(k[1], v) for k, v in runs.items() if k[0] == "spec"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, outs in spec:
        n = min(len(o.metrics.tbt) for o in outs)
        ax.plot(np.arange(3, n + 2), np.mean([o.metrics.tbt[1:n] for o in outs], axis=0) * 1e3,
                label=f"spec {r:.0%}")
    full = runs.get(("mode", "full"))
    if full is not None:
        n = min(len(o.metrics.tbt) for o in full)
        ax.plot(np.arange(3, n + 2), np.mean([o.metrics.tbt[1:n] for o in full], axis=0) * 1e3, "k--",
                label="full")
    ax.set_xlabel("token"), ax.set_ylabel("TBT (ms)"), ax.set_yscale("log"), ax.set_title("Fig. 14: speculative ratio")
    ax.legend(), fig.tight_layout(), fig.savefig(os.path.join(RESULTS, f"{tag}_fig14_spec.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
