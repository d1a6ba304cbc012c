"""Supervision of the local prefill worker processes of `jkv serve --role all --disaggregation`.

A local prefill worker that exits while the server runs (killed, crashed, out of memory) is
reaped, logged, and restarted with capped exponential backoff; its new transport address goes to
`on_restart(i, old_address, new_address)`, which re-registers it with the decode side (the
decode worker's reconnector connects to the new address: jkv/disagg/reconnect.py). Meanwhile the
decode side has already forgotten it: the transport saw the connection drop, so the worker's
pending requests failed with its dead-peer policy (their KV freed) and new requests go to the
live workers, or get 503 while none is live. Once reconnected, it takes requests again.

    supervisor = PrefillSupervisor(workers, on_restart=..., max_quick_failures=5)
    supervisor.start()      # one daemon thread, "jkv-prefill-supervisor"
    supervisor.status()     # per worker: name, pid, state, restarts, last exit code (for /health)
    supervisor.stop()       # before workers.close()

Per worker: running -> (exit) restarting -> running | restarting ... | failed. A failure is
*quick* when the process exited within `stable_s` of its start, or did not start at all; after
`max_quick_failures` quick failures in a row the supervisor gives up on that worker (an ERROR
saying why and what to do; state "failed", so the fault is not hidden behind endless restarts).
A worker that ran for `stable_s` starts its count afresh. With `max_quick_failures=0` nothing
is restarted (a dead worker stays dead, as before supervision).

Threads: one daemon thread polls `Popen.poll()` (which also reaps the exited child) every
`interval` seconds and runs the restarts, one at a time (each waits up to the workers'
`start_timeout` for the new process to listen; `stop()` interrupts the backoff wait, and
`workers.close()` a start in progress). `status()` may be called from any thread (`_lock`).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import Callable

from jkv.disagg.reconnect import Backoff

log = logging.getLogger("jkv.serve")

DEFAULT_BACKOFF = Backoff(initial_s=1.0, max_s=30.0, factor=2.0, jitter=0.2)


@dataclasses.dataclass
class _Worker:
    index: int
    pid: int
    started_at: float
    state: str = "running"  # running | restarting | failed
    restarts: int = 0
    quick_failures: int = 0
    last_exit: int | None = None
    last_error: str | None = None


class PrefillSupervisor:
    """See the module docstring. `workers`: a `LocalPrefillWorkers`; `max_quick_failures`: quick
    failures in a row that are still restarted (the next one gives up); `stable_s`: a worker that
    ran this long failed slowly (its count starts afresh)."""

    def __init__(self, workers, *, on_restart: Callable[[int, str, str], None] | None = None,
                 max_quick_failures: int = 5, stable_s: float = 60.0, backoff: Backoff = DEFAULT_BACKOFF,
                 interval: float = 0.5, rng: random.Random | None = None):
        if not isinstance(max_quick_failures, int) or max_quick_failures < 0:
            raise ValueError(f"{max_quick_failures=} must be an int >= 0 (0: never restart)")
        if not stable_s > 0 or not interval > 0:
            raise ValueError(f"stable_s={stable_s} and interval={interval} must be > 0 seconds")
        self.workers, self.on_restart = workers, on_restart
        self.max_quick_failures, self.stable_s, self.backoff, self.interval = (max_quick_failures, stable_s,
                                                                              backoff, interval)
        self._rng = rng or random.Random()
        now = time.monotonic()
        self._state = [_Worker(i, p.pid, now) for i, p in enumerate(workers.procs)]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jkv-prefill-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def status(self) -> list[dict]:
        with self._lock:
            return [{"name": f"prefill-{w.index}", "pid": w.pid, "state": w.state, "restarts": w.restarts,
                     "last_exit_code": w.last_exit, "last_error": w.last_error} for w in self._state]

    @property
    def restarts(self) -> int:
        with self._lock:
            return sum(w.restarts for w in self._state)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for w in self._state:
                if self._stop.is_set():
                    return
                try:
                    self._check(w)
                except Exception:  # noqa: BLE001 - supervision must outlive one bad pass
                    log.exception("prefill-worker: supervising local process prefill-%d failed", w.index)

    def _check(self, w: _Worker) -> None:
        if w.state != "running":
            return
        code = self.workers.procs[w.index].poll()  # reaps an exited child
        if code is None:
            return
        ran_s = time.monotonic() - w.started_at
        with self._lock:
            w.last_exit, w.state = code, "restarting"
        log.warning("prefill-worker: local process prefill-%d (pid %d) exited with code %s after %.1fs; its "
                    "requests fail and /ready reports 503 while no prefill worker is live", w.index, w.pid, code,
                    ran_s)
        if ran_s >= self.stable_s:
            w.quick_failures = 0
        self._restart(w, quick=ran_s < self.stable_s)

    def _restart(self, w: _Worker, quick: bool) -> None:
        """Restart worker `w` until it runs, it fails quickly `max_quick_failures` times in a row, or stop()."""
        while not self._stop.is_set():
            if quick:
                w.quick_failures += 1
            if w.quick_failures > self.max_quick_failures or self.max_quick_failures == 0:
                self._give_up(w)
                return
            delay = self.backoff.delay(max(1, w.quick_failures), self._rng)
            log.warning("prefill-worker: restarting prefill-%d in %.1fs (quick failure %d of at most %d)", w.index,
                        delay, w.quick_failures, self.max_quick_failures)
            if self._stop.wait(delay):
                return
            old = self.workers.addresses[w.index]
            t0 = time.monotonic()
            try:
                address = self.workers.respawn(w.index)
            except Exception as e:  # noqa: BLE001 - a failed start is one quick failure
                with self._lock:
                    w.last_error = str(e)
                log.warning("prefill-worker: restart of prefill-%d failed: %s", w.index, e)
                quick = True
                continue
            with self._lock:
                w.pid, w.started_at, w.state, w.last_error = self.workers.procs[w.index].pid, time.monotonic(), \
                    "running", None
                w.restarts += 1
            log.info("prefill-worker: restarted local process prefill-%d (pid %d) on transport %s in %.1fs "
                     "(restart %d); the decode worker reconnects to it", w.index, w.pid, address,
                     time.monotonic() - t0, w.restarts)
            if self.on_restart is not None:
                self.on_restart(w.index, old, address)
            return

    def _give_up(self, w: _Worker) -> None:
        with self._lock:
            w.state = "failed"
        if self.max_quick_failures == 0:
            log.warning("prefill-worker: not restarting prefill-%d (restarts are off)", w.index)
            return
        log.error("prefill-worker: giving up on local process prefill-%d after %d quick failures in a row (each "
                  "within %.0fs of its start; last exit code %s%s): fix the cause shown in its output above and "
                  "restart the server", w.index, w.quick_failures, self.stable_s, w.last_exit,
                  f", last error: {w.last_error}" if w.last_error else "")
