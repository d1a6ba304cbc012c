"""Sender-side pacing: bandwidth strings and a token bucket.

A :class:`TokenBucket` emulates a thin link on one machine: the sender thread calls
:meth:`TokenBucket.consume` before putting each chunk on the wire and sleeps while the
bucket is in debt. Debt (rather than waiting for a full chunk of tokens) keeps the long-run
rate exact for any chunk size: after ``t`` seconds at most ``rate * t + burst`` bytes left.

Concurrency: one bucket may be shared by the sender threads of several peers (the
per-endpoint limit); :meth:`consume` takes an internal lock only to book the tokens and
sleeps outside it, so peers share the rate fairly in arrival order.
"""
from __future__ import annotations

import re
import threading
import time

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s)?\s*(?:/s)?\s*$")


def parse_bandwidth(value: str | float | int) -> float:
    """Bits per second from ``"10gbit"``, ``"100mbit"``, ``"2.5Gbps"``, ``"1.25GB/s"`` or a number.

    ``bit``/``bps`` suffixes are bits per second (networking convention, note that ``tc``
    reads ``mbps`` as megabytes); ``B/s`` with a capital B is bytes per second.
    """
    if isinstance(value, bool):
        raise ValueError(f"bandwidth={value!r} must be a string like '10gbit' or bits/s")
    if isinstance(value, (int, float)):
        bits = float(value)
    else:
        text = str(value)
        m = _BW_RE.match(text.lower())
        if not m or (m.group(3) is None and m.group(2)):
            raise ValueError(f"bandwidth={value!r} is not understood; use e.g. '100mbit', "
                             f"'10gbit', '2.5gbps' (bits/s) or '1.25GB/s' (bytes/s)")
        bits = float(m.group(1)) * _UNITS[m.group(2)]
        if m.group(3) == "b/s" and "B/s" in text:
            bits *= 8
    if not bits > 0 or bits == float("inf"):
        raise ValueError(f"bandwidth={value!r} must be a positive finite rate")
    return bits


class TokenBucket:
    """Token bucket in bytes. ``rate_bps`` in bits per second; ``burst`` in bytes.

    The bucket starts empty. The default burst (10 ms of traffic, at least 64 KiB) caps the
    credit a sender banks while idle or descheduled: large enough to keep the long-run rate
    exact on a loaded machine, small enough that a transfer starting after an idle period
    overshoots a 1 s average by at most 1 % (like ``tc tbf``'s own burst).
    """

    def __init__(self, rate_bps: float | str, burst: int | None = None):
        self.rate_bps = parse_bandwidth(rate_bps)
        self.rate_Bps = self.rate_bps / 8.0
        self.burst = int(burst) if burst is not None else max(65536, int(self.rate_Bps * 0.01))
        if self.burst <= 0:
            raise ValueError(f"burst={burst} must be > 0 bytes")
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    @property
    def chunk(self) -> int:
        """Bytes the sender should put on the wire between two :meth:`consume` calls."""
        return max(4096, min(1 << 20, self.burst // 4))

    def consume(self, nbytes: int) -> float:
        """Book ``nbytes``; sleep until the bucket is out of debt. Returns seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_Bps)
            self._stamp = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate_Bps if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait

    def consume_credit(self, nbytes: int) -> float:
        """Book ``nbytes`` out of banked credit only: sleep until the bucket holds them (at most
        ``burst``), never sending on debt. A low-priority sender uses this so that a sender
        calling :meth:`consume` meanwhile never waits behind its chunk (strict priority, as a
        link with priority queues and small packets). Returns seconds slept."""
        need = min(int(nbytes), self.burst)
        slept = 0.0
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_Bps)
                self._stamp = now
                if self._tokens >= need:
                    self._tokens -= nbytes
                    return slept
                wait = (need - self._tokens) / self.rate_Bps
            time.sleep(wait)
            slept += wait
