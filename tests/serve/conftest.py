"""Live `jkv serve` subprocesses on free loopback ports, and leak checks after every test."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from tiny_ckpt import write_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m jkv.cli serve ...` on port 0; `url` is read from its startup log line."""

    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 120, command: str = "serve",
                 wait: bool = True, host: str = "127.0.0.1", prefix: tuple = ()):
        """wait=False returns once the process is started: do other work (load a reference model,
        start a second server) while it warms up, then call wait_ready(). prefix: a command the
        server runs under (e.g. `ip netns exec NAME`), host: the address it binds."""
        self.args = args
        self.ready_timeout = ready_timeout
        self.log: list[str] = []
        e = dict(os.environ, **(env or {}))
        e.setdefault("PYTHONPATH", str(REPO))
        e.setdefault("JAX_PLATFORMS", "cpu")
        # No start-up compile of every (rows, width) decode program (jkv/serving/launch.py
        # warmup_enabled): a test server compiles only the programs its requests run, from the run's
        # shared XLA cache where another process compiled them (a tiny server's start: ~38 -> ~8
        # CPU-s, cold cache). The shared `server` below keeps the production start-up, warm-up included.
        e.setdefault("JKV_WARMUP", "0")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "jkv.cli", command, "--host", host, *args],
                                     cwd=REPO, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._ready = threading.Event()
        self.url = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "ServerProcess":
        """Block until the startup log line gives the URL (ready_timeout seconds from now)."""
        if not self._ready.wait(self.ready_timeout) or self.url is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError("server did not start:\n" + "".join(self.log[-40:]))
        return self

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            if "listening on http://" in line and self.url is None:
                self.url = line.split("listening on ")[1].split()[0]
                self._ready.set()
        self._ready.set()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def metric(url: str, name: str, labels: dict | None = None) -> float:
    """Value of one sample on `url`/metrics (0 if absent)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def health(url: str) -> dict:
    """A server's /health JSON."""
    return httpx.get(url + "/health", timeout=10).json()


def wait_for(cond, timeout: float, what: str = "", poll: float = 0.05) -> float:
    """Poll `cond()` every `poll` seconds until it is true; fail naming `what` after `timeout`
    seconds. Returns the seconds waited."""
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(poll)
    return time.time() - t0


def wait_idle(url: str, timeout: float = 10) -> tuple[float, float]:
    """Wait until no slot is allocated, nothing is queued and no KV page is held (paged engine);
    returns the last (slots, waiting), with the pages still held added to slots (a page leak
    shows as a non-zero first value)."""
    deadline = time.time() + timeout
    while True:
        state = (metric(url, "jkv_kv_slots_allocated") + metric(url, "jkv_kv_pages_in_use"),
                 metric(url, "jkv_num_requests_waiting"))
        if state == (0, 0) or time.time() > deadline:
            return state
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-serve"))


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    return {"JKV_CACHE_DIR": str(tmp_path_factory.mktemp("jkv-cache"))}


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from jkv import LLM
    from models import load_model

    return LLM(load_model(str(tiny_dir), use_cache=False))


@pytest.fixture(scope="session")
def server(tiny_dir, cache_env):
    # The production start-up, warm-up included; that took over 120 s to ready at load average 26.
    s = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", "--max-slots", "6",
                       "--max-model-len", "1024"], env=dict(cache_env, JKV_WARMUP="1"), ready_timeout=300)
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture
def live(server):
    """The shared server (paged KV cache, the default); after the test, no KV slot or page may remain
    allocated and nothing queued."""
    yield server
    assert wait_idle(server.url) == (0, 0), "a KV slot, KV page or queued request leaked"
