"""The controller's profile file from a Table 1 CSV: each pipeline at its worst domain.

A prompt in serving belongs to no single workload, so a profile point is one pipeline scored by
the *minimum* over the CSV's domains: accuracy = the lowest relative task score (`quality="task"`),
the lowest lower bound of its 95 % bootstrap interval (`"task_lo"`: what the evaluation samples
guarantee, not what they happened to read), the lowest relative next-token accuracy against the
true text (`"acc"`, its lower bound `"acc_lo"`: the per-token task metric, for task scores too
coarse or too noisy at the sizes measured), the lower of that and the task score's upper bound
(`"acc_task"`: the per-token metric decides unless the task score's whole interval says the
pipeline lost task quality), or the lowest top-1 agreement with uncompressed decoding (`"top1"`), cr = the lowest fp16
CR, throughput = the slowest codec. With q_min 0.97 the controller (`policy.CompressionPolicy`)
can then only choose a pipeline that kept 0.97 of the uncompressed quality on every domain.

Only evaluation rows count (`split` 'eval' or 'heldout' in `experiments/kvserve_table1_split.py`'s
CSV, where the searches ran on a disjoint calibration split); a CSV without a `split` column
(the original `kvserve_table1.csv`, scored on the samples the search saw) is read as one split.
A pipeline missing from any domain has no worst case and is left out; so are ids the serving path
cannot move (`dropping.servable`). No threads.
"""
from __future__ import annotations

import csv
from collections import defaultdict

from jkv.compression.dropping import servable
from jkv.compression.profiling import ProfileFile, ProfilePoint

EVAL_SPLITS = ("eval", "heldout")
# quality -> the columns a row's quality is the minimum of
QUALITY_COLUMNS = {"task": ("rel_task_accuracy",), "task_lo": ("rel_task_lo",), "acc": ("rel_acc",),
                   "acc_lo": ("rel_acc_lo",), "acc_task": ("rel_acc", "rel_task_hi"), "top1": ("top1",)}


def read_rows(table_csv: str) -> list[dict]:
    """The CSV's evaluation rows (every row when it has no `split` column)."""
    with open(table_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r.get("split", "eval") in EVAL_SPLITS]


def table_points(rows: list[dict], probe_bytes: int, quality: str = "task") -> list[ProfilePoint]:
    """One ProfilePoint per servable pipeline scored on every domain of `rows`, at its worst.
    probe_bytes: the fp16 KV bytes of one sample (each codec MB/s was measured per sample)."""
    if quality not in QUALITY_COLUMNS:
        raise ValueError(f"{quality=} must be one of {sorted(QUALITY_COLUMNS)}")
    columns = QUALITY_COLUMNS[quality]
    if rows and any(c not in rows[0] for c in columns):
        raise ValueError(f"{quality=} reads the columns {columns}, which this table lacks: rerun "
                         "experiments/kvserve_table1_split.py (it writes the intervals) or use quality='task'")
    domains = {r["workload"] for r in rows}
    by_spec = defaultdict(list)
    for r in rows:
        by_spec[f"{r['streaming']}:{r['spec']}" if r["streaming"] else r["spec"]].append(r)
    points = []
    for spec, rs in sorted(by_spec.items()):
        if {r["workload"] for r in rs} != domains or not servable(spec):
            continue
        throughput = min(float(r["codec_MBps_fp16"]) for r in rs) * 1e6
        points.append(ProfilePoint(spec, min(float(r[c]) for r in rs for c in columns), min(float(r["cr_fp16"]) for r in rs),
                                   probe_bytes / throughput, throughput))
    return points


def table_profile(table_csv: str, probe_bytes: int, quality: str = "task", name: str = "table1_min") -> ProfileFile:
    """The profile file (`profiling.save_profile`) of `table_points` over the CSV's evaluation rows."""
    rows = read_rows(table_csv)
    if not rows:
        raise ValueError(f"{table_csv}: no evaluation rows (split 'eval' / 'heldout')")
    domains = sorted({r["workload"] for r in rows})
    return ProfileFile(name, 0.0, probe_bytes, tuple(table_points(rows, probe_bytes, quality)),
                       {"source": table_csv.rsplit("/", 1)[-1], "domains": domains,
                        "accuracy": f"min {' and '.join(QUALITY_COLUMNS[quality])} over {', '.join(domains)} (evaluation rows)",
                        "quality": quality})
