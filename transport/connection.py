"""One authenticated connection to a peer: the framed, ordered data plane of ``tcp``/``shm``.

Threads per connection (named ``jkvt-tx-<local>-><peer>`` / ``jkvt-rx-<local><-<peer>``):

* **sender** — the only thread that writes to the socket. It sends queued control frames
  (ACK, CREDIT, PING, ERROR) between frames and user operations from a FIFO queue, one
  frame at a time, pacing payload chunks with the token buckets. Frames of one operation
  are contiguous on the stream, so a block and its trailing mask write are applied in order.
* **reader** — the only thread that reads. It validates each header (checksum, sequence,
  op, region, bounds, size) *before* a payload byte is written, receives WRITE payloads
  straight into the registered region's memoryview (tcp: ``recv_into``; shm: one copy out
  of the ring), verifies the payload crc32c, and only then processes the next frame — so
  the mask frame after a block is applied after the block is complete. It never blocks on
  sending (control frames are queued for the sender), which rules out the classic
  both-sides-sending deadlock. RPC requests go to the endpoint's handler pool and
  notifications to its dispatcher thread.

A payload crc mismatch is detected after the bytes landed (the receive is zero-copy);
the frame is then rejected: no ACK, the connection closes, and the trailing mask frame is
never applied, so a mask value never vouches for damaged bytes.

Failure: :meth:`Connection.fail` is idempotent; the first reason wins, every queued and
pending operation fails with it, and the socket is shut down, which wakes both threads.
The endpoint's watchdog calls :meth:`Connection.tick` to send heartbeats, detect a silent
peer and expire operations past their deadline.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from transport.errors import FrameError, OpTimeout, PeerDeadError, RemoteError, TransportError
from transport.pacing import TokenBucket
from transport.shm import ShmRing
from transport.transfer import Transfer
from transport.wire import (FLAG_ACK, FLAG_ERR, FLAG_NOCRC, HEADER_SIZE, Header, Op, crc32c, decode_header,
                            encode_header, unpack_named)

log = logging.getLogger(__name__)

_SMALL = 64 * 1024  # header and payload below this go out in one sendall
_RECV_CHUNK = 4 << 20  # recv_into at most this much per call so liveness stays fresh
_COPY_CHUNK = 1 << 20  # shm: copy out of the ring and checksum in cache-sized pieces
_MAX_ERROR_TEXT = 4096


@dataclass
class Frame:
    op: Op
    payload: list = field(default_factory=list)  # flat uint8 memoryviews / bytes
    region: int = 0
    offset: int = 0
    aux: int = 0
    flags: int = 0
    crc: int = -1  # payload crc32c; computed by the submitting thread (see __post_init__)

    def __post_init__(self):
        # The submitting (user / handler) thread pays for the checksum, so the sender thread
        # only moves bytes and checksumming overlaps with the previous frame's send.
        if self.flags & FLAG_NOCRC:
            self.crc = 0
        elif self.crc < 0:
            crc = 0
            for p in self.payload:
                crc = crc32c(p, crc)
            self.crc = crc

    @property
    def length(self) -> int:
        return sum(len(p) for p in self.payload)


@dataclass(eq=False)
class Operation:
    transfer: Transfer
    frames: list[Frame]
    expects: str  # "ack" (write/notify), "reply" (call), "none" (reply)
    reply_into: memoryview | None = None
    wait_seq: int = 0


class ConnectionHost(Protocol):
    """What a Connection needs from the endpoint that owns it (:class:`transport.Endpoint`)."""

    name: str
    metrics: object  # transport.metrics.Metrics
    regions: object  # transport.region.RegionTable
    timeout: float  # seconds of peer silence before the connection fails
    heartbeat: float  # seconds without sending before a PING goes out
    max_message: int
    payload_checksum: bool

    def incoming_call(self, conn: "Connection", seq: int, method: str, payload: memoryview) -> None:
        """Reader thread: a CALL arrived; the reply is submitted on ``conn`` later."""

    def incoming_notify(self, conn: "Connection", kind: str, payload: memoryview) -> None:
        """Reader thread: a NOTIFY arrived (must not block)."""

    def connection_failed(self, conn: "Connection", error: TransportError) -> None:
        """Once, from whichever thread failed ``conn`` first."""

    def connection_closed(self, conn: "Connection") -> None:
        """Reader thread, last: both threads are done and the socket is closed."""


class Connection:
    def __init__(self, host: ConnectionHost, sock: socket.socket, peer_name: str, *,
                 pacers: list[TokenBucket] = (), ring_tx: ShmRing | None = None,
                 ring_rx: ShmRing | None = None):
        self.host = host  # the Endpoint: regions, metrics, handlers, timeouts
        self.sock = sock
        self.peer_name = peer_name
        self.pacers = list(pacers)
        self.ring_tx, self.ring_rx = ring_tx, ring_rx
        self.failed: TransportError | None = None
        self.last_rx = self.last_tx = time.monotonic()
        self._cond = threading.Condition()
        self._ops: collections.deque[Operation] = collections.deque()
        self._control: collections.deque[tuple[Header, bytes]] = collections.deque()
        self._pending: dict[int, Operation] = {}
        self._inflight: Operation | None = None  # op whose frames the sender is writing
        self._seq_tx = 0
        self._seq_rx = 0
        self._ping_queued = False
        self._farewell: tuple[Header, bytes] | None = None  # ERROR frame sent before closing
        self._rx_consumed = 0  # shm: ring bytes consumed (monotonic)
        self._rx_reported = 0
        local = host.name
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"jkvt-tx-{local}->{peer_name}")
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"jkvt-rx-{local}<-{peer_name}")

    def start(self) -> None:
        self._sender.start()
        self._reader.start()

    # ---------------------------------------------------------------- submission
    def submit(self, op: Operation) -> Transfer:
        with self._cond:
            if self.failed is not None:
                err = self.failed
            else:
                self._ops.append(op)
                self._cond.notify_all()
                return op.transfer
        self.host.metrics.fail("tx", op.transfer.kind)
        op.transfer.fail(PeerDeadError(f"connection to {self.peer_name!r} is down: {err}"))
        return op.transfer

    def _control_frame(self, op: Op, aux: int = 0, payload: bytes = b"") -> None:
        h = Header(op, 0, 0, 0, 0, len(payload), aux, crc32c(payload))
        with self._cond:
            if self.failed is None:
                self._control.append((h, payload))
                self._cond.notify_all()

    # ---------------------------------------------------------------- failure / liveness
    def fail(self, error: TransportError, farewell: str | None = None) -> bool:
        """Tear the connection down; every queued and pending operation fails with ``error``."""
        with self._cond:
            if self.failed is not None:
                return False
            self.failed = error
            if farewell is not None:
                text = farewell.encode()[:_MAX_ERROR_TEXT]
                self._farewell = (Header(Op.ERROR, 0, 0, 0, 0, len(text), 0, crc32c(text)), text)
            ops = list(self._ops) + list(self._pending.values())
            if self._inflight is not None:
                ops.append(self._inflight)
            self._ops.clear()
            self._pending.clear()
            self._cond.notify_all()
        log.info("connection %s<->%s closed: %s", self.host.name, self.peer_name, error)
        for op in ops:
            op.transfer.fail(error)
        if farewell is not None and threading.current_thread() is not self._sender:
            self._sender.join(timeout=1.0)  # let the sender put the ERROR frame on the wire
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.host.connection_failed(self, error)
        return True

    def tick(self, now: float) -> None:
        """Watchdog: heartbeat, dead-peer detection, per-operation deadlines."""
        if self.failed is not None:
            return
        silent = now - self.last_rx
        if silent > self.host.timeout:
            self.fail(PeerDeadError(f"peer {self.peer_name!r} silent for {silent:.2f}s "
                                    f"(liveness timeout {self.host.timeout}s)"))
            return
        expired = []
        with self._cond:
            if now - self.last_tx > self.host.heartbeat and not self._ping_queued:
                self._ping_queued = True
                self._control.append((Header(Op.PING), b""))
                self._cond.notify_all()
            for seq, op in list(self._pending.items()):
                if op.transfer.deadline is not None and now > op.transfer.deadline:
                    del self._pending[seq]
                    expired.append(op)
            candidates = list(self._ops) + ([self._inflight] if self._inflight else [])
            expired += [op for op in candidates
                        if op.transfer.deadline is not None and now > op.transfer.deadline]
        for op in expired:
            t = op.transfer
            t.fail(OpTimeout(f"{t.kind} to {self.peer_name!r} ({t.nbytes} B) did not complete "
                             f"within its {t.deadline - t.created_at:.3g}s timeout "
                             f"(state was {t.state.name})"))

    def join(self, timeout: float | None = None) -> None:
        self._sender.join(timeout)
        self._reader.join(timeout)

    # ---------------------------------------------------------------- sender thread
    def _next_seq(self) -> int:
        self._seq_tx += 1
        return self._seq_tx

    def _send_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._control or self._ops or self.failed):
                        self._cond.wait()
                    if self.failed is not None:
                        break
                    op = self._ops.popleft() if self._ops else None
                    self._inflight = op
                self._flush_control()
                if op is not None:
                    self._send_op(op)
                    with self._cond:
                        self._inflight = None
            if self._farewell is not None:
                self.sock.settimeout(1.0)
                self._send_frame(*self._farewell, paced=False)
        except OSError as e:
            self.fail(PeerDeadError(f"sending to {self.peer_name!r} failed: {e}"))
        except TransportError as e:
            self.fail(e)

    def _flush_control(self) -> None:
        while True:
            with self._cond:
                if not self._control or self.failed is not None:
                    return
                h, payload = self._control.popleft()
                if h.op == Op.PING:
                    self._ping_queued = False
            self._send_frame(h, payload, paced=False)

    def _send_op(self, op: Operation) -> None:
        t = op.transfer
        if not t.start():
            return  # expired while queued
        self.host.metrics.begin("tx", t.kind)
        t.add_done_callback(lambda tr: self.host.metrics.end("tx", tr.kind, tr.nbytes,
                                                             tr.error is None))
        for i, frame in enumerate(op.frames):
            if t.done():
                return  # timed out mid-operation; the remaining frames are not sent
            self._flush_control()
            last = i == len(op.frames) - 1
            flags = frame.flags | (FLAG_ACK if last and op.expects == "ack" else 0)
            payload = frame.payload
            aux = frame.aux
            if frame.op == Op.WRITE and self.ring_tx is not None:
                aux = self._ring_put(payload)
                payload = []
                wire_len = frame.length
            else:
                wire_len = None
            crc = frame.crc
            with self._cond:
                seq = self._next_seq()
                if last and op.expects != "none":
                    op.wait_seq = seq
                    self._pending[seq] = op
            h = Header(frame.op, flags, frame.region, seq, frame.offset,
                       frame.length if wire_len is None else wire_len, aux, crc)
            self._send_frame(h, payload, paced=self.ring_tx is None)
        if op.expects == "none":
            t.complete()

    def _send_frame(self, h: Header, payload, paced: bool) -> None:
        if h.seq == 0:
            with self._cond:
                h = Header(h.op, h.flags, h.region, self._next_seq(), h.offset, h.length,
                           h.aux, h.payload_crc)
        hdr = encode_header(h)
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        total = sum(len(p) for p in parts)
        if paced and self.pacers and total:
            self.sock.sendall(hdr)
            for p in parts:
                self._paced_sendall(p)
        elif total <= _SMALL:
            self.sock.sendall(b"".join([hdr, *parts]))
        else:
            self.sock.sendall(hdr)
            for p in parts:
                self.sock.sendall(p)
        self.last_tx = time.monotonic()

    def _paced_sendall(self, data) -> None:
        chunk = min(b.chunk for b in self.pacers)
        view = memoryview(data)
        for start in range(0, len(view), chunk):
            piece = view[start:start + chunk]
            for bucket in self.pacers:
                bucket.consume(len(piece))
            self.sock.sendall(piece)
            self.last_tx = time.monotonic()

    def _ring_put(self, parts) -> int:
        """shm: copy a WRITE payload into the tx ring (waiting for credit); returns position."""
        ring = self.ring_tx
        n = sum(len(p) for p in parts)
        while True:
            with self._cond:
                if self.failed is not None:
                    raise self.failed
                start = ring.reserve_fits(n)
                if start is None and not self._control:
                    self._cond.wait(0.5)
                    continue
            if start is not None:
                break
            self._flush_control()
        pos = start % ring.size
        for p in parts:
            for off in range(0, len(p), self._pace_chunk(len(p))):
                piece = p[off:off + self._pace_chunk(len(p))]
                for bucket in self.pacers:
                    bucket.consume(len(piece))
                ring.view[pos:pos + len(piece)] = piece
                pos += len(piece)
        return start

    def _pace_chunk(self, n: int) -> int:
        return min(b.chunk for b in self.pacers) if self.pacers else max(n, 1)

    # ---------------------------------------------------------------- reader thread
    def _recv_exact(self, view: memoryview, *, frame_start: bool = False) -> bool:
        got, n = 0, len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], min(n - got, _RECV_CHUNK))
            if k == 0:
                if frame_start and got == 0:
                    return False
                raise PeerDeadError(f"peer {self.peer_name!r} closed the connection "
                                    f"mid-frame ({got}/{n} bytes)")
            got += k
            self.last_rx = time.monotonic()
        return True

    def _recv_crc(self, view: memoryview) -> int:
        """Receive exactly ``len(view)`` bytes into ``view``; return their crc32c, computed
        piece by piece right after each piece lands (while it is still in cache)."""
        got, n, crc = 0, len(view), 0
        while got < n:
            k = self.sock.recv_into(view[got:], min(n - got, _RECV_CHUNK))
            if k == 0:
                raise PeerDeadError(f"peer {self.peer_name!r} closed the connection "
                                    f"mid-frame ({got}/{n} bytes)")
            crc = crc32c(view[got:got + k], crc)
            got += k
            self.last_rx = time.monotonic()
        return crc

    def _read_loop(self) -> None:
        hdr = bytearray(HEADER_SIZE)
        hview = memoryview(hdr)
        error: TransportError | None = None
        farewell = None
        try:
            while self.failed is None:
                if not self._recv_exact(hview, frame_start=True):
                    error = PeerDeadError(f"peer {self.peer_name!r} closed the connection")
                    break
                h = decode_header(hdr)
                if h.seq != self._seq_rx + 1:
                    raise FrameError(f"sequence {h.seq} after {self._seq_rx}: frame lost or replayed")
                self._seq_rx = h.seq
                self._dispatch(h)
        except FrameError as e:
            self.host.metrics.incr("frames_rejected")
            log.warning("rejected frame from %r on %r: %s", self.peer_name, self.host.name, e)
            error, farewell = e, f"frame rejected by {self.host.name!r}: {e}"
        except TransportError as e:
            error = e
        except OSError as e:
            error = PeerDeadError(f"receiving from {self.peer_name!r} failed: {e}")
        finally:
            if error is None:
                error = self.failed or PeerDeadError("connection closed")
            self.fail(error, farewell)
            self._sender.join()
            self.sock.close()
            self.host.connection_closed(self)

    def _dispatch(self, h: Header) -> None:
        op = h.op
        if op == Op.WRITE:
            self._on_write(h)
        elif op in (Op.CALL, Op.NOTIFY):
            payload = self._recv_payload(h, self.host.max_message)
            name, body = unpack_named(memoryview(payload))
            if op == Op.CALL:
                self.host.incoming_call(self, h.seq, name, body)
            else:
                self.host.incoming_notify(self, name, body)
                self.host.metrics.begin("rx", "notify")
                self.host.metrics.end("rx", "notify", len(payload), True)
            if h.flags & FLAG_ACK:
                self._control_frame(Op.ACK, h.seq)
        elif op == Op.REPLY:
            self._on_reply(h)
        elif op == Op.ACK:
            self._expect_empty(h)
            with self._cond:
                pending = self._pending.pop(h.aux, None)
            if pending is not None:
                pending.transfer.complete()
        elif op == Op.PING:
            self._expect_empty(h)
        elif op == Op.CREDIT:
            self._expect_empty(h)
            if self.ring_tx is None or not self.ring_tx.credit <= h.aux <= self.ring_tx.head:
                raise FrameError(f"CREDIT {h.aux} outside the ring's outstanding range")
            with self._cond:
                self.ring_tx.credit = h.aux
                self._cond.notify_all()
        elif op == Op.ERROR:
            text = self._recv_payload(h, _MAX_ERROR_TEXT).decode(errors="replace")
            raise PeerDeadError(f"peer {self.peer_name!r} closed the connection: {text}")
        else:
            raise FrameError(f"unexpected {op.name} frame after the handshake")

    def _expect_empty(self, h: Header) -> None:
        if h.length:
            raise FrameError(f"{h.op.name} frame carries {h.length} payload bytes, expected 0")

    def _recv_payload(self, h: Header, limit: int) -> bytearray:
        if h.length > limit:
            raise FrameError(f"{h.op.name} payload of {h.length} bytes exceeds the "
                             f"{limit}-byte limit (max_message)")
        buf = bytearray(h.length)
        if self._recv_crc(memoryview(buf)) != h.payload_crc:
            raise FrameError(f"{h.op.name} payload checksum mismatch")
        return buf

    def _on_write(self, h: Header) -> None:
        region = self.host.regions.by_id(h.region)
        if region is None:
            raise FrameError(f"WRITE to unknown region id {h.region}")
        if h.offset + h.length > region.nbytes:
            raise FrameError(f"WRITE [{h.offset}, {h.offset + h.length}) outside region "
                             f"{region.name!r} of {region.nbytes} bytes")
        verify = not h.flags & FLAG_NOCRC
        if not verify and self.host.payload_checksum:
            raise FrameError("peer sent a WRITE without payload checksum, but this endpoint "
                             "requires them (payload_checksum=True on both sides)")
        dest = region.view[h.offset:h.offset + h.length]
        self.host.metrics.begin("rx", "write")
        ok = False
        try:
            if self.ring_rx is not None:
                crc = self._copy_from_ring(h, dest, verify)
            elif verify:
                crc = self._recv_crc(dest)  # zero-copy: straight into the registered region
            else:
                self._recv_exact(dest)
                crc = 0
            if crc != h.payload_crc:
                raise FrameError(f"WRITE payload checksum mismatch in region {region.name!r} "
                                 f"[{h.offset}, {h.offset + h.length}): not acknowledged")
            ok = True
        finally:
            self.host.metrics.end("rx", "write", h.length, ok)
        if h.flags & FLAG_ACK:
            self._control_frame(Op.ACK, h.seq)

    def _copy_from_ring(self, h: Header, dest: memoryview, verify: bool = True) -> int:
        ring = self.ring_rx
        pos = h.aux % ring.size
        if (h.aux < self._rx_consumed or pos + h.length > ring.size
                or h.aux + h.length - self._rx_consumed > ring.size):
            raise FrameError(f"WRITE ring span [{h.aux}, {h.aux + h.length}) invalid "
                             f"(consumed {self._rx_consumed}, ring {ring.size} bytes)")
        crc = 0
        for start in range(0, h.length, _COPY_CHUNK):  # crc each piece while it is in cache
            piece = dest[start:start + _COPY_CHUNK]
            piece[:] = ring.view[pos + start:pos + start + len(piece)]
            if verify:
                crc = crc32c(piece, crc)
        self._rx_consumed = h.aux + h.length
        self.last_rx = time.monotonic()
        if (h.flags & FLAG_ACK) or self._rx_consumed - self._rx_reported >= ring.size // 8:
            self._rx_reported = self._rx_consumed
            self._control_frame(Op.CREDIT, self._rx_consumed)
        return crc

    def _on_reply(self, h: Header) -> None:
        with self._cond:
            op = self._pending.pop(h.aux, None)
        if op is None:  # the call timed out or was never ours: drain and ignore
            self._drain(h.length)
            return
        t = op.transfer
        if h.flags & FLAG_ERR:
            text = self._recv_payload(h, _MAX_ERROR_TEXT).decode(errors="replace")
            t.fail(RemoteError(f"call to {self.peer_name!r} failed remotely: {text}"))
            return
        into = op.reply_into
        if into is not None and h.length > len(into):
            self._drain(h.length)
            t.fail(RemoteError(f"reply of {h.length} bytes does not fit the {len(into)}-byte "
                               f"'into' buffer"))
            return
        if into is not None:
            value = into[:h.length]
            if self._recv_crc(value) != h.payload_crc:
                raise FrameError("REPLY payload checksum mismatch")
        else:
            value = self._recv_payload(h, self.host.max_message)
        self.host.metrics.begin("rx", "reply")
        self.host.metrics.end("rx", "reply", h.length, True)
        t.complete(value)

    def _drain(self, n: int) -> None:
        if n > self.host.max_message:
            raise FrameError(f"payload of {n} bytes exceeds max_message")
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            self._recv_exact(scratch[:k])
            n -= k

