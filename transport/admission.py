"""Admission of incoming connections: a cap on unauthenticated ones and a quiet refusal log.

An endpoint's acceptor thread asks :class:`HandshakeGate` for a slot before it starts a
handshake thread; over the cap (``Endpoint(max_handshakes=)``) the connection is refused at
once, so idle or slow unauthenticated connections cost at most ``max_handshakes`` threads and
sockets, each for at most ``handshake_timeout`` seconds. Refusals (cap, failed
authentication, deadline) go through :class:`RefusalLog`, which logs the first one of a quiet
period in full and then one summary line per ``interval`` with the count, so a flood of bad
connections cannot flood the log.

:class:`Acceptor` runs the accept loop (thread ``jkvt-accept-<name>``) and the short-lived
``jkvt-auth-<name>`` handshake threads; ``close()`` joins them all.

Concurrency: the gate and the log take their own lock; the acceptor and the handshake threads
call them.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from transport.auth import BUSY_PREFIX, send_frame
from transport.wire import Op


class HandshakeGate:
    """At most ``limit`` handshakes in progress at once."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_handshakes={limit!r} must be an int >= 1")
        self.limit = limit
        self._lock = threading.Lock()
        self._active = 0

    def try_enter(self) -> bool:
        """Take a slot; False when ``limit`` handshakes are already in progress."""
        with self._lock:
            if self._active >= self.limit:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            assert self._active > 0, "leave() without a matching try_enter()"
            self._active -= 1

    @property
    def active(self) -> int:
        with self._lock:
            return self._active


class RefusalLog:
    """WARNING for refused incoming connections, at most one line per ``interval`` seconds:
    the first refusal after a quiet interval is logged with its reason; the ones after it are
    counted and summarised (count and latest reason) when the interval ends (:meth:`flush`,
    called periodically by the acceptor, or by the next refusal)."""

    def __init__(self, logger: logging.Logger, endpoint: str, interval: float = 10.0, clock=time.monotonic):
        if not interval > 0:
            raise ValueError(f"interval={interval} must be > 0 seconds")
        self.logger, self.endpoint, self.interval, self.clock = logger, endpoint, interval, clock
        self._lock = threading.Lock()
        self._window_end: float | None = None  # None: quiet, the next refusal is logged at once
        self._suppressed = 0
        self._latest = ""

    def refused(self, reason: str) -> None:
        with self._lock:
            now = self.clock()
            self._flush(now)
            if self._window_end is None:
                self.logger.warning("%r refused an incoming connection: %s", self.endpoint, reason)
                self._window_end = now + self.interval
            else:
                self._suppressed += 1
                self._latest = reason

    def flush(self, force: bool = False) -> None:
        """Write the summary line of an interval that has ended (any pending one if ``force``)."""
        with self._lock:
            self._flush(self.clock(), force)

    def _flush(self, now: float, force: bool = False) -> None:
        if self._window_end is None or not (force or now >= self._window_end):
            return
        if self._suppressed:
            self.logger.warning("%r refused %d more incoming connections in the last %.0fs (latest: %s)",
                                self.endpoint, self._suppressed, self.interval, self._latest)
            self._suppressed = 0
            self._window_end = now + self.interval  # still busy: the next line waits a full interval
        else:
            self._window_end = None


class Acceptor:
    """Accept loop of a listening endpoint: each connection gets a gate slot and a handshake
    thread running ``authenticate(sock)`` (which owns the socket from then on), or is refused
    at once when ``gate`` is full. Handshake threads end by their deadline, so they never
    accumulate past ``gate.limit``."""

    def __init__(self, listener: socket.socket, name: str, authenticate: Callable[[socket.socket], None],
                 gate: HandshakeGate, refusals: RefusalLog, metrics):
        self.listener, self.name, self.authenticate = listener, name, authenticate
        self.gate, self.refusals, self.metrics = gate, refusals, metrics
        listener.settimeout(0.1)  # accept polls so close() never waits on a blocked accept
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._handshakes: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"jkvt-accept-{name}")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close the listener, wait for the handshakes in progress."""
        self._stop.set()
        self._thread.join()
        self.listener.close()
        with self._lock:
            handshakes = list(self._handshakes)
        for t in handshakes:
            t.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refusals.flush()
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            if not self.gate.try_enter():
                self._refuse_busy(sock)
                continue
            t = threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                                 name=f"jkvt-auth-{self.name}")
            with self._lock:
                self._handshakes = {x for x in self._handshakes if x.is_alive()}
                self._handshakes.add(t)
            t.start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            self.authenticate(sock)
        finally:
            self.gate.leave()

    def _refuse_busy(self, sock: socket.socket) -> None:
        """Over the cap: a best-effort ERROR frame the client can act on, then close. Never
        blocks the acceptor: a client that does not read simply misses the reason."""
        self.metrics.incr("connections_refused")
        reason = f"{BUSY_PREFIX} {self.gate.limit} unauthenticated connections already (max_handshakes)"
        try:
            sock.setblocking(False)
            send_frame(sock, Op.ERROR, reason.encode(), 1)
        except OSError:
            pass
        sock.close()
        self.refusals.refused(reason)
