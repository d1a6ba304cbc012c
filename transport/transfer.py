"""Per-operation state and completion: :class:`Transfer` is the future every operation returns.

State machine (SmartGen-style explicit state, never inferred from side effects)::

    CONNECTING ──> TRANSFERRING ──> COMPLETE
         │               │
         └───────────────┴──────> FAILED(reason)

CONNECTING: queued, waiting for the peer's connection / sender thread. TRANSFERRING: the
first byte is on the wire. COMPLETE: the peer acknowledged that every byte (and the trailing
mask write) is applied, or the RPC reply arrived. FAILED: ``reason`` says why and
``error`` is the :class:`~transport.errors.TransportError` that :meth:`Transfer.result` raises.

Concurrency: any thread may complete or fail a transfer (sender, reader, watchdog, close);
the first terminal transition wins and later ones are ignored. Waiters block on a Condition.
Callbacks run in the thread that completed the transfer and must not block.
"""
from __future__ import annotations

import enum
import threading
import time
from typing import Any, Callable, Iterable

from transport.errors import OpTimeout, TransportError


class TransferState(enum.Enum):
    CONNECTING = "connecting"
    TRANSFERRING = "transferring"
    COMPLETE = "complete"
    FAILED = "failed"


class Transfer:
    """Future for one operation (``write``, ``write_many``, ``call``, ``notify``)."""

    def __init__(self, kind: str, peer: str, nbytes: int, deadline: float | None = None,
                 method: str | None = None):
        self.kind = kind
        self.method = method  # calls: the RPC method (observers tell e.g. "fetch" round trips apart)
        self.peer = peer
        self.nbytes = nbytes
        self.deadline = deadline  # time.monotonic() after which the watchdog fails it
        self.created_at = time.monotonic()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._state = TransferState.CONNECTING
        self._value: Any = None
        self._error: TransportError | None = None
        self._cond = threading.Condition()
        self._callbacks: list[Callable[[Transfer], None]] = []

    def __repr__(self) -> str:
        reason = f" reason={self.reason!r}" if self._error else ""
        return f"<Transfer {self.kind} to {self.peer} {self.nbytes}B {self._state.name}{reason}>"

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def reason(self) -> str | None:
        return str(self._error) if self._error else None

    @property
    def error(self) -> TransportError | None:
        return self._error

    def done(self) -> bool:
        return self._state in (TransferState.COMPLETE, TransferState.FAILED)

    def start(self) -> bool:
        """CONNECTING -> TRANSFERRING. False if already terminal (timed out while queued)."""
        with self._cond:
            if self._state is not TransferState.CONNECTING:
                return self._state is TransferState.TRANSFERRING
            self._state = TransferState.TRANSFERRING
            self.started_at = time.monotonic()
            return True

    def complete(self, value: Any = None) -> bool:
        return self._finish(TransferState.COMPLETE, value, None)

    def fail(self, error: TransportError) -> bool:
        return self._finish(TransferState.FAILED, None, error)

    def _finish(self, state, value, error) -> bool:
        with self._cond:
            if self.done():
                return False
            self._state, self._value, self._error = state, value, error
            self.finished_at = time.monotonic()
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for cb in callbacks:
            cb(self)
        return True

    def add_done_callback(self, fn: Callable[["Transfer"], None]) -> None:
        with self._cond:
            if not self.done():
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Block until terminal. Raises the transfer's error if it FAILED, OpTimeout if
        ``timeout`` seconds pass first (the transfer itself keeps going)."""
        with self._cond:
            if not self._cond.wait_for(self.done, timeout):
                raise OpTimeout(f"{self!r} not done after waiting {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def result(self, timeout: float | None = None) -> Any:
        """The operation's value (reply bytes / memoryview for calls, None otherwise)."""
        self.wait(timeout)
        return self._value

    @property
    def elapsed(self) -> float | None:
        """Seconds from the first byte on the wire to completion (None until done). The time
        queued before that is ``started_at - created_at``."""
        if self.finished_at is None or self.started_at is None:
            return None
        return self.finished_at - self.started_at


def wait_all(transfers: Iterable[Transfer], timeout: float | None = None) -> None:
    """Wait for every transfer; raise the first failure (after all are terminal or time is up)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    first_error = None
    for t in transfers:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            t.wait(left)
        except TransportError as e:
            first_error = first_error or e
    if first_error is not None:
        raise first_error
