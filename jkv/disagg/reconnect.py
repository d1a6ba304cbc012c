"""Keep a decode worker connected to its configured prefill workers: reconnect with backoff.

A decode worker's link to a prefill worker can be declared dead while both processes live on
(the decode process was stopped longer than the transport timeout, a cable was pulled, the
prefill worker was restarted on the same address). Without a reconnect every later request
fails although the prefill worker is healthy. `PrefillReconnector` watches each configured
address and, once its connection is down, reconnects with capped exponential backoff and
jitter:

    reconnector = PrefillReconnector(addresses, names, connect=worker.connect_one, alive=is_alive)
    reconnector.start()          # one thread, "jkv-prefill-reconnect"
    ...
    with reconnector.connecting(blocking=False) as ok:   # other threads that connect: one at a time
        ...
    reconnector.close()          # joins the thread

Each loss is logged at WARNING once; each failed attempt at INFO, or at WARNING once the delay
has reached its cap (so a long outage logs at most one WARNING per `Backoff.max_s`); a
successful reconnect at INFO, with how long the worker was unreachable.

Threads: one daemon thread polls every `poll_s` seconds; `connect` calls (it and any other
caller holding `connecting()`) are serialised by one lock so two threads never replace each
other's fresh connection to the same worker. `alive` and `connect` must be thread-safe
(`DecodeWorker.connect_one` is: the transport endpoint is, and it only replaces the dead
connections of one worker).
"""
from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """Delay before reconnect attempt n+1 after n failures: `initial_s * factor**(n-1)`, capped at
    `max_s`, then scaled by a uniform draw from [1 - jitter, 1] so decode workers that lost the same
    prefill worker do not retry in lockstep."""

    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5

    def __post_init__(self):
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"Backoff needs 0 < initial_s ({self.initial_s}) <= max_s ({self.max_s})")
        if self.factor < 1:
            raise ValueError(f"Backoff factor={self.factor} must be >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"Backoff jitter={self.jitter} must be in [0, 1)")

    def base(self, failures: int) -> float:
        """The delay after `failures` (>= 1) failed attempts, before jitter."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1))

    def delay(self, failures: int, rng: random.Random) -> float:
        return self.base(failures) * (1 - self.jitter * rng.random())


@dataclass
class _Link:
    address: str  # "main|bulk", as configured
    name: str | None  # the prefill worker's transport name once connected
    down_since: float | None = None
    failures: int = 0
    next_at: float = 0.0


class PrefillReconnector:
    """See the module docstring. `addresses`: the configured prefill workers; `names`: address ->
    worker name of those already connected; `connect(address, timeout) -> name` (raises when the
    worker cannot be reached); `alive(name) -> bool`."""

    def __init__(self, addresses, names: dict[str, str], *, connect: Callable[[str, float], str],
                 alive: Callable[[str], bool], backoff: Backoff = Backoff(), poll_s: float = 0.25,
                 attempt_timeout: float = 1.0, rng: random.Random | None = None):
        if not poll_s > 0:
            raise ValueError(f"{poll_s=} must be > 0 seconds")
        self._links = [_Link(a, names.get(a)) for a in dict.fromkeys(addresses)]
        self._connect, self._alive = connect, alive
        self.backoff, self.poll_s, self.attempt_timeout = backoff, poll_s, attempt_timeout
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the reconnector is already started")
        self._thread = threading.Thread(target=self._run, name="jkv-prefill-reconnect", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the prefill reconnect thread did not stop within %.0fs", timeout)
            self._thread = None

    @contextlib.contextmanager
    def connecting(self, blocking: bool = True):
        """Hold the connect lock; yields False (lock not taken) when `blocking=False` and a
        reconnect attempt is in progress."""
        ok = self._lock.acquire(blocking)
        try:
            yield ok
        finally:
            if ok:
                self._lock.release()

    @property
    def addresses(self) -> list[str]:
        """The configured addresses, in order."""
        return [link.address for link in self._links]

    def readdress(self, old: str, new: str) -> None:
        """The prefill worker configured at `old` now listens at `new` (a restarted local worker,
        jkv/disagg/supervisor.py): reconnect there, at once. Any thread."""
        for link in self._links:
            if link.address == old:
                link.address, link.failures, link.next_at = new, 0, 0.0
                return
        raise KeyError(f"{old!r} is not a configured prefill worker address (have {self.addresses})")

    def reconnecting(self) -> list[str]:
        """The configured addresses whose connection is down right now."""
        return [link.address for link in self._links if link.down_since is not None]

    def check(self, now: float | None = None) -> None:
        """One pass over the configured workers (the thread calls this every `poll_s`)."""
        for link in self._links:
            if self._stop.is_set():
                return
            self._check(link, time.monotonic() if now is None else now)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad pass
                log.exception("prefill reconnect pass failed")

    def _check(self, link: _Link, now: float) -> None:
        if link.name is not None and self._alive(link.name):
            if link.down_since is not None:
                log.info("prefill worker %s at %s is connected again (unreachable for %.1fs)", link.name,
                         link.address, now - link.down_since)
                link.down_since, link.failures = None, 0
            return
        if link.down_since is None:
            link.down_since, link.failures, link.next_at = now, 0, now
            log.warning("lost the connection to prefill worker %s at %s; reconnecting with backoff "
                        "(%.1fs doubling to %.0fs)", link.name or "?", link.address, self.backoff.initial_s,
                        self.backoff.max_s)
        if now < link.next_at:
            return
        try:
            with self._lock:
                name = self._connect(link.address, self.attempt_timeout)
        except Exception as e:  # noqa: BLE001 - any failure is one failed attempt
            link.failures += 1
            delay = self.backoff.delay(link.failures, self._rng)
            link.next_at = time.monotonic() + delay
            level = logging.WARNING if self.backoff.base(link.failures) >= self.backoff.max_s else logging.INFO
            log.log(level, "reconnect attempt %d to prefill worker %s at %s failed: %s; next attempt in %.1fs",
                    link.failures, link.name or "?", link.address, e, delay)
            return
        log.info("reconnected to prefill worker %s at %s after %d failed attempts (unreachable for %.1fs)",
                 name, link.address, link.failures, time.monotonic() - link.down_since)
        link.name, link.down_since, link.failures = name, None, 0
