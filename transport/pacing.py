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

    The bucket starts empty. ``burst`` caps the credit banked while the link idles: by default
    ``burst_s`` (DEFAULT_BURST_S = 5 ms) of link time or one :attr:`chunk`, whichever is larger,
    like a real shaper (``tc tbf`` needs a burst of at least rate/HZ and one MTU; a few ms is
    typical). A larger bank would let a small message that follows an idle gap leave faster than
    the link (a 20 KB reply after 30 ms of idle would take no time at all).

    Idle time is not the only time the bucket sees pass: a sender in the middle of a message
    that slept in :meth:`consume` and woke up late on a loaded machine (or was descheduled while
    writing a chunk) was *busy* meanwhile (a real NIC keeps draining its queue). A call of a
    full :attr:`chunk` says more of the message follows (senders cut messages into chunks, the
    last piece shorter), so the same thread's next call within ``DEFAULT_LATE_S`` banks the time
    since up to ``late_cap`` (that much link time, at least 64 KiB), which keeps the long-run
    rate exact on a loaded machine; any other call (a new message after idle) gets at most
    ``burst``.
    """

    DEFAULT_BURST_S = 0.005
    DEFAULT_LATE_S = 0.020
    MIN_CHUNK, MAX_CHUNK = 4096, 1 << 20

    def __init__(self, rate_bps: float | str, burst: int | None = None, burst_s: float | None = None):
        if burst_s is not None and not 0 < burst_s < 10:
            raise ValueError(f"burst_s={burst_s!r} must be in (0, 10) seconds, e.g. 0.005 (5 ms of link time)")
        if burst is not None and int(burst) <= 0:
            raise ValueError(f"burst={burst} must be > 0 bytes")
        self._burst_arg = None if burst is None else int(burst)
        self.burst_s = self.DEFAULT_BURST_S if burst_s is None else float(burst_s)
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._lock = threading.Lock()
        self._returned: dict[int, float] = {}  # thread id -> when its last full-chunk consume returned
        self.set_rate(rate_bps)

    def set_rate(self, rate_bps: float | str) -> None:
        """Re-pace (thread-safe); the default burst and chunk follow the new rate."""
        bps = parse_bandwidth(rate_bps)
        with self._lock:
            self.rate_bps, self.rate_Bps = bps, bps / 8.0
            self._chunk = int(max(self.MIN_CHUNK, min(self.MAX_CHUNK, self.rate_Bps * self.burst_s)))
            self.burst = self._burst_arg if self._burst_arg is not None else max(
                self._chunk, int(self.rate_Bps * self.burst_s))
            self.late_cap = max(self.burst, 65536, int(self.rate_Bps * self.DEFAULT_LATE_S))
            self._tokens = min(self._tokens, self.burst)  # credit banked at the old rate does not carry over

    @property
    def chunk(self) -> int:
        """Bytes the sender should put on the wire between two :meth:`consume` calls (never above
        ``burst``, so one chunk always fits the bank)."""
        return max(1, min(self._chunk, self.burst))

    def _refill(self, now: float) -> None:
        """Under the lock: add the credit since the last booking (capped, see the class doc)."""
        cap = self.burst
        back = self._returned.get(threading.get_ident())
        if back is not None and now - back <= self.DEFAULT_LATE_S:
            cap = self.late_cap  # the same message continues: the link was busy meanwhile
        self._tokens = min(cap, self._tokens + (now - self._stamp) * self.rate_Bps)
        self._stamp = now

    def consume(self, nbytes: int) -> float:
        """Book ``nbytes``; sleep until the bucket is out of debt. Returns seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._refill(now)
            self._tokens -= nbytes
            wait = -self._tokens / self.rate_Bps if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        with self._lock:
            if len(self._returned) > 256:  # short-lived sender threads
                self._returned.clear()
            if nbytes >= self.chunk:  # a full chunk: more of this message follows
                self._returned[threading.get_ident()] = time.monotonic()
            else:
                self._returned.pop(threading.get_ident(), None)
        return wait

    def consume_credit(self, nbytes: int) -> float:
        """Book ``nbytes`` out of banked credit only: sleep until the bucket holds them (at most
        ``burst``), never sending on debt. A low-priority sender uses this so that a sender
        calling :meth:`consume` meanwhile never waits behind its chunk (strict priority, as a
        link with priority queues and small packets). Returns seconds slept."""
        slept = 0.0
        while True:
            with self._lock:
                now = time.monotonic()
                need = min(int(nbytes), self.burst)
                self._refill(now)
                if self._tokens >= need:
                    self._tokens -= nbytes
                    return slept
                wait = (need - self._tokens) / self.rate_Bps
            time.sleep(wait)
            slept += wait
