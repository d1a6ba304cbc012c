"""The controller's profile file from Table 1, for prompts of no single workload.

Each point is one Table 1 pipeline scored by its *worst* domain (`jkv.compression.table_profile`):
accuracy = the minimum over the evaluation rows of the relative next-token accuracy against the true
text and of the relative task score's 95 % upper bound (`--quality acc_task`, default: the per-token
task metric decides — at the 8 samples a workload this box could score, the greedy task scores move
~0.05-0.1 when one continuation flips, enough to fail even int8 KV with KL 3e-4 — unless the task
score's whole interval lies below the floor), or of the relative next-token accuracy alone (`acc`),
the relative task score (`task`), either's 95 % bootstrap lower bound (`task_lo`, `acc_lo`), or the
top-1 agreement (`top1`); cr = the minimum fp16 CR, throughput = the slowest codec MB/s. The default table is the disjoint-split one (`experiments/kvserve_table1_split.py`:
searched on calibration samples, scored on evaluation samples of code / qa / continuation and on
held-out licence prose), so q_min 0.97 lets the controller choose only what kept >= 0.97 of the
uncompressed quality on text the search never saw.

    python experiments/table1_profile.py     # -> experiments/results/kvserve_profile_table1_split.json
    python experiments/table1_profile.py --table experiments/results/kvserve_table1.csv \
        --out experiments/results/kvserve_profile_table1_min.json   # the earlier, same-sample file

Used by `experiments/smartgen_ttst.py --compression auto` (its prompts are prose of the eval corpus).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import RESULTS  # noqa: E402

SAMPLE_TOKENS = 512  # Table 1's prompt length: the probe each codec throughput was measured on
SMOLLM2_KV_FP16_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads, head dim 64, fp16


def main(argv=None) -> int:
    from jkv.compression.profiling import save_profile
    from jkv.compression.table_profile import table_profile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=os.path.join(RESULTS, "kvserve_table1_split.csv"))
    p.add_argument("--out", default=os.path.join(RESULTS, "kvserve_profile_table1_split.json"))
    p.add_argument("--quality", choices=("task", "task_lo", "acc", "acc_lo", "acc_task", "top1"), default="acc_task",
                   help="the profile's accuracy: min relative task score or relative next-token accuracy "
                        "against the true text (point estimate, or _lo: 95%% bootstrap lower bound), acc_task: "
                        "min of the next-token one and the task score's 95%% upper bound, or min top-1 "
                        "agreement (default acc_task: docs/compression.md 'Table 1 on a disjoint split')")
    args = p.parse_args(argv)
    profile = table_profile(args.table, SAMPLE_TOKENS * SMOLLM2_KV_FP16_PER_TOKEN, args.quality)
    save_profile(args.out, profile)
    for pt in profile.points:
        print(f"{pt.spec_id:<55} cr {pt.cr:5.2f}  min {args.quality} {pt.accuracy:.3f}  {pt.throughput_Bps / 1e6:.1f} MB/s")
    print(f"wrote {args.out} ({profile.search['accuracy']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
