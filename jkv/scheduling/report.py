"""experiments/calvo.py's bookkeeping: per-seed rows -> summary over seeds (paired per seed),
CSV round trip, the figure (paper Figs. 7, 8, 10) and the goals' report. No model, no timing.

Rows: one per (scenario, load, seed, policy, link) run, as calvo.py writes them to calvo.csv.
Several held runs merge with `merge_rows` (a new row replaces an old one of the same run).
"""
from __future__ import annotations

import csv
import functools
import pathlib

import numpy as np

from jkv.eval.csvfile import write_csv
from jkv.scheduling.capacity import (MAX_UTILISATION, highest_load_within,
                                     pooled_throughput_ratio, pooled_utilisation)

POLICIES = ("serialized-fifo", "fifo", "sjf-pt", "sjf", "srpt", "edf", "lstf")
# The same policies ordered by the paper's plain cost lines (A/B for the bucketed compute part).
PLAIN_POLICIES = ("sjf-plain", "lstf-plain")
SCENARIOS = {"full-hit": (1.0,), "mixed-hit": (0.75, 0.875, 1.0)}


SUMMARY_METRICS = ("mean_s", "p50_s", "p99_s", "slo_attainment")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """old rows (e.g. an earlier held run's calvo.csv) plus new ones; a new row replaces an old
    one of the same (scenario, load, seed, policy, link)."""
    ident = lambda r: (r["scenario"], float(r["load"]), int(r["seed"]), r["policy"], r["link"])
    fresh = {ident(r) for r in new}
    return [r for r in old if ident(r) not in fresh] + list(new)


def read_csv(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_rows(path: pathlib.Path) -> list[dict]:
    rows = read_csv(path)
    for r in rows:
        for k in ("load", "qps", "fit_median_error", "loadavg", "capacity_measured_qps",
                  "capacity_modelled_qps", "baseline_throughput_ratio",
                  "baseline_ttft_trend", "model_scale", "baseline_utilisation",
                  "baseline_mg1_ttft_s") + SUMMARY_METRICS:
            if r.get(k, "") != "":
                r[k] = float(r[k])
        for k in ("seed", "count", "token_mismatches", "demoted", "demoted_met_slo",
                  "baseline_completed", "baseline_arrived"):
            if r.get(k, "") != "":
                r[k] = int(r[k])
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (scenario, link, load, policy): mean, std (ddof 0), min and max over seeds of
    each metric, plus the per-seed paired comparisons the goals are stated in (each seed's
    policy against the same seed's baseline / SJF / EDF, then mean and std over seeds):
    `vs_baseline_pct` (mean TTFT change vs serialized-fifo, %), `vs_sjf_x` (mean TTFT / SJF's),
    `vs_srpt_x` (mean TTFT / SRPT's: SJF on the remaining modelled cost),
    `slo_vs_baseline_pts`, `slo_vs_edf_pts` (SLO attainment difference, points)."""
    by_point: dict = {}
    for r in rows:
        by_point.setdefault((r["scenario"], r["link"], float(r["load"])), []).append(r)
    out = []
    for (scenario, link, load), point in sorted(by_point.items()):
        per_seed = {}
        for r in point:
            per_seed.setdefault(int(r["seed"]), {})[r["policy"]] = r
        policies = list(dict.fromkeys(r["policy"] for r in point))
        for policy in policies:
            mine = [(seed, runs[policy]) for seed, runs in sorted(per_seed.items())
                    if policy in runs]
            row = dict(scenario=scenario, link=link, load=load, policy=policy,
                       seeds=len(mine), qps=float(np.mean([r["qps"] for _, r in mine])))
            for metric in SUMMARY_METRICS:
                vals = np.array([r[metric] for _, r in mine], dtype=np.float64)
                row.update({f"{metric}_mean": vals.mean(), f"{metric}_std": vals.std(),
                            f"{metric}_min": vals.min(), f"{metric}_max": vals.max()})
            paired = {"vs_baseline_pct": ("serialized-fifo", lambda x, y: 100 * (
                          x["mean_s"] / y["mean_s"] - 1)),
                      "vs_sjf_x": ("sjf", lambda x, y: x["mean_s"] / y["mean_s"]),
                      "vs_srpt_x": ("srpt", lambda x, y: x["mean_s"] / y["mean_s"]),
                      "slo_vs_baseline_pts": ("serialized-fifo", lambda x, y: 100 * (
                          x["slo_attainment"] - y["slo_attainment"])),
                      "slo_vs_edf_pts": ("edf", lambda x, y: 100 * (
                          x["slo_attainment"] - y["slo_attainment"]))}
            # the baseline kept up (capacity.py): pooled over seeds
            row["baseline_throughput_pooled"] = pooled_throughput_ratio([r for _, r in mine])
            row["baseline_utilisation_pooled"] = pooled_utilisation([r for _, r in mine])
            for k in ("baseline_ttft_trend", "capacity_measured_qps", "baseline_mg1_ttft_s"):
                vals = [r[k] for _, r in mine if r.get(k, "") != ""]
                row[f"{k}_mean"] = float(np.mean(vals)) if vals else None
            counts = [(r.get("demoted"), r.get("demoted_met_slo")) for _, r in mine
                      if r.get("demoted", "") != ""]
            row["demoted_total"] = sum(c[0] for c in counts) if counts else None
            row["demoted_met_slo_total"] = sum(c[1] for c in counts) if counts else None
            for name, (ref, fn) in paired.items():
                vals = np.array([fn(r, per_seed[seed][ref]) for seed, r in mine
                                 if ref in per_seed[seed]], dtype=np.float64)
                row[f"{name}_mean"] = vals.mean() if vals.size else float("nan")
                row[f"{name}_std"] = vals.std() if vals.size else float("nan")
            out.append(row)
    return out


def plot(summary: list[dict], path: pathlib.Path) -> None:
    """Figs. 7 (mean TTFT vs load), 8 (SLO attainment vs load) per scenario, and Fig. 10 (mixed
    hits: SJF-PT vs SJF / SRPT mean TTFT, EDF vs LSTF SLO attainment); error bars: std over seeds.
    x is the offered load (fraction of the baseline's capacity, measured per seed), not QPS:
    QPS differs per seed and run with the measured capacity, so its mean is no common axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({r["scenario"] for r in summary}, key=list(SCENARIOS).index)
    fig, axes = plt.subplots(3, len(scenarios), figsize=(6 * len(scenarios), 12), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]   # one colour per policy
    for col, scenario in enumerate(scenarios):
        mine = [r for r in summary if r["scenario"] == scenario]
        for policy in POLICIES + PLAIN_POLICIES:
            pts = sorted((r["load"], r["mean_s_mean"], r["mean_s_std"],
                          r["slo_attainment_mean"], r["slo_attainment_std"])
                         for r in mine if r["policy"] == policy)
            if not pts:
                continue
            load, mean, mean_sd, slo, slo_sd = map(np.array, zip(*pts))
            style = "--" if policy == "serialized-fifo" else ":" if "plain" in policy else "-"
            color = colors[(POLICIES + PLAIN_POLICIES).index(policy) % len(colors)]
            axes[0][col].errorbar(load, mean, yerr=mean_sd, fmt=style, marker="o", capsize=3,
                                  label=policy, color=color)
            axes[1][col].errorbar(load, 100 * slo, yerr=100 * slo_sd, fmt=style, marker="o",
                                  capsize=3, label=policy, color=color)
        seeds = max((r["seeds"] for r in mine), default=0)
        xlabel = "offered load (x the baseline's capacity)"
        axes[0][col].set(title=f"{scenario}: mean TTFT (Fig. 7), mean ± std of {seeds} seeds",
                         xlabel=xlabel, ylabel="mean TTFT (s)", yscale="log")
        axes[1][col].set(title=f"{scenario}: SLO attainment (Fig. 8)", xlabel=xlabel,
                         ylabel="SLO attainment (%)", ylim=(0, 102))
        axes[0][col].legend(fontsize=8)
        # Fig. 10: at each load, SJF-PT / FIFO / SJF mean TTFT and EDF / LSTF SLO attainment.
        ax = axes[2][col]
        loads = sorted({r["load"] for r in mine})
        bars = [("serialized-fifo", "mean_s", "baseline TTFT"), ("fifo", "mean_s", "FIFO TTFT"),
                ("sjf-pt", "mean_s", "SJF-PT TTFT"), ("sjf", "mean_s", "SJF TTFT"),
                ("srpt", "mean_s", "SRPT TTFT")]
        width = 0.8 / len(bars)
        for i, (policy, metric, label) in enumerate(bars):
            vals = [next((r for r in mine if r["load"] == load and r["policy"] == policy), None)
                    for load in loads]
            x = np.arange(len(loads)) + i * width
            ax.bar(x, [v[f"{metric}_mean"] if v else 0 for v in vals], width,
                   yerr=[v[f"{metric}_std"] if v else 0 for v in vals], capsize=3, label=label)
        ax.set(xticks=np.arange(len(loads)) + 0.4 - width / 2,
               xticklabels=[f"load {load}" for load in loads], ylabel="mean TTFT (s)",
               title=f"{scenario}: Fig. 10 (bars: TTFT; dots: SLO EDF vs LSTF)")
        ax.legend(fontsize=8, loc="upper left")
        twin = ax.twinx()
        for policy, marker in (("edf", "s"), ("lstf", "D")):
            vals = [next((r for r in mine if r["load"] == load and r["policy"] == policy), None)
                    for load in loads]
            x = [i + 0.4 - width / 2 for i, v in enumerate(vals) if v]
            twin.errorbar(x, [100 * v["slo_attainment_mean"] for v in vals if v],
                          yerr=[100 * v["slo_attainment_std"] for v in vals if v], fmt=marker,
                          color="k" if policy == "edf" else "r", capsize=3,
                          label=f"{policy.upper()} SLO")
        twin.set(ylabel="SLO attainment (%)", ylim=(0, 102))
        twin.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write_outputs(rows: list[dict], out: pathlib.Path) -> list[dict]:
    """calvo.csv (one row per scenario, load, seed, policy), calvo_summary.csv (over seeds) and
    calvo.png; returns the summary rows."""
    write_csv(out / "calvo.csv", rows)
    summary = aggregate(rows)
    write_csv(out / "calvo_summary.csv", summary)
    plot(summary, out / "calvo.png")
    return summary


def report(summary: list[dict]) -> None:
    """The goals' figures (mean ± std over seeds, paired per seed) at every swept load."""
    def get(scenario, load, policy):
        return next((r for r in summary if r["scenario"] == scenario and r["load"] == load
                     and r["policy"] == policy), None)

    pm = lambda r, k, fmt="{:.1f}": (f"{fmt.format(r[k + '_mean'])} ± "
                                     f"{fmt.format(r[k + '_std'])}") if r else "n/a"
    print("\n== goals per point: mean ± std over seeds (paired per seed) ==")
    for scenario, link, load in sorted({(r["scenario"], r["link"], r["load"]) for r in summary}):
        b, s = get(scenario, load, "serialized-fifo"), get(scenario, load, "sjf")
        e, l = get(scenario, load, "edf"), get(scenario, load, "lstf")
        pt, f = get(scenario, load, "sjf-pt"), get(scenario, load, "fifo")
        seeds = b["seeds"] if b else 0
        print(f"{scenario} @ load {load} ({link}, {seeds} seeds, {b['qps'] if b else 0:.2f} QPS): "
              f"SJF vs baseline {pm(s, 'vs_baseline_pct')}% (mean TTFT {pm(s, 'mean_s', '{:.3f}')}"
              f" s vs {pm(b, 'mean_s', '{:.3f}')} s); pipelined FIFO {pm(f, 'vs_baseline_pct')}%"
              f"; SJF-PT / SJF {pm(pt, 'vs_sjf_x', '{:.2f}')}x; SJF-PT / SRPT "
              f"{pm(pt, 'vs_srpt_x', '{:.2f}')}x; SLO LSTF "
              f"{pm(l, 'slo_attainment', '{:.3f}')} EDF {pm(e, 'slo_attainment', '{:.3f}')} "
              f"baseline {pm(b, 'slo_attainment', '{:.3f}')}; LSTF - EDF "
              f"{pm(l, 'slo_vs_edf_pts')} pts; LSTF - baseline {pm(l, 'slo_vs_baseline_pts')} pts"
              + (f"; LSTF demoted {l['demoted_total']} requests as hopeless over the seeds, "
                 f"{l['demoted_met_slo_total']} of them met their SLO anyway"
                 if l and l.get("demoted_total") is not None else "")
              + (f"; baseline completes {b['baseline_throughput_pooled']:.2f} x the arrivals "
                 f"(pooled over seeds; TTFT trend {b['baseline_ttft_trend_mean']:.2f}x)"
                 if b and b.get("baseline_throughput_pooled") not in (None, "") else "")
              + (f"; baseline in-run utilisation {b['baseline_utilisation_pooled']:.3f} "
                 f"(pooled), mean TTFT / M/G/1 steady state "
                 f"{b['mean_s_mean'] / b['baseline_mg1_ttft_s_mean']:.2f}"
                 if b and b.get("baseline_utilisation_pooled") not in (None, "")
                 and b.get("baseline_mg1_ttft_s_mean") not in (None, "") else ""))
    for scenario in sorted({r["scenario"] for r in summary}):
        print(f"{scenario}: highest swept load the baseline sustains (in-run utilisation <= "
              f"{MAX_UTILISATION}, pooled over seeds): "
              f"{sustained_load(summary, scenario)}")


def sustained_load(summary: list[dict], scenario: str) -> float | None:
    """The highest load of `scenario` whose baseline summary row's pooled in-run utilisation
    is <= MAX_UTILISATION (capacity.py); None when no swept load qualifies. The same rule as
    `capacity.highest_sustained_load` over the per-seed rows, read from the pooled column."""
    pooled = {r["load"]: r.get("baseline_utilisation_pooled") for r in summary
              if r["scenario"] == scenario and r["policy"] == "serialized-fifo"}
    return highest_load_within({load: None if rho in (None, "") else float(rho)
                                for load, rho in pooled.items()})


def _summary_row(summary, point, policy):
    return next((r for r in summary if (r["scenario"], r["load"]) == point and r["policy"] == policy), None)


def _mean_std(r, key, fmt="{:.2f}", unit=""):
    if r is None or r.get(f"{key}_mean") in (None, ""):
        return "n/a"
    return f"{fmt.format(r[key + '_mean'])} ± {fmt.format(r[key + '_std'])}{unit}"


def markdown_tables(summary: list[dict], rows: list[dict]) -> str:
    """docs/calvo.md's result tables: per point (mean ± std over seeds), the goals' paired
    comparisons with the baseline's sustain check, and one line per seed."""
    points = sorted({(r["scenario"], r["load"]) for r in summary},
                    key=lambda p: (list(SCENARIOS).index(p[0]), p[1]))
    out = _point_table(summary, rows, points) + _goals_table(summary, points) + _seed_table(rows)
    return "\n".join(out) + "\n"


def _point_table(summary, rows, points) -> list[str]:
    get, pm = functools.partial(_summary_row, summary), _mean_std
    names = ("serialized-fifo", "fifo", "sjf-pt", "sjf", "srpt", "edf", "lstf")
    heads = ("baseline", "pipelined FIFO", "SJF-PT", "SJF", "SRPT", "EDF", "LSTF")
    out = ["Mean TTFT and SLO attainment (mean ± std over seeds):", "",
           "| scenario @ load | seeds × requests | QPS | " + " | ".join(heads) + " |",
           "| --- " * (3 + len(heads)) + "|"]
    counts = {(r["scenario"], float(r["load"])): int(r["count"]) for r in rows if "count" in r}
    for point in points:
        b = get(point, "serialized-fifo")
        cells = [f"{pm(get(point, n), 'mean_s', unit=' s')} / "
                 f"{pm(get(point, n), 'slo_attainment', '{:.0%}')}" if get(point, n) else "—"
                 for n in names]
        out.append(f"| {point[0]} @ {point[1]} | {b['seeds'] if b else 0} × "
                   f"{counts.get(point, '?')} | {b['qps'] if b else 0:.2f} | "
                   + " | ".join(cells) + " |")
    return out


def _goals_table(summary, points) -> list[str]:
    get, pm = functools.partial(_summary_row, summary), _mean_std
    out = ["", "The goals' comparisons, paired per seed (mean ± std over seeds); baseline "
            "sustained = its in-run utilisation (offered QPS x mean in-run service time), "
            f"pooled over seeds (<= {MAX_UTILISATION}: sustained); baseline / M/G/1 = its mean "
            "TTFT / the steady-state mean TTFT predicted from the probe's service times:", "",
            "| scenario @ load | baseline sustained | baseline / M/G/1 | SJF vs baseline | "
            "pipelined FIFO vs baseline | SJF-PT / SJF | SJF-PT / SRPT | LSTF − EDF | "
            "LSTF − baseline | LSTF demoted (met SLO anyway) |",
            "| --- " * 10 + "|"]
    for point in points:
        b, s, f = get(point, "serialized-fifo"), get(point, "sjf"), get(point, "fifo")
        pt, l = get(point, "sjf-pt"), get(point, "lstf")
        pooled = b.get("baseline_utilisation_pooled") if b else None
        sustained = ("n/a" if pooled in (None, "") else
                     f"{pooled:.3f} ({'yes' if pooled <= MAX_UTILISATION else 'no'})")
        mg1 = b.get("baseline_mg1_ttft_s_mean") if b else None
        # at load 1.0 rho is 1 to rounding: the prediction is astronomically large, i.e. none
        vs_mg1 = ("n/a" if mg1 in (None, "") else
                  f"{b['mean_s_mean']:.2f} / {mg1:.2f} s" if mg1 < 1000 * b["mean_s_mean"] else
                  f"{b['mean_s_mean']:.2f} s / ∞")
        demoted = (f"{l['demoted_total']} ({l['demoted_met_slo_total']})"
                   if l and l.get("demoted_total") not in (None, "") else "n/a")
        out.append(f"| {point[0]} @ {point[1]} | {sustained} | {vs_mg1}"
                   f" | {pm(s, 'vs_baseline_pct', '{:.1f}', '%')}"
                   f" | {pm(f, 'vs_baseline_pct', '{:.1f}', '%')} | {pm(pt, 'vs_sjf_x', unit='×')}"
                   f" | {pm(pt, 'vs_srpt_x', unit='×')}"
                   f" | {pm(l, 'slo_vs_edf_pts', '{:.1f}', ' pts')}"
                   f" | {pm(l, 'slo_vs_baseline_pts', '{:.1f}', ' pts')} | {demoted} |")
    return out


def _seed_table(rows) -> list[str]:
    out = ["", "Per seed (load avg: mean 1-minute load average over the seed's policy runs):", "",
            "| scenario @ load | seed | QPS (capacity) | load avg | baseline in-run utilisation; "
            "completed / arrived |"
            " baseline | SJF | SJF vs baseline | SJF-PT / SJF | SJF-PT / SRPT | SLO EDF / LSTF /"
            " baseline |",
            "| --- " * 11 + "|"]
    by_run: dict = {}
    for r in rows:
        by_run.setdefault((r["scenario"], float(r["load"]), int(r["seed"])), {})[r["policy"]] = r
    for (scenario, load, seed), runs in sorted(
            by_run.items(), key=lambda kv: (list(SCENARIOS).index(kv[0][0]), kv[0][1:])):
        b, s = runs.get("serialized-fifo"), runs.get("sjf")
        if not (b and s):
            continue
        pt, e, l = runs.get("sjf-pt"), runs.get("edf"), runs.get("lstf")
        slo = " / ".join(f"{100 * x['slo_attainment']:.0f}" if x else "—" for x in (e, l, b))
        cap = b.get("capacity_measured_qps", "")
        ratio = f"{pt['mean_s'] / s['mean_s']:.2f}×" if pt else "—"
        r = runs.get("srpt")
        ratio_srpt = f"{pt['mean_s'] / r['mean_s']:.2f}×" if pt and r else "—"
        out.append(" | ".join([
            f"| {scenario} @ {load}", str(seed),
            f"{b['qps']:.2f}" + (f" ({cap:.2f})" if cap != "" else ""),
            f"{np.mean([x['loadavg'] for x in runs.values()]):.1f}",
            (f"{b['baseline_utilisation']:.3f}; " if b.get("baseline_utilisation", "") != ""
             else "") + f"{b.get('baseline_completed', '?')} / {b.get('baseline_arrived', '?')}",
            f"{b['mean_s']:.2f} s", f"{s['mean_s']:.2f} s",
            f"{100 * (s['mean_s'] / b['mean_s'] - 1):.0f}%", ratio, ratio_srpt, f"{slo}% |"]))
    return out
