"""Payload digests off the socket threads: a side thread that hashes byte ranges in order.

A large payload's XXH3-64 digest travels in an 8-byte trailer right after the payload
(``wire.FLAG_TRAILER``; why XXH3 and not crc32c there: :mod:`transport.wire`),
so neither side has to finish the checksum before the bytes move:

* sender: hands the payload to its connection's :class:`ChecksumWorker` (in pieces of ``PIECE``
  bytes) and starts writing at once; the side thread checksums while the socket copies, and the
  sender needs the value only to append the trailer;
* receiver: receives the payload piece by piece and hands each landed piece to its worker (pieces
  of one payload are hashed in arrival order into one streaming state) while it keeps
  receiving; after the payload it reads the trailer and compares.

``xxhash`` (what :func:`transport.wire.trailer_hasher` returns) releases the GIL while it hashes,
so the side thread and the socket thread really overlap when a core is free.

Work stealing: when the owner asks for the value (:meth:`Running.result`) it checksums the pieces the
side thread has not reached yet itself, and waits only for a piece the side thread is in the middle
of. On a machine with no spare core (the side thread not scheduled in time) this degrades to the
owner checksumming inline, as it would without a side thread, instead of waiting a scheduler
quantum for it.

Concurrency: one worker per connection and direction, started on first use by the thread that owns
the direction (sender or reader) and closed by that thread when it exits (:meth:`close` joins it,
so no thread outlives its connection). ``begin``/``add``/``result`` are called by that owning thread
only. A payload's pieces are taken in order under the payload's lock, one at a time, by whichever
thread is free; the streaming state is only updated by the thread that holds the piece.
"""
from __future__ import annotations

import collections
import os
import queue
import threading

from transport.wire import trailer_hasher

PIECE = 256 * 1024  # stealing granularity: the most the owner ever waits for is one piece in progress
OFFLOAD_MIN_CPUS = 4  # a side thread pays off only with a core to run on (see offload_default)


def offload_default() -> bool:
    """Whether payload checksums go to side threads by default: only when this process may run
    on at least OFFLOAD_MIN_CPUS cores. Each side of a connection already keeps one core busy
    with its socket copies; on fewer cores the side thread shares a core with them, so it adds
    hand-offs and a cross-core re-read of every piece without any overlap. Measured on 2 cores
    (experiments/bench_transport.py, CPU seconds per GiB moved, sender + receiver): with crc32c
    trailers offloaded 1.45 (1 MiB writes) / 0.89 (16 MiB), inline 1.01 / 0.77; with XXH3 trailers
    (AMD EPYC, 2026-12-03) offloaded 0.51 / 0.35 at 0.56x / 0.78x a raw socket's rate, inline
    0.39-0.43 / 0.32-0.34 at 0.76-0.81x / 0.87-0.92x."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return cpus >= OFFLOAD_MIN_CPUS


class Inline:
    """The digest of a payload computed at once on the calling thread (the :class:`Running`
    interface, for connections that do not offload)."""

    __slots__ = ("value",)

    def __init__(self, parts):
        h = trailer_hasher()
        for p in parts:
            h.update(p)
        self.value = h.intdigest()

    def result(self) -> int:
        return self.value


class Running:
    """The digest of one payload in progress: pieces added in order, the value once complete."""

    __slots__ = ("_worker", "_cond", "_pieces", "_busy", "_hasher", "error")

    def __init__(self, worker: "ChecksumWorker"):
        self._worker = worker
        self._cond = threading.Condition(threading.Lock())
        self._pieces: collections.deque = collections.deque()
        self._busy = False  # a thread is hashing the piece it took
        self._hasher = trailer_hasher()  # updated only by the thread that holds a piece
        self.error: BaseException | None = None

    def add(self, view) -> None:
        """Queue the next bytes of the payload (a bytes-like that stays unchanged until ``result``)."""
        view = memoryview(view)
        with self._cond:
            for start in range(0, len(view), PIECE):
                self._pieces.append(view[start:start + PIECE])
        self._worker._q.put(self)

    def _work(self) -> None:
        """Checksum queued pieces in order until none is left or another thread holds one."""
        while True:
            with self._cond:
                if self._busy or not self._pieces or self.error is not None:
                    return
                piece, self._busy = self._pieces.popleft(), True
            try:
                self._hasher.update(piece)
            except BaseException as e:  # noqa: BLE001 - handed to the owner thread by result()
                with self._cond:
                    self.error, self._busy = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def result(self) -> int:
        """The digest of everything added; hashes what the side thread has not reached."""
        while True:
            self._work()
            with self._cond:
                while self._busy:
                    self._cond.wait()
                if self.error is not None:
                    raise self.error
                if not self._pieces:
                    return self._hasher.intdigest()


class ChecksumWorker:
    """One side thread that works on queued payloads (:class:`Running`) in the order they come."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def begin(self) -> Running:
        """Start checksumming a new payload (starts the side thread on first use)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name=self.name)
            self._thread.start()
        return Running(self)

    def _loop(self) -> None:
        while True:
            running = self._q.get()
            if running is None:
                return
            running._work()

    def close(self) -> None:
        """Stop and join the side thread."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
