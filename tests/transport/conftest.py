"""Fixtures for transport tests: leak checks and peer processes.

Every test in this directory is wrapped by ``no_leaks``: after the test, no thread started
during it may still run (transport threads are all joined by ``Endpoint.close``), no child
process it started may be left, and no ``/dev/shm/jkvt-*`` segment may remain.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transport_consts import REPO, SECRET  # noqa: E402,F401  (re-exported for fixtures)


def _children() -> set[int]:
    me, out = str(os.getpid()), set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                out.add(int(d))
    return out


def _shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("jkvt-")}


@pytest.fixture(autouse=True)
def no_leaks():
    threads_before = set(threading.enumerate())
    children_before = _children()  # session-scoped servers of other test packages are not this test's
    shm_before = _shm_segments()
    yield
    deadline = time.monotonic() + 3.0
    while True:
        extra_threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        extra_children = _children() - children_before
        extra_shm = _shm_segments() - shm_before
        if not (extra_threads or extra_children or extra_shm) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not extra_threads, f"leaked threads: {[t.name for t in extra_threads]}"
    assert not extra_children, f"leaked child processes: {sorted(extra_children)}"
    assert not extra_shm, f"leaked shm segments: {sorted(extra_shm)}"


class PeerProcess:
    """``python -m transport.tool serve`` in a real OS process."""

    def __init__(self, *args: str, prefix: list[str] | None = None):
        cmd = [*(prefix or []), sys.executable, "-m", "transport.tool", "serve",
               "--secret", SECRET, *args]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process failed to start: {self.proc.stderr.read()}")
        info = json.loads(line)
        self.address, self.pid = info["address"], info["pid"]

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream and not stream.closed:
                stream.close()


@pytest.fixture
def spawn_peer():
    started: list[PeerProcess] = []

    def spawn(*args: str, prefix: list[str] | None = None) -> PeerProcess:
        p = PeerProcess(*args, prefix=prefix)
        started.append(p)
        return p

    yield spawn
    for p in started:
        p.stop()


@pytest.fixture
def make_endpoint():
    """Factory for endpoints that are closed (threads joined) at teardown."""
    from transport import Endpoint
    made = []

    def make(name: str, backend: str = "tcp", **kw):
        kw.setdefault("secret", SECRET)
        ep = Endpoint(name, backend, **kw)
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()
