"""experiments/gpu_check.sh --cpu-dry-run: the GPU check's every step runs on CPU, so it cannot rot."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("env", "wheels", "kernels", "bench", "f32_attention", "programs")


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~1 min of CPU; minutes of wall time on a loaded 2-core box
def test_cpu_dry_run_leaves_a_summary_of_every_step_under_out(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, JKV_KERNEL_MODE="interpret")
    proc = subprocess.run(
        ["bash", str(ROOT / "experiments" / "gpu_check.sh"), "--cpu-dry-run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    summary = out / "summary.md"
    assert summary.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    text = summary.read_text()
    steps = {row["step"]: row["status"] for row in csv.DictReader(open(out / "steps.csv"))}
    assert tuple(steps) == STEPS
    for step in STEPS:
        assert f"| {step} |" in text
        log = (out / f"{step}.log").read_text()[-1500:]
        assert steps[step] == "ok", f"{step}: {steps[step]}\n{log}"
    # The measurements came back as CSVs under $OUT and are in the summary.
    for name in ("kernels_cpu.csv", "attention_f32.csv", "programs.csv", "generate.csv"):
        assert (out / name).exists() and f"## {name}" in text
    f32 = list(csv.DictReader(open(out / "attention_f32.csv")))
    assert f32 and all(not row["error"] and float(row["max_abs_err_vs_f64"]) < 1e-4 for row in f32)
    generate = list(csv.DictReader(open(out / "generate.csv")))
    assert generate and all(row["valid_ids"] == "True" for row in generate)
    assert proc.returncode == 0, proc.stdout[-2000:]
