"""Where a workload's KV breaks under compression (SmolLM2-135M, real prefill KV): per-layer
sensitivity, the value of sink + recent tokens at high precision, and SnapKV-style token tiers.

Per workload (default code), `--samples` prompts of `--tokens` tokens, each measured as in Table 1
(`ModelObjective.measure`: top-1 agreement and KL of 16 teacher-forced steps vs the uncompressed
cache; CR against fp16 with every byte counted):

1. layer groups: Hadamard + KIVI-2 g128 on one group of 5 layers, the others unquantized
   (an explicit `mixed-` table), to rank the layers by the loss they carry;
2. sink + recent at high precision: every middle token at the lo pipeline, sinks + recent at the
   hi one (`tokens.TierConfig(hi_frac=0, lo_frac=1)`) vs the lo pipeline everywhere;
3. token tiers (SnapKV importance from the prompt's last 32 queries deciding bits and drops) at
   several budgets (`tiers`; `more`: 35-40 % kept; `long`: a few rows for longer prompts), and with a
   per-layer `mixed-` table that gives the `--sensitive` layers more bits;
4. optionally (`--task`) the task score of each row (edit similarity / needle exact) and its paired
   standard error (same samples with and without compression).

Writes experiments/results/kvserve_sensitivity_<workload>_<tokens>_<samples>.csv.
Usage: nice -n 19 python experiments/kvserve_sensitivity.py [--workload code] [--samples 8] [--tokens 512]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jkv.compression.spec import PipelineSpec  # noqa: E402
from jkv.compression.tokens import TierConfig  # noqa: E402
from jkv.compression.workloads import ModelObjective, workload_samples  # noqa: E402

from experiments.common import RESULTS, write_csv  # noqa: E402
LO2 = "hadamard+kivi2g128+zstdh3"
HI4 = "hadamard+kivi4g128+zstdh3"
HI3 = "hadamard+kivi3g128+zstdh3"


def layer_table(n_layers: int, n_heads: int, bits_of_layer) -> str:
    rows = ".".join("".join("f" if (b := bits_of_layer(layer)) == 16 else str(b) for _ in range(n_heads))
                    for layer in range(n_layers))
    return f"mixed-{rows}-g128"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="code")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--parts", default="layers,edges,tiers", help="comma list of layers, edges, tiers, more, long")
    ap.add_argument("--task", action="store_true", help="also the task score of every row")
    ap.add_argument("--sensitive", default="", help="comma list of layer indices the tier tables give more bits")
    args = ap.parse_args()
    from models import load_model

    t0 = time.perf_counter()
    model = load_model("smollm2-135m-instruct")
    obj = ModelObjective(model, workload_samples(model.tokenizer, args.workload, args.samples, args.tokens))
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    base_scores = np.asarray(obj.task_scores(None)) if args.task else None
    base = float(np.mean(base_scores)) if args.task else float("nan")
    print(f"[{time.perf_counter() - t0:5.0f}s] {args.workload}: {args.samples} x {args.tokens} tokens; "
          f"task score uncompressed {base:.3f}; load {os.getloadavg()[0]:.1f}", flush=True)
    runs: list[tuple[str, object]] = []
    parts = set(args.parts.split(","))
    if "layers" in parts:
        for g in range(0, L, 5):
            runs.append((f"layers {g}-{g + 4} at 2 bits",
                         PipelineSpec.parse(f"hadamard+{layer_table(L, H, lambda x, g=g: 2 if g <= x < g + 5 else 16)}+zstdh3")))
    if "edges" in parts:
        runs += [("all 2 bits", PipelineSpec.parse(LO2)),
                 ("sink16+recent64 at 4 bits, rest 2 bits", TierConfig(HI4, LO2, 0.0, 1.0)),
                 ("all 3 bits", PipelineSpec.parse(HI3)),
                 ("sink16+recent64 at 4 bits, rest 3 bits", TierConfig(HI4, HI3, 0.0, 1.0))]
    if "tiers" in parts:
        runs += [("snap keep 50% @4", TierConfig(HI4, None, 0.5, 0.0)),
                 ("snap keep 40% @4", TierConfig(HI4, None, 0.4, 0.0)),
                 ("snap 20% @4 + 40% @2", TierConfig(HI4, LO2, 0.2, 0.4)),
                 ("snap 10% @4 + 60% @2", TierConfig(HI4, LO2, 0.1, 0.6)),
                 ("snap 30% @4 + 30% @2", TierConfig(HI4, LO2, 0.3, 0.3)),
                 ("snap keep 60% @3", TierConfig(HI3, None, 0.6, 0.0))]
        if "long" in parts:
            runs = [("snap keep 40% @4", TierConfig(HI4, None, 0.4, 0.0)),
                    ("snap keep 30% @4", TierConfig(HI4, None, 0.3, 0.0)),
                    ("all 3 bits", PipelineSpec.parse(HI3))]
        if "more" in parts:
            runs = [r for r in runs if r[0] == "snap keep 40% @4"]
            runs += [("snap keep 35% @4", TierConfig(HI4, None, 0.35, 0.0)),
                     ("snap keep 30% @4 + 15% @2", TierConfig(HI4, LO2, 0.3, 0.15))]
        if args.sensitive:
            hot = {int(x) for x in args.sensitive.split(",")}
            hi = f"hadamard+{layer_table(L, H, lambda x: 8 if x in hot else 4)}+zstdh3"
            lo = f"hadamard+{layer_table(L, H, lambda x: 3 if x in hot else 2)}+zstdh3"
            hi3 = f"hadamard+{layer_table(L, H, lambda x: 4 if x in hot else 3)}+zstdh3"
            runs += [("snap 10% @4/8 + 50% @2/3 (sensitive layers)", TierConfig(hi, lo, 0.1, 0.5)),
                     ("snap keep 45% @3/4 (sensitive layers)", TierConfig(hi3, None, 0.45, 0.0))]
    rows = []
    for name, spec in runs:
        r = obj.measure(spec)
        scores = np.asarray(obj.task_scores(spec)) if args.task else None
        score = float(np.mean(scores)) if args.task else float("nan")
        se = float(np.std(scores - base_scores, ddof=1) / np.sqrt(len(scores)) / base) if args.task and base > 0 else float("nan")
        row = dict(workload=args.workload, tokens=args.tokens, samples=args.samples, name=name,
                   cr_fp16=round(r.cr, 3), top1=round(r.accuracy, 3), kl=round(r.kl, 4),
                   task_score=round(score, 3), rel_task=round(score / base, 3) if base > 0 else float("nan"),
                   rel_task_se=round(se, 3))
        rows.append(row)
        print(f"[{time.perf_counter() - t0:5.0f}s] " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    write_csv(RESULTS / f"kvserve_sensitivity_{args.workload}_{args.tokens}_{args.samples}.csv", rows)


if __name__ == "__main__":
    main()
