"""Transport counters, read as a plain dict (a Prometheus exporter maps it later).

``snapshot()`` shape::

    {"tx": {kind: {"ops", "bytes", "failures", "busy_s", "busy_bandwidth_bps"}},
     "rx": {kind: {...same...}},
     "retries": int, "frames_rejected": int, "auth_failures": int,
     "connections_refused": int,  # over max_handshakes, refused before any handshake
     "peers_connected": int, "peers_failed": int}

``kind`` is one of ``write``, ``call``, ``reply``, ``notify``. Busy time is the union of the
intervals during which at least one operation of that kind and direction was in flight, so
``busy_bandwidth_bps = 8 * bytes / busy_s`` is the link rate while in use, not averaged
over idle wall time. On a paced link, busy time also includes the link time a message needed
beyond its wall time (:meth:`Metrics.add_busy`): the token bucket lets a message's first bytes
pass on credit banked while the link idled, so they leave in no wall time but still occupied
the emulated link; without it, goodput after small messages with gaps reads up to ~2x the link.

Concurrency: all methods take one lock; they are called from sender, reader and user threads.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict

KINDS = ("write", "call", "reply", "notify")


class _Counter:
    __slots__ = ("ops", "bytes", "failures", "busy_s", "inflight", "busy_since")

    def __init__(self):
        self.ops = self.bytes = self.failures = self.inflight = 0
        self.busy_s = 0.0
        self.busy_since = 0.0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._c = {d: defaultdict(_Counter) for d in ("tx", "rx")}
        self._scalars = defaultdict(int)

    def begin(self, direction: str, kind: str) -> None:
        """An operation of ``kind`` started moving bytes in ``direction`` ('tx' or 'rx')."""
        with self._lock:
            c = self._c[direction][kind]
            if c.inflight == 0:
                c.busy_since = time.monotonic()
            c.inflight += 1

    def end(self, direction: str, kind: str, nbytes: int, ok: bool) -> None:
        """The operation begun with :meth:`begin` finished (``ok``) or failed."""
        with self._lock:
            c = self._c[direction][kind]
            c.inflight -= 1
            assert c.inflight >= 0, (direction, kind)
            if c.inflight == 0:
                c.busy_s += time.monotonic() - c.busy_since
            if ok:
                c.ops += 1
                c.bytes += nbytes
            else:
                c.failures += 1

    def add_busy(self, direction: str, kind: str, seconds: float) -> None:
        """Count ``seconds`` more busy time for ``kind``: link time the pacer charged that the
        operation's wall-clock interval did not cover (bytes sent on banked credit)."""
        if not seconds >= 0:
            raise ValueError(f"busy time of {seconds} seconds must be >= 0")
        with self._lock:
            self._c[direction][kind].busy_s += seconds

    def fail(self, direction: str, kind: str) -> None:
        """An operation failed before it began moving bytes."""
        with self._lock:
            self._c[direction][kind].failures += 1

    def incr(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._scalars[name] += by

    def snapshot(self) -> dict:
        now = time.monotonic()
        with self._lock:
            out: dict = {}
            for d, table in self._c.items():
                out[d] = {}
                for kind in sorted(set(KINDS) | set(table)):
                    c = table[kind]
                    busy = c.busy_s + (now - c.busy_since if c.inflight else 0.0)
                    out[d][kind] = {"ops": c.ops, "bytes": c.bytes, "failures": c.failures,
                                    "busy_s": busy,
                                    "busy_bandwidth_bps": 8 * c.bytes / busy if busy > 0 else 0.0}
            for name in ("retries", "frames_rejected", "auth_failures", "connections_refused",
                         "peers_connected", "peers_failed"):
                out[name] = self._scalars[name]
            return out
