"""The prefill worker's bulk-lane pacer: proactive and speculative writes use only the bandwidth
on-demand replies leave idle (SmartGen §4.3).

Concurrency: `reserve` runs on the transport RPC thread that builds an on-demand reply, `consume`
on the bulk connection's sender thread; `_lock` guards `_busy_until`. No threads are started here.
"""
from __future__ import annotations

import threading
import time


class YieldToOnDemand:
    """The bulk lane's pacer: the worker's shared token bucket, but bulk chunks wait while an
    on-demand reply is draining (its bytes at the link rate) and take only banked credit (never
    debt), so speculative and proactive writes use only the bandwidth on-demand fetches leave idle (SmartGen §4.3: speculation
    fills idle bandwidth; on-demand rows are on the decode step's critical path)."""

    MAX_YIELD_S = 1.0

    def __init__(self, shared):
        self.shared = shared
        self._lock = threading.Lock()
        self._busy_until = 0.0

    @property
    def chunk(self) -> int:
        """A quarter of the link's chunk (>= 4 KiB): a reply that arrives while a bulk chunk holds
        the credit waits at most this long (a non-preemptible packet on a priority link)."""
        return max(4096, self.shared.chunk // 4)

    @property
    def rate_Bps(self) -> float:
        """The shared link's rate: the transport counts at least nbytes / rate_Bps of busy time per
        bulk message (link time sent on banked credit), so the link estimate reads the link."""
        return self.shared.rate_Bps

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._busy_until)
            self._busy_until = start + nbytes / self.shared.rate_Bps

    def consume(self, nbytes: int) -> float:
        slept = 0.0
        while True:
            with self._lock:
                wait = self._busy_until - time.monotonic()
            if wait <= 0 or slept >= self.MAX_YIELD_S:  # bounded, so the bulk lane never looks dead
                # credit only: a reply starting meanwhile never waits behind this chunk's debt
                return slept + self.shared.consume_credit(nbytes)
            time.sleep(min(wait, 0.05))
            slept += min(wait, 0.05)
