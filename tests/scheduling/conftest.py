"""Scheduling test fixtures: every test must leave no pipeline thread running; experiment
scripts run as the user runs them (a child process), so tests never import `experiments`."""
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest


@pytest.fixture(autouse=True)
def no_thread_left_running():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not extra, f"threads left running: {[t.name for t in extra]}"


REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def run_experiment():
    """run_experiment("calvo_sim.py", *args) -> CompletedProcess (text stdout/stderr), the
    script run from the repository root with this checkout's packages on the path."""
    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, str(REPO / "experiments" / script), *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return run
