"""One authenticated connection to a peer: the framed, ordered data plane of ``tcp``/``shm``.

Threads per connection (named ``jkvt-tx-<local>-><peer>`` / ``jkvt-rx-<local><-<peer>``):

* **sender** — writes every frame but the reader's own ACK/CREDIT (below). It sends queued
  control frames (ACK, CREDIT, PING, ERROR) between frames and user operations from a FIFO
  queue, one frame at a time, pacing payload chunks with the token buckets. Whoever writes a
  frame holds ``_wlock`` from assigning its sequence number to its last byte, so frames never
  interleave and go out in sequence order. Frames of one operation
  are contiguous on the stream, so a block and its trailing mask write are applied in order.
  A payload above ``_SMALL`` bytes goes out with ``FLAG_TRAILER``. With ``checksum_offload``
  the sender hands it to its checksum side thread (``jkvt-crc-tx-*``, :mod:`transport.checksum`)
  and starts writing at once (header and payload in one ``sendmsg``, no joining copy); it waits
  for the digest only to send the last piece and the 8-byte XXH3-64 trailer. Without it (the
  default below 4 cores) the sender digests the payload and writes header, payload and trailer in one
  ``sendmsg``, as a raw socket's ``sendall`` of the block. Smaller
  payloads keep the crc in the header, computed by the submitting thread.
* **reader** — the only thread that reads. It validates each header (checksum, sequence,
  op, region, bounds, size) *before* a payload byte is written, receives WRITE payloads
  straight into the registered region's memoryview (tcp: ``recv_into``; shm: one copy out
  of the ring), verifies the payload checksum, and only then processes the next frame — so
  the mask frame after a block is applied after the block is complete. A trailer-carried
  payload is checksummed by its side thread (``jkvt-crc-rx-*``) piece by piece as the pieces
  land, while the reader keeps receiving; the reader compares the result with the trailer
  before it looks at the next frame. It never blocks on
  sending, which rules out the classic both-sides-sending deadlock: an ACK or CREDIT goes out
  from the reader itself only when ``_wlock`` is free and nothing is queued, with one
  non-blocking ``send`` (what the kernel does not take is left for the sender to write first);
  otherwise it is queued for the sender. Acknowledging on the reader saves the sender thread's
  wake-up per acknowledged write. RPC requests go to the endpoint's handler pool and
  notifications to its dispatcher thread.

Integrity guarantee, precisely: the receive is zero-copy, so a WRITE payload lands in the
destination region *before* its checksum (header field or trailer) is compared; what a
damaged payload can never do is become visible as valid. The commit of a block is the mask
frame that follows it on the stream, and that frame is only parsed after the block's
checksum matched: on a mismatch the frame is rejected (no ACK, the connection closes) and
the trailing mask frame is never applied, so a mask value never vouches for damaged bytes.
A malformed *header* (bad header crc, unknown region, out of bounds, oversized, wrong
sequence, bad flags) is rejected before any payload byte is written anywhere. RPC and
notification payloads are received into private buffers and handed on only after the check.

Failure: :meth:`Connection.fail` is idempotent; the first reason wins, every queued and
pending operation fails with it, and the socket is shut down, which wakes both threads.
The endpoint's watchdog calls :meth:`Connection.tick` to send heartbeats, detect a silent
peer and expire operations past their deadline.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from transport.errors import OpTimeout, PeerDeadError, TransportError
from transport.checksum import ChecksumWorker, Inline
from transport.pacing import TokenBucket
from transport.receiver import MAX_ERROR_TEXT as _MAX_ERROR_TEXT, RECV_TIMEOUT_S, ReceiveSide
from transport.shm import ShmRing
from transport.transfer import Transfer
from transport.wire import (FLAG_ACK, FLAG_NOCRC, FLAG_TRAILER, TRAILER, Header, Op, crc32c, encode_header,
                            trailer_digest)

log = logging.getLogger(__name__)

_SMALL = 64 * 1024  # header and payload below this go out in one sendall, crc in the header
_TAIL = 256 * 1024  # trailer frames: the last this-many payload bytes wait for the digest, then go with the trailer
_SUBMIT_DIGEST_MAX = 4 << 20  # tcp without offload: trailer payloads up to this are digested on submit
_COPY_CHUNK = 1 << 20  # shm: copy into the ring and checksum in cache-sized pieces


@dataclass
class Frame:
    op: Op
    payload: list = field(default_factory=list)  # flat uint8 memoryviews / bytes
    region: int = 0
    offset: int = 0
    aux: int = 0
    flags: int = 0
    crc: int = -1  # payload crc32c; -1: a large payload, checksummed while it is sent (trailer)
    digest: int = -1  # a trailer payload's XXH3-64 when the submitting thread computed it (submit)

    def __post_init__(self):
        # Small payloads: the submitting (user / handler) thread pays for the checksum, which
        # travels in the header. Large ones stay -1: the sender's checksum side thread computes
        # it while the socket copies, and it travels in a trailer (FLAG_TRAILER).
        if self.flags & FLAG_NOCRC:
            self.crc = 0
        elif self.crc < 0 and self.length <= _SMALL:
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
    checksum_offload: bool  # large payloads' trailer digests on side threads (transport/checksum.py)

    def transfer_finished(self, transfer: Transfer) -> None:
        """Whichever thread finished it: an operation submitted on this connection is done."""

    def incoming_call(self, conn: "Connection", seq: int, method: str, payload: memoryview) -> None:
        """Reader thread: a CALL arrived; the reply is submitted on ``conn`` later."""

    def incoming_notify(self, conn: "Connection", kind: str, payload: memoryview) -> None:
        """Reader thread: a NOTIFY arrived (must not block)."""

    def connection_failed(self, conn: "Connection", error: TransportError) -> None:
        """Once, from whichever thread failed ``conn`` first."""

    def connection_closed(self, conn: "Connection") -> None:
        """Reader thread, last: both threads are done and the socket is closed."""


class Connection(ReceiveSide):
    def __init__(self, host: ConnectionHost, sock: socket.socket, peer_name: str, *,
                 pacers: list[TokenBucket] = (), ring_tx: ShmRing | None = None,
                 ring_rx: ShmRing | None = None, peer_liveness: float | None = None):
        self.host = host  # the Endpoint: regions, metrics, handlers, timeouts
        # A PING within a fifth of the peer's liveness timeout too, whatever ours is: a side with a
        # long timeout (a pool client with a long op timeout) must not go silent past a short one.
        self.heartbeat = host.heartbeat if peer_liveness is None else min(host.heartbeat, peer_liveness / 5)
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
        self._receiving: Operation | None = None  # call whose REPLY payload the reader is taking in
        self._inflight: Operation | None = None  # op whose frames the sender is writing
        self._seq_tx = 0
        self._seq_rx = 0
        self._ping_queued = False
        self._wlock = threading.Lock()  # held while writing a frame: its bytes are contiguous on the stream
        self._residue: bytes | None = None  # see _control_frame
        self._farewell: tuple[Header, bytes] | None = None  # ERROR frame sent before closing
        self._rx_consumed = 0  # shm: ring bytes consumed (monotonic)
        self._rx_reported = 0
        local = host.name
        self._tx_crc = ChecksumWorker(f"jkvt-crc-tx-{local}->{peer_name}")
        self._rx_crc = ChecksumWorker(f"jkvt-crc-rx-{local}<-{peer_name}")
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"jkvt-tx-{local}->{peer_name}")
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"jkvt-rx-{local}<-{peer_name}")

    def start(self) -> None:
        # The reader waits for whole payload pieces (MSG_WAITALL); the kernel hands back what has
        # arrived after this long, so ``last_rx`` stays fresh on a slow link (receiver.py).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                             struct.pack("ll", 0, int(RECV_TIMEOUT_S * 1e6)))
        self._sender.start()
        self._reader.start()

    # ---------------------------------------------------------------- submission
    def submit(self, op: Operation) -> Transfer:
        if self.ring_tx is None and not self.pacers and not self.host.checksum_offload:
            # tcp, unpaced, no side threads: the submitting thread digests a trailer payload of up
            # to _SUBMIT_DIGEST_MAX bytes, as it checksums small ones, so the hash runs while the
            # sender thread copies the frames queued before it. Measured on 2 cores
            # (experiments/bench_transport.py, tcp / raw): 1 MiB writes 0.89-0.91x this way,
            # 0.78-0.79x digested on the sender thread; 16 MiB writes the other way round
            # (0.82-0.83x here, 0.88-0.90x on the sender thread, where the hash leaves the start
            # of the payload in cache for the socket copy), hence the bound.
            for frame in op.frames:
                if frame.crc < 0 and frame.digest < 0 and frame.length <= _SUBMIT_DIGEST_MAX:
                    frame.digest = trailer_digest(*frame.payload)
        with self._cond:
            if self.failed is not None:
                err = self.failed
            else:
                self._ops.append(op)
                self._cond.notify_all()
                op.transfer.add_done_callback(self.host.transfer_finished)
                return op.transfer
        self.host.metrics.fail("tx", op.transfer.kind)
        op.transfer.fail(PeerDeadError(f"connection to {self.peer_name!r} is down: {err}"))
        return op.transfer

    def _control_frame(self, op: Op, aux: int = 0, payload: bytes = b"") -> None:
        """Reader thread: an ACK or CREDIT for the peer. When no frame is being written and none is
        queued, the reader puts it on the wire itself without waiting (MSG_DONTWAIT): waking the
        sender thread for 52 bytes costs more CPU than the send (two context switches and GIL
        hand-offs per acknowledged write). Bytes the kernel does not take at once become the
        residue, which the sender writes before anything else; otherwise the frame is queued."""
        h = Header(op, 0, 0, 0, 0, len(payload), aux, crc32c(payload))
        if self._wlock.acquire(blocking=False):
            try:
                with self._cond:
                    direct = self.failed is None and not self._control and self._residue is None
                    if direct:
                        h = Header(op, 0, 0, self._next_seq(), 0, len(payload), aux, h.payload_crc)
                if direct:
                    data = encode_header(h) + payload
                    try:
                        sent = self.sock.send(data, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    self.last_tx = time.monotonic()
                    if sent < len(data):
                        with self._cond:
                            self._residue = data[sent:]
                            self._cond.notify_all()
                    return
            finally:
                self._wlock.release()
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
            ops += [op for op in (self._inflight, self._receiving) if op is not None]
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
            if now - self.last_tx > self.heartbeat and not self._ping_queued:
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
            late = self._receiving
            late = late if late is not None and late.transfer.deadline is not None \
                and now > late.transfer.deadline else None
        for op in expired:
            t = op.transfer
            t.fail(OpTimeout(f"{t.kind} to {self.peer_name!r} ({t.nbytes} B) did not complete "
                             f"within its {t.deadline - t.created_at:.3g}s timeout "
                             f"(state was {t.state.name})"))
        if late is not None:  # mid-frame: the stream cannot skip the rest, so the connection goes
            t = late.transfer
            self.fail(OpTimeout(f"reply to {t.kind} from {self.peer_name!r} still arriving past its "
                                f"{t.deadline - t.created_at:.3g}s timeout; connection closed"))

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
                    while not (self._control or self._ops or self.failed or self._residue is not None):
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
                with self._wlock:
                    self._send_frame(*self._farewell, paced=False)
        except OSError as e:
            self.fail(PeerDeadError(f"sending to {self.peer_name!r} failed: {e}"))
        except TransportError as e:
            self.fail(e)
        finally:
            self._tx_crc.close()

    def _flush_control(self) -> None:
        while True:
            with self._wlock:
                with self._cond:
                    if self.failed is not None:
                        return
                    if not self._control:
                        self._write_residue()
                        return
                    h, payload = self._control.popleft()
                    if h.op == Op.PING:
                        self._ping_queued = False
                self._send_frame(h, payload, paced=False)

    def _write_residue(self) -> None:
        """Holding ``_wlock``: the bytes of a control frame the reader started that the kernel did
        not take; they must precede every other byte on the stream."""
        if self._residue is not None:
            residue, self._residue = self._residue, None
            self.sock.sendall(residue)

    def _send_op(self, op: Operation) -> None:
        t = op.transfer
        if not t.start():
            return  # expired while queued
        self.host.metrics.begin("tx", t.kind)
        t.add_done_callback(lambda tr: self.host.metrics.end("tx", tr.kind, tr.nbytes,
                                                             tr.error is None))
        sending_since, paced_bytes = time.monotonic(), 0
        for i, frame in enumerate(op.frames):
            if t.done():
                return  # timed out mid-operation; the remaining frames are not sent
            self._flush_control()
            last = i == len(op.frames) - 1
            flags = frame.flags | (FLAG_ACK if last and op.expects == "ack" else 0)
            payload = frame.payload
            aux = frame.aux
            crc = frame.crc
            trailer = False
            if frame.op == Op.WRITE and self.ring_tx is not None:
                aux, ring_crc = self._ring_put(payload, crc < 0)
                crc = ring_crc if crc < 0 else crc
                payload = []
                wire_len = frame.length
            else:
                wire_len = None
                if crc < 0:  # large payload on the stream: checksummed while it is sent
                    crc, trailer = 0, True
                    flags |= FLAG_TRAILER
            with self._wlock:  # sequence numbers go on the wire in order: assigned by the lock holder
                with self._cond:
                    seq = self._next_seq()
                    if last and op.expects != "none":
                        op.wait_seq = seq
                        self._pending[seq] = op
                h = Header(frame.op, flags, frame.region, seq, frame.offset,
                           frame.length if wire_len is None else wire_len, aux, crc)
                self._send_frame(h, payload, paced=self.ring_tx is None, trailer=trailer,
                                 digest=frame.digest)
            paced_bytes += frame.length
        self._count_link_time(t.kind, paced_bytes, time.monotonic() - sending_since)
        if op.expects == "none":
            t.complete()

    def _send_frame(self, h: Header, payload, paced: bool, trailer: bool = False,
                    digest: int = -1) -> None:
        """Header, payload and (``trailer``: the payload's XXH3-64 — ``digest`` when the
        submitting thread computed it, else computed here or on the side thread meanwhile) on the
        stream; unpaced large frames use few ``sendmsg`` calls, no copies. The caller holds ``_wlock``."""
        self._write_residue()
        if h.seq == 0:
            with self._cond:
                h = Header(h.op, h.flags, h.region, self._next_seq(), h.offset, h.length,
                           h.aux, h.payload_crc)
        hdr = encode_header(h)
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        parts = [_flat(p) for p in parts if len(p)]
        total = sum(len(p) for p in parts)
        paced = paced and bool(self.pacers) and total > 0
        if trailer and digest >= 0 and not paced:
            self._sendmsg_all([hdr, *parts, TRAILER.pack(digest)])
            self.last_tx = time.monotonic()
            return
        if trailer and not self.host.checksum_offload and not paced:
            self._send_checksummed(hdr, parts)
            self.last_tx = time.monotonic()
            return
        running = None
        if trailer and not self.host.checksum_offload:
            running = Inline(parts)
        elif trailer:
            running = self._tx_crc.begin()
            for p in parts:
                running.add(p)
        if paced:
            self.sock.sendall(hdr)
            for p in parts:
                self._paced_sendall(p)
            if running is not None:
                self.sock.sendall(TRAILER.pack(running.result()))
        elif total <= _SMALL and running is None:
            self.sock.sendall(b"".join([hdr, *parts]))
        elif running is None:
            self._sendmsg_all([hdr, *parts])
        else:
            head, tail = _split_tail(parts, min(_TAIL, total))
            self._sendmsg_all([hdr, *head])
            self._sendmsg_all([*tail, TRAILER.pack(running.result())])
        self.last_tx = time.monotonic()

    def _send_checksummed(self, hdr: bytes, parts: list) -> None:
        """A trailer frame digested on this thread: XXH3-64 of the whole payload, then header,
        payload and trailer in one ``sendmsg`` (as a raw socket's one ``sendall`` of the block).
        Measured worse on 2 cores (experiments/bench_transport.py, tcp / raw at 1 and 16 MiB):
        digesting after the ``sendmsg`` and sending the trailer alone (0.72x / 0.87x against
        0.76x / 0.91x), and 64-256 KiB pieces each digested next to its own ``sendmsg``, before or
        after it (0.59-0.67x / 0.70-0.77x: a syscall and a socket wake-up per piece)."""
        self._sendmsg_all([hdr, *parts, TRAILER.pack(trailer_digest(*parts))])

    def _sendmsg_all(self, bufs: list) -> None:
        """``sendall`` of several buffers with scatter-gather ``sendmsg`` (one syscall when the
        socket buffer has room), resuming after partial sends."""
        views = [b if isinstance(b, memoryview) else memoryview(b) for b in bufs if len(b)]
        while views:
            sent = self.sock.sendmsg(views[:_IOV_MAX])
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _count_link_time(self, kind: str, nbytes: int, wall_s: float) -> None:
        """Paced link: an operation occupies the emulated link for at least nbytes / rate. When
        it went out faster (its first chunk rode on credit the bucket banked while the link idled),
        the difference is busy time the wall clock missed; count it so busy-time goodput (the
        compression controller's bandwidth estimate) reads the link, not up to twice it."""
        rates = [r for r in (getattr(b, "rate_Bps", None) for b in self.pacers) if r]
        if nbytes and rates:
            shortfall = nbytes / min(rates) - wall_s
            if shortfall > 0:
                self.host.metrics.add_busy("tx", kind, shortfall)

    def _paced_sendall(self, data) -> None:
        chunk = min(b.chunk for b in self.pacers)
        view = memoryview(data)
        for start in range(0, len(view), chunk):
            piece = view[start:start + chunk]
            for bucket in self.pacers:
                bucket.consume(len(piece))
            self.sock.sendall(piece)
            self.last_tx = time.monotonic()

    def _ring_put(self, parts, checksum: bool = False) -> tuple[int, int]:
        """shm: copy a WRITE payload into the tx ring (waiting for credit); returns (position,
        crc32c of the payload if ``checksum`` else 0 — computed piece by piece as each piece is
        copied, while it is in cache)."""
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
        crc = 0
        for p in parts:
            for off in range(0, len(p), self._pace_chunk(len(p))):
                piece = p[off:off + self._pace_chunk(len(p))]
                for bucket in self.pacers:
                    bucket.consume(len(piece))
                ring.view[pos:pos + len(piece)] = piece
                if checksum:
                    crc = crc32c(piece, crc)
                pos += len(piece)
        return start, crc

    def _pace_chunk(self, n: int) -> int:
        """Copy size into the ring: the pacers' chunk, else cache-sized pieces (checksummed hot)."""
        if self.pacers:
            return min(b.chunk for b in self.pacers)
        return min(max(n, 1), _COPY_CHUNK)

_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


def _flat(p) -> memoryview:
    """A 1-d unsigned-byte view of a payload part (what sendmsg and the checksum take)."""
    v = p if isinstance(p, memoryview) else memoryview(p)
    return v if v.ndim == 1 and v.format == "B" else v.cast("B")


def _split_tail(parts: list, tail: int) -> tuple[list, list]:
    """Split the concatenation of ``parts`` into (all but the last ``tail`` bytes, those bytes)."""
    head, back = list(parts), []
    while tail and head:
        last = head.pop()
        if len(last) <= tail:
            back.insert(0, last)
            tail -= len(last)
        else:
            head.append(last[:len(last) - tail])
            back.insert(0, last[len(last) - tail:])
            tail = 0
    return head, back
