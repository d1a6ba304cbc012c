"""A controller profile file from Table 1 (`kvserve_table1.csv`), for prompts of no single workload.

Each point is one Table 1 pipeline, scored by its *worst* workload: accuracy = the minimum over
code / qa / continuation of the relative task score (task score / uncompressed task score, the
profiles' own evaluation), cr = the minimum fp16 CR, throughput = the slowest codec MB/s. With
q_min 0.97 the controller can then only choose a pipeline that kept >= 0.97 of the uncompressed
task score on every workload (today: `hadamard+kivi4g128+zstdh3`, min 0.983). Rows whose spec
differs per workload (Table 1's "jkv-per-workload") are left out.

    python experiments/table1_profile.py     # -> experiments/results/kvserve_profile_table1_min.json

Used by `experiments/smartgen_ttst.py --compression auto` (its prompts are prose of the eval corpus).
"""
from __future__ import annotations

import argparse
import csv
import os
from collections import defaultdict

from experiments.common import RESULTS

SAMPLE_TOKENS = 512  # Table 1's prompt length: the probe each codec throughput was measured on
SMOLLM2_KV_FP16_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads, head dim 64, fp16


def table1_points(table_csv: str) -> list:
    from jkv.compression.profiling import ProfilePoint

    rows = defaultdict(list)
    with open(table_csv) as f:
        for r in csv.DictReader(f):
            spec = f"{r['streaming']}:{r['spec']}" if r["streaming"] else r["spec"]
            rows[spec].append(r)
    probe = SAMPLE_TOKENS * SMOLLM2_KV_FP16_PER_TOKEN
    points = []
    for spec, rs in sorted(rows.items()):
        if len({r["workload"] for r in rs}) < 3:  # scored on some workloads only: no worst case
            continue
        throughput = min(float(r["codec_MBps_fp16"]) for r in rs) * 1e6
        points.append(ProfilePoint(spec, min(float(r["rel_task_accuracy"]) for r in rs),
                                   min(float(r["cr_fp16"]) for r in rs), probe / throughput, throughput))
    return points


def main(argv=None) -> int:
    from jkv.compression.dropping import servable
    from jkv.compression.profiling import ProfileFile, save_profile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=os.path.join(RESULTS, "kvserve_table1.csv"))
    p.add_argument("--out", default=os.path.join(RESULTS, "kvserve_profile_table1_min.json"))
    args = p.parse_args(argv)
    points = [pt for pt in table1_points(args.table) if servable(pt.spec_id)]
    save_profile(args.out, ProfileFile("table1_min", 0.0, SAMPLE_TOKENS * SMOLLM2_KV_FP16_PER_TOKEN, tuple(points),
                                       {"source": os.path.basename(args.table),
                                        "accuracy": "min relative task score over code, qa, continuation"}))
    for pt in points:
        print(f"{pt.spec_id:<55} cr {pt.cr:5.2f}  min rel task score {pt.accuracy:.3f}  {pt.throughput_Bps / 1e6:.1f} MB/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
