"""experiments/calvo.py's multi-seed bookkeeping (jkv/scheduling/report.py): merging held runs,
paired per-seed figures, the CSV round trip and the figure (no model: synthetic rows)."""
import pytest

from jkv.scheduling.report import aggregate, merge_rows, read_rows, write_outputs

POLICY_TTFT = {"serialized-fifo": (2.0, 0.5), "fifo": (1.0, 0.7), "sjf-pt": (0.9, 0.8),
               "sjf": (0.6, 0.9), "srpt": (0.45, 0.9), "edf": (0.8, 0.85), "lstf": (0.7, 0.95)}


def rows_for(seed, scale, scenario="mixed-hit", load=0.7):
    return [dict(scenario=scenario, load=load, seed=seed, qps=1.0 + seed, policy=p,
                 link="1gbit", token_mismatches=0, fit_median_error=0.05, loadavg=1.0, count=48,
                 mean_s=t * scale, p50_s=t * scale, p99_s=2 * t * scale,
                 slo_attainment=min(1.0, slo * (1 + 0.05 * seed)))
            for p, (t, slo) in POLICY_TTFT.items()]


def test_aggregate_reports_mean_spread_and_paired_ratios():
    rows = rows_for(0, 1.0) + rows_for(1, 2.0)
    summary = {r["policy"]: r for r in aggregate(rows)}
    sjf, base, lstf = summary["sjf"], summary["serialized-fifo"], summary["lstf"]
    assert sjf["seeds"] == 2
    assert sjf["mean_s_mean"] == pytest.approx((0.6 + 1.2) / 2)
    assert sjf["mean_s_std"] == pytest.approx(0.3)
    assert (sjf["mean_s_min"], sjf["mean_s_max"]) == (pytest.approx(0.6), pytest.approx(1.2))
    # paired per seed: SJF is 70% below the same seed's baseline in both, so no spread
    assert sjf["vs_baseline_pct_mean"] == pytest.approx(-70.0)
    assert sjf["vs_baseline_pct_std"] == pytest.approx(0.0)
    assert summary["sjf-pt"]["vs_sjf_x_mean"] == pytest.approx(1.5)
    assert summary["sjf-pt"]["vs_srpt_x_mean"] == pytest.approx(2.0)
    assert lstf["slo_vs_edf_pts_mean"] == pytest.approx(100 * (0.95 - 0.85) * (1 + 0.025))
    assert lstf["slo_vs_baseline_pts_mean"] > 40
    assert base["qps"] == pytest.approx(1.5)


def test_merge_replaces_the_same_run_and_keeps_others():
    old = rows_for(0, 1.0) + rows_for(1, 1.0)
    new = rows_for(1, 3.0) + rows_for(2, 1.0)
    merged = merge_rows(old, new)
    assert len(merged) == 3 * len(POLICY_TTFT)
    seed1 = [r for r in merged if r["seed"] == 1 and r["policy"] == "sjf"]
    assert [r["mean_s"] for r in seed1] == [pytest.approx(1.8)]


def test_outputs_round_trip_through_csv(tmp_path):
    rows = rows_for(0, 1.0) + rows_for(1, 1.5) + rows_for(0, 1.0, "full-hit", 0.9)
    summary = write_outputs(rows, tmp_path)
    assert (tmp_path / "calvo.png").stat().st_size > 0
    assert (tmp_path / "calvo_summary.csv").stat().st_size > 0
    back = read_rows(tmp_path / "calvo.csv")
    assert back == rows
    assert aggregate(back) == summary


def test_rows_from_before_the_demotion_columns_merge_and_aggregate(tmp_path):
    old = rows_for(0, 1.0)                       # an earlier run: no demotion counts
    new = [dict(r, demoted=3 if r["policy"] == "lstf" else 0,
                demoted_met_slo=1 if r["policy"] == "lstf" else 0) for r in rows_for(1, 1.0)]
    write_outputs(merge_rows(old, new), tmp_path)
    back = read_rows(tmp_path / "calvo.csv")
    lstf = next(r for r in aggregate(back) if r["policy"] == "lstf")
    assert (lstf["demoted_total"], lstf["demoted_met_slo_total"]) == (3, 1)


def test_recording_demotions_sees_what_lstf_ranks_hopeless():
    from jkv.scheduling import CostModel, RequestInfo, make_policy
    from jkv.scheduling.variants import recording_demotions
    model = CostModel(a=1e-5, b=0.0, c=1e-3, d=0.0)
    demoted = set()
    key = recording_demotions(make_policy("lstf", model), demoted).progress_key
    late = RequestInfo("late", 0.0, 90_000, 0, deadline_s=0.5)     # 0.9 s of work left
    fine = RequestInfo("fine", 0.0, 10_000, 0, deadline_s=5.0)
    assert key(late, 90_000, 0.0) > key(fine, 10_000, 0.0)
    assert demoted == {"late"}
    assert recording_demotions(make_policy("edf"), demoted).progress_key is None


def test_lstf_variants_experiment_runs_and_variants_behave(tmp_path, run_experiment):
    import csv

    from jkv.scheduling import CostModel, RequestInfo
    from jkv.scheduling.variants import VARIANTS, sticky_lstf
    model = CostModel(a=1e-5, b=0.0, c=1e-3, d=0.0)
    r = RequestInfo("r", 0.0, 40_000, 0, deadline_s=2.0)
    frozen = sticky_lstf(model, "freeze").progress_key
    mono = sticky_lstf(model, "mono").progress_key
    assert frozen(r, 40_000, 0.0) > frozen(r, 40_000, 0.5)      # not started: plain LSTF
    start = frozen(r, 30_000, 0.1)                 # first chunk in L1: key held from here
    assert frozen(r, 10_000, 0.2) == start          # progress does not move it
    m0 = mono(r, 30_000, 0.1)
    assert mono(r, 10_000, 0.2) == m0               # slack would rise: held
    assert mono(r, 10_000, 1.9)[1] < m0[1]          # slack falls: follows
    done = run_experiment("calvo_lstf_variants.py", "--seeds", "1", "--contexts", "2",
                          "--queries", "2", "--loads", "1.0", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "calvo_lstf_variants_sigma0.csv") as f:
        rows = list(csv.DictReader(f))
    assert {row["policy"] for row in rows} == set(VARIANTS)
    assert "minus EDF" in done.stdout


def test_markdown_tables_carry_the_paired_figures_and_the_sustain_check():
    from jkv.scheduling.report import markdown_tables
    # utilisation 0.96 and 1.0 over 48 requests each: pooled 0.98 > 0.97, not sustained
    rows = [dict(r, baseline_completed=30, baseline_arrived=32, capacity_measured_qps=2.0,
                 baseline_utilisation=0.96 + 0.04 * r["seed"], baseline_mg1_ttft_s=8.0)
            if r["policy"] == "serialized-fifo" else r
            for r in rows_for(0, 1.0) + rows_for(1, 2.0)]
    text = markdown_tables(aggregate(rows), rows)
    point = next(line for line in text.splitlines()
                 if line.startswith("| mixed-hit @ 0.7 | 0.980"))
    assert "(no)" in point and "-70.0 ± 0.0%" in point and "| 1.50 ± 0.00× | 2.00 ± 0.00× |" in point
    assert "| 3.00 / 8.00 s |" in point        # baseline mean TTFT over seeds / M/G/1
    assert "| mixed-hit @ 0.7 | 1 | 2.00 (2.00) |" in text and "| 1.000; 30 / 32 |" in text
    assert "| 1.50× | 2.00× | 85 / 95 / 50% |" in text     # SJF-PT / SJF, / SRPT; SLOs (seed 0)


def test_calvo_refuses_a_control_load_outside_the_sweep(tmp_path, run_experiment):
    done = run_experiment("calvo.py", "--scenarios", "full-hit", "--loads", "0.9,0.95",
                          "--baseline-only-loads", "1.0", "--policies", "serialized-fifo,sjf",
                          "--out-dir", str(tmp_path))
    assert done.returncode == 2           # argparse's usage error, before any model or pool starts
    err = done.stderr
    assert "--baseline-only-loads [1.0] not among the swept loads [0.9, 0.95]" in err
    assert list(tmp_path.iterdir()) == []
