"""Live effective-bandwidth estimate B for the compression controller (KVServe §3.1, §6).

B is application-level goodput under contention, not the nominal link rate. The transport reports,
for each finished transfer, the bytes it moved and the time the link was *busy* moving them (idle
gaps between requests excluded, so a lightly loaded link is not mistaken for a slow one). The
estimate is an EWMA over these goodput samples.

Concurrency: `observe` is called from transport threads and `estimate` from the request path; a
lock guards the two floats of state. No threads are started here.
"""
from __future__ import annotations

import threading


class BandwidthEstimator:
    """EWMA of busy-time goodput samples, bytes/s."""

    def __init__(self, alpha: float = 0.3, initial_Bps: float | None = None):
        if not 0 < alpha <= 1:
            raise ValueError(f"{alpha=} must be in (0, 1]")
        if initial_Bps is not None and not initial_Bps > 0:
            raise ValueError(f"{initial_Bps=} must be > 0 (or None for 'unknown until the first sample')")
        self.alpha = alpha
        self._estimate = initial_Bps
        self._samples = 0
        self._lock = threading.Lock()

    def observe(self, nbytes: int, busy_s: float) -> float:
        """Record `nbytes` moved during `busy_s` seconds of link activity; returns the sample (B/s)."""
        if nbytes < 0 or not busy_s > 0:
            raise ValueError(f"goodput sample needs {nbytes=} >= 0 and {busy_s=} > 0")
        sample = nbytes / busy_s
        with self._lock:
            if self._estimate is None:
                self._estimate = sample
            else:
                self._estimate = (1 - self.alpha) * self._estimate + self.alpha * sample
            self._samples += 1
        return sample

    def reset(self, initial_Bps: float | None) -> None:
        """Forget the samples and start again from `initial_Bps` (a link re-paced to a known rate)."""
        if initial_Bps is not None and not initial_Bps > 0:
            raise ValueError(f"{initial_Bps=} must be > 0 (or None)")
        with self._lock:
            self._estimate, self._samples = initial_Bps, 0

    def estimate(self) -> float | None:
        """Current B in bytes/s, or None before any sample (and without an initial value)."""
        with self._lock:
            return self._estimate

    @property
    def samples(self) -> int:
        with self._lock:
            return self._samples
