"""Run a test worker script in a jax process of its own with N fake CPU devices and read the JSON
it prints (tests/models/tp_worker.py, tests/smartgen/tp_disagg_worker.py, the multi-host ranks).

XLA fixes the host device count when jax initialises, so the rest of the suite (one CPU device)
cannot host these runs. Every such process compiles with LLVM at -O0
(`--xla_backend_optimization_level=0`): nearly all of their CPU time is XLA compiling small
sharded programs, and -O0 cuts it by a fifth to two fifths (tp_worker ~20 %, tp_disagg_worker
71 -> 43 CPU-s) while these tiny programs run no slower. Each test compares runs made under the
same flag with one another (or greedy tokens with a one-device run, which -O0 leaves unchanged),
so the flag cannot hide a difference. One flag string for all of them also lets the run's
persistent XLA cache (tests/conftest.py) serve one worker's programs to the next.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def device_env(devices: int, **extra: str) -> dict:
    """The environment of a worker process with `devices` CPU devices, this checkout importable."""
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)


def result_line(out: str, tag: str):
    """The JSON of the last line of `out` that starts with `tag` + " ", or None."""
    lines = [line for line in out.splitlines() if line.startswith(tag + " ")]
    return json.loads(lines[-1][len(tag) + 1:]) if lines else None


def run_worker(worker: Path, tag: str, devices: int = 4, timeout: float = 600):
    """Run `worker` with `devices` CPU devices; returns the JSON of its `tag` line and fails the
    test with the worker's stderr when it exits non-zero or prints none."""
    proc = subprocess.run([sys.executable, str(worker)], env=device_env(devices), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    result = result_line(proc.stdout, tag)
    assert proc.returncode == 0 and result is not None, \
        f"{worker.name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    assert result["devices"] == devices
    return result
