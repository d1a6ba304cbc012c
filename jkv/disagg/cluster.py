"""Local worker processes and the disaggregated engine `LLM(disaggregation=...)` uses.

`LocalPrefillWorkers` starts `python -m jkv.disagg.prefill_worker` processes (each its own JAX
process), reads the address each prints (`JKV-READY host:port`), starts a replacement for one that
exited (`respawn`, driven by jkv/disagg/supervisor.py) and stops them on `close()` (SIGTERM, then
SIGKILL after a grace period). `DisaggregatedEngine` builds the selector once,
ships it to the workers through a file, starts them (or connects to `addresses`) and runs a
`DecodeWorker` in the calling process (the decode process). Not thread-safe: one generate at a
time, like `DenseEngine`.
"""
from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time

from jkv.disagg import protocol as proto
from jkv.disagg.config import Disaggregation
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.selectors import build_selector, save_selector
from jkv.transfer.profile import ImportanceProfile

log = logging.getLogger(__name__)

READY = "JKV-READY "


class WorkerStartError(RuntimeError):
    pass


class LocalPrefillWorkers:
    """`count` prefill worker processes named prefill-0 .. prefill-{count-1}. `procs[i]` and
    `addresses[i]` are worker i's current process and transport address ("main|bulk");
    `respawn(i)` replaces an exited one (jkv/disagg/supervisor.py). `_lock` guards both lists
    against a respawn racing `close()`."""

    def __init__(self, count: int, model_spec: str, selector_file: str, *, secret: str, transport: str = "tcp",
                 bandwidth=None, lease_s: float = 300.0, timeout_s: float = 5.0, start_timeout: float = 300.0,
                 dtype: str = "float32", max_blocks: int | None = None, tensor_parallel: int = 1,
                 prefix_cache_tokens: int = 0):
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.start_timeout = start_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._env = dict(os.environ, JKV_SECRET=secret)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self._env["PYTHONPATH"] = root + os.pathsep + self._env.get("PYTHONPATH", "")
        self._args = ["--model", model_spec, "--selector-file", selector_file, "--transport", transport,
                      "--lease-s", str(lease_s), "--timeout-s", str(timeout_s), "--dtype", dtype, "--tensor-parallel", str(tensor_parallel), "--exit-with-parent"]
        if max_blocks is not None:
            self._args += ["--max-blocks", str(max_blocks)]
        if prefix_cache_tokens:
            self._args += ["--prefix-cache-tokens", str(prefix_cache_tokens)]
        if bandwidth is not None:
            self._args += ["--bandwidth", str(bandwidth)]
        try:
            self.procs = [self._spawn(i) for i in range(count)]
            self.addresses = [self._wait_ready(i, proc, start_timeout) for i, proc in enumerate(self.procs)]
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "jkv.disagg.prefill_worker", "--name", f"prefill-{i}", *self._args]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, env=self._env, text=True)

    def respawn(self, i: int) -> str:
        """Start a new process for worker i (whose process has exited) and return its address once
        it listens. Raises WorkerStartError when it does not start, or once `close()` has begun."""
        with self._lock:
            if self._closed:
                raise WorkerStartError(f"prefill worker {i} not restarted: the workers are closing")
            old = self.procs[i]
            if old.poll() is None:
                raise RuntimeError(f"prefill worker {i} (pid {old.pid}) is still running")
            if old.stdout:
                old.stdout.close()
            proc = self.procs[i] = self._spawn(i)  # close() stops it from here on
        address = self._wait_ready(i, proc, self.start_timeout)
        with self._lock:
            self.addresses[i] = address
        return address

    @staticmethod
    def _wait_ready(i, proc, timeout) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = box[0] if box else ""
        if not line.startswith(READY):
            raise WorkerStartError(f"prefill worker {i} did not start (exit code {proc.poll()}, said {line!r}); "
                                   "run `jkv prefill-worker` by hand to see its error")
        return line[len(READY):].strip()

    def kill(self, i: int) -> None:
        """SIGKILL worker i (fault tests)."""
        self.procs[i].kill()
        self.procs[i].wait()

    def close(self, grace: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            procs, self.procs = list(self.procs), []
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


class PrefillCacheStats:
    """The prefill workers' own prefix-cache counters (`PrefillPrefixCache.stats`), summed over
    the workers a decode worker is connected to, read over each worker's "stats" RPC when called
    (the role-all server's /metrics scrape, `LLM.prefill_cache_stats`). A worker that does not
    answer within `timeout` seconds counts with its last answer; a restarted worker starts from
    zero (the sum drops: Prometheus reads that as a counter reset). Thread-safe."""

    def __init__(self, decode: DecodeWorker, timeout: float = 1.0):
        self.decode, self.timeout = decode, timeout
        self._last: dict[str, dict[str, int]] = {}  # worker name -> its last answer
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, int] | None:
        """Summed counters, or None when no worker has a prefix cache (or none answered yet)."""
        calls = {}
        for name in list(self.decode.owners):  # all calls in flight at once: one timeout in all
            try:
                calls[name] = self.decode.endpoint.peer(name).call_async("stats", b"", timeout=self.timeout)
            except Exception as e:  # not connected (restarting): its last answer stands
                log.debug("prefill worker %s: no stats call (%s)", name, e)
        answers = {}
        for name, call in calls.items():
            try:
                answers[name] = proto.unpack(call.result())[0].get("prefix_cache")
            except Exception as e:
                log.debug("prefill worker %s: stats call failed (%s); its last counters stand", name, e)
        with self._lock:
            self._last.update({k: v for k, v in answers.items() if v is not None})
            if not self._last:
                return None
            return {k: sum(s[k] for s in self._last.values()) for k in next(iter(self._last.values()))}


class DisaggregatedEngine:
    """One decode worker (this process) fed by prefill worker processes."""

    def __init__(self, model, config: Disaggregation, model_spec: str | None = None, selector=None,
                 oracle_profile: ImportanceProfile | None = None, name: str = "decode-0", page_config=None,
                 prefix_caching: bool = False):
        """name: the decode worker's transport name, unique among the decode servers that share a
        prefill worker (a second connection under one name replaces the first). page_config: the
        decode worker's device page pool (jkv.kvcache.PageConfig; None: sized to need, doubling at hand-in).
        prefix_caching: the decode worker keeps finished prompts' pages and later requests move
        only their new KV (jkv/disagg/prefix_split.py), and local prefill workers keep their own
        prefix cache of config.prefill_prefix_cache_tokens (jkv/disagg/prefill_cache.py)."""
        self.config = config
        self.model = model
        spec = config.model_spec or model_spec
        if spec is None and not config.addresses:
            raise ValueError("starting local prefill workers needs a model they can load: construct LLM with a "
                             "model name/path or pass Disaggregation(model_spec=...)")
        # The budget floor is the engine's (Disaggregation.min_budget), also for a selector built
        # elsewhere (`jkv serve --selector-file`); it travels to the prefill workers in its config.
        self.selector = (selector or build_selector(model, config.selector, **config.selector_options)
                         ).with_min_budget(config.min_budget)
        profile = ImportanceProfile.load(config.profile) if config.profile else None
        if profile is not None and profile.selector != self.selector.name:
            log.warning("profile %s was made for selector %r, serving uses %r", config.profile, profile.selector,
                        self.selector.name)
        secret = config.secret or secrets.token_hex(16)
        self._tmp = tempfile.TemporaryDirectory(prefix="jkv-disagg-")
        self.workers = None
        self.decode = DecodeWorker(model, self.selector, config.transfer, secret=secret, backend=config.transport,
                                   profile=profile, oracle_profile=oracle_profile, on_failure=config.on_failure,
                                   timeout=config.timeout_s, compression=config.compression_policy(), name=name,
                                   page_config=page_config, prefix_caching=prefix_caching)
        self.prefill_cache_stats = PrefillCacheStats(self.decode)
        try:
            addresses = list(config.addresses)
            if not addresses:
                path = os.path.join(self._tmp.name, "selector.pkl")
                save_selector(self.selector, path)
                self.workers = LocalPrefillWorkers(config.prefill_workers, spec, path, secret=secret,
                                                   transport=config.transport, bandwidth=config.bandwidth,
                                                   lease_s=config.lease_s, timeout_s=config.timeout_s,
                                                   dtype=model.cfg.dtype, max_blocks=config.transfer.max_blocks,
                                                   tensor_parallel=getattr(model, "tensor_parallel", 1),
                                                   prefix_cache_tokens=config.prefill_prefix_cache_tokens
                                                   if prefix_caching else 0)
                addresses = self.workers.addresses
            self.decode.connect(addresses)
        except BaseException:
            self.close()
            raise

    def generate(self, requests, t0: float | None = None):
        """t0: time.perf_counter() when the caller accepted the requests (metrics are relative to it)."""
        wall_t0 = None if t0 is None else time.time() - (time.perf_counter() - t0)
        return self.decode.generate(requests, wall_t0)

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close()
            self.decode = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        self._tmp.cleanup()
