"""Layer-lookahead variants side by side: what the hint and the prefetch gate cost per decode step.

SmolLM2, one decode + two prefill worker processes, the link paced as in smartgen_ttst.py (or
--bandwidth-mbit). Runs smartgen with each lookahead variant, interleaved (--repeats rounds, so
a change in the machine's load hits every variant alike), plus full once, and prints per-step
means over tokens 11..max_tokens: TBT, process CPU (decode process, its engine and hint
threads, the prefill processes), phases, on-demand MB, synchronous fetch RPCs.

  select   the hint is the selector's own ordered select, prefetch gated every step (before)
  set      the hint is the selected set (linear-time partition, jkv/disagg/hint.py), gated
  margin   the set + 8 next-ranked rows, gated every step
  default  the set + 8 rows, gated only in a request's first step (TransferConfig defaults)

    python experiments/smartgen_lookahead_ab.py                 # 4 x 2048, 24 new tokens
    python experiments/smartgen_lookahead_ab.py --bandwidth-mbit 17.2 --repeats 2

Writes experiments/results/smartgen_lookahead_ab.csv.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from jkv.disagg.harness import Harness
from models import DEFAULT_MODEL

from experiments.common import RESULTS, add_model_arg, write_csv
VARIANTS = dict(select=dict(hint_margin=None, lookahead_gate="always"),
                set=dict(hint_margin=0, lookahead_gate="always"),
                margin=dict(hint_margin=8, lookahead_gate="always"),
                default=dict(hint_margin=8, lookahead_gate="first_step"))


def steady(outs, first: int, last: int) -> dict:
    """Per-step means of the phases/counters over decode steps first-1..last-1 (tokens first..last),
    plus the mean TBT over those tokens."""
    steps = outs[0].metrics.extra["step_phases"][first - 2:last - 1]
    keys = sorted({k for st in steps for k in st})
    out = {k: float(np.mean([st.get(k, 0) for st in steps])) for k in keys}
    out["tbt"] = float(np.mean([g for o in outs for i, g in enumerate(o.metrics.tbt, start=2) if first <= i <= last]))
    out["ttst"] = float(np.mean([o.metrics.ttst for o in outs]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(p, DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ratio", type=float, default=6.5)
    p.add_argument("--tp-runs", type=int, default=3)
    p.add_argument("--bandwidth-mbit", type=float, default=None, help="per prefill worker (default: ratio x Tp)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    h = Harness(args.model, "infinigen", 2, max_blocks=64)
    rows, ref, same = [], None, True
    try:
        prompts = h.eval_prompts(args.requests, args.prompt_len)
        h.build_profile(args.prompt_len)
        tp, bw = h.pace_link(prompts, args.ratio, tp_runs=args.tp_runs,
                             bandwidth_bps=None if args.bandwidth_mbit is None else args.bandwidth_mbit * 1e6)
        order = [("full", 0)] + [(v, r) for r in range(args.repeats) for v in variants]
        for name, rep in order:
            t = time.perf_counter()
            outs = (h.run("full", prompts, args.max_tokens) if name == "full"
                    else h.run("smartgen", prompts, args.max_tokens, **VARIANTS[name]))
            tokens = [o.token_ids for o in outs]
            ref = ref or tokens
            same &= tokens == ref
            s = steady(outs, 11, args.max_tokens)
            rows.append(dict(variant=name, repeat=rep, load=os.getloadavg()[0], **s))
            print(f"{name:8} #{rep} {time.perf_counter() - t:5.1f}s load {os.getloadavg()[0]:4.1f} TTST "
                  f"{s['ttst']:6.2f}s TBT {s['tbt'] * 1e3:5.0f} ms | CPU s/step: decode {s.get('cpu_us_n', 0) / 1e6:.3f} "
                  f"(engine {s.get('engine_cpu_us_n', 0) / 1e6:.3f}, hint {s.get('hint_cpu_us_n', 0) / 1e6:.3f}), "
                  f"prefill {s.get('probe_cpu_us_n', 0) / 1e6:.3f} | select {s.get('select', 0) * 1e3:.0f} ms, "
                  f"prefetch_wait {s.get('prefetch_wait', 0) * 1e3:.0f} ms | on-demand {s.get('od_bytes_n', 0) / 1e6:.2f} MB, "
                  f"sync fetches {s.get('fetches_n', 0):.1f}", flush=True)
    finally:
        h.close()
    os.makedirs(RESULTS, exist_ok=True)
    keys = sorted({k for r in rows for k in r} - {"variant", "repeat", "load"})
    write_csv(os.path.join(RESULTS, "smartgen_lookahead_ab.csv"),
              [dict({k: r.get(k, 0) for k in keys}, variant=r["variant"], repeat=r["repeat"],
                    load=f"{r['load']:.1f}", tp_s=f"{tp:.2f}", bandwidth_mbit=f"{bw / 1e6:.2f}")
               for r in rows], fields=["variant", "repeat", "load", "tp_s", "bandwidth_mbit"] + keys)
    print(f"Tp {tp:.2f}s, {bw / 1e6:.2f} Mbit/s per worker; identical tokens in every run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
