"""Payload checksums off the socket threads: a side thread that crc32c's byte ranges in order.

A large payload's crc32c travels in a 4-byte trailer right after the payload (``wire.FLAG_TRAILER``),
so neither side has to finish the checksum before the bytes move:

* sender: hands the whole payload to its connection's :class:`ChecksumWorker` and starts writing
  at once; the checksum runs on the side thread while the socket copies, and the sender waits for
  it only to append the trailer;
* receiver: receives the payload piece by piece, hands each landed piece to its worker (pieces of
  one payload are checksummed in arrival order, continuing the running value) and keeps
  receiving; after the payload it reads the trailer and compares.

``crc32c`` (the ``crc32c`` package, what :func:`transport.wire.crc32c` calls) releases the GIL while
it runs, so the side thread and the socket thread really overlap on two cores.

Concurrency: one worker per connection and direction, started on first use by the thread that owns
the direction (sender or reader) and closed by that thread when it exits (:meth:`close` joins it,
so no thread outlives its connection). :meth:`begin` / :meth:`Running.add` / :meth:`Running.result`
are called by that one owning thread; the side thread only reads the views it is given and sets
each payload's result.
"""
from __future__ import annotations

import queue
import threading

from transport.wire import crc32c


class Running:
    """The checksum of one payload in progress: pieces added in order, the value once ``finish``ed."""

    __slots__ = ("_worker", "_done", "value", "error")

    def __init__(self, worker: "ChecksumWorker"):
        self._worker = worker
        self._done = threading.Event()
        self.value = 0
        self.error: BaseException | None = None

    def add(self, view) -> None:
        """Queue the next piece of the payload (a bytes-like that stays unchanged until ``result``)."""
        self._worker._q.put((self, view))

    def result(self, timeout: float | None = None) -> int:
        """Mark the payload complete and wait for its crc32c (continuing from 0)."""
        self._worker._q.put((self, None))
        if not self._done.wait(timeout):
            raise TimeoutError(f"checksum not done after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.value


class ChecksumWorker:
    """One side thread computing running crc32c values of queued pieces, in queue order."""

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
            item = self._q.get()
            if item is None:
                return
            running, view = item
            if view is None:
                running._done.set()
            elif running.error is None:
                try:
                    running.value = crc32c(view, running.value)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting owner thread
                    running.error = e

    def close(self) -> None:
        """Stop and join the side thread (pieces already queued are still checksummed first)."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
