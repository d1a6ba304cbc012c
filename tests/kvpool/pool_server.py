"""A `jkv pool` server child process for tests (python -m jkv.kvpool.server)."""
import json
import os
import pathlib
import signal
import subprocess
import sys

from tests.stop_process import stop_process

SECRET = "kvpool-test-secret"
REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


class PoolServerProcess:
    """Starts the server, reads its address line; `stop()` kills it (SIGKILL, like a crash)."""

    def __init__(self, capacity: str = "64MiB", backend: str = "tcp", listen: str | None = None,
                 bandwidth: str | None = None):
        self.args = [sys.executable, "-m", "jkv.kvpool.server", "--capacity", capacity,
                     "--backend", backend, "--stdin-eof-exits"]
        if listen:
            self.args += ["--listen", listen]
        if bandwidth:
            self.args += ["--bandwidth", bandwidth]
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self) -> "PoolServerProcess":
        env = dict(os.environ, JKV_SECRET=SECRET, PYTHONPATH=REPO_ROOT)
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"jkv pool server exited {self.proc.returncode}: "
                               f"{self.proc.stderr.read()}")
        info = json.loads(line)
        self.address = info["address"]
        return self

    def pause(self) -> None:
        stop_process(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
        self.proc = None
