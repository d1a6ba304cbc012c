"""The reader half of a :class:`transport.connection.Connection`: one thread per connection that
parses and validates frames and applies them (the module docstring of ``transport.connection``
describes both threads and the integrity guarantee; this file holds the receive side only).

Order of checks for every frame: header checksum, magic, version, op and flags
(:func:`transport.wire.decode_header`), sequence number, flag combinations, then per op the
region, bounds and size — all before a payload byte is received. A payload is received straight
into its destination (WRITE: the registered region; REPLY with ``into``: the caller's buffer; other
payloads: a private buffer) and its checksum compared before the next frame is parsed: crc32c in
the header for small payloads (one ``recv`` per whole piece of up to ``_RECV_PIECE`` bytes,
MSG_WAITALL), or a ``FLAG_TRAILER`` payload's XXH3-64 digest in its trailer, computed by the
connection's ``jkvt-crc-rx-*`` side thread (:mod:`transport.checksum`) as the pieces land or,
without checksum offload, by the reader on each span of up to ``_DIGEST_PIECE`` bytes right after
the ``recv`` that landed it (still in cache). The socket's
SO_RCVTIMEO (``RECV_TIMEOUT_S``, set by the connection) makes a waiting call return what has arrived,
so ``last_rx`` — the watchdog's liveness clock — stays fresh while a piece trickles in on a slow link.

`ReceiveSide` is a mixin of `Connection`: it uses the connection's ``sock``, ``host``, ``_cond``,
``_pending``, ``_receiving``, ``_seq_rx``, ``ring_rx``/``ring_tx``, ``_rx_*`` counters, ``_rx_crc``, ``_sender``,
``fail`` and ``_control_frame``, and runs only on the reader thread.
"""
from __future__ import annotations

import logging
import socket
import time

from transport.errors import FrameError, PeerDeadError, RemoteError, TransportError
from transport.wire import (FLAG_ACK, FLAG_ERR, FLAG_NOCRC, FLAG_TRAILER, HEADER_SIZE, TRAILER, TRAILER_SIZE, Header,
                            Op, crc32c, decode_header, trailer_hasher, unpack_named)

log = logging.getLogger(__name__)

MAX_ERROR_TEXT = 4096
_RECV_CHUNK = 4 << 20  # recv_into at most this much per call so liveness stays fresh
_COPY_CHUNK = 1 << 20  # shm: copy out of the ring and checksum in cache-sized pieces
_OFFLOAD_ABOVE = 64 * 1024  # trailer payloads above this are checksummed on the side thread
_CRC_PIECE = 256 * 1024  # hand landed bytes to the checksum thread in pieces of at least this
_RECV_PIECE = 1 << 20  # header-crc payloads: one MSG_WAITALL recv and one crc32c per piece
_DIGEST_PIECE = 256 << 10  # trailer payloads: at most this much per recv, hashed while in cache
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
RECV_TIMEOUT_S = 0.1  # SO_RCVTIMEO: a waiting recv returns what arrived so far at least this often


class ReceiveSide:
    def _recv_into(self, view: memoryview, flags: int = 0) -> int:
        """One ``recv_into``; 0 only at end of stream. Waiting is bounded by the socket's
        SO_RCVTIMEO (:data:`RECV_TIMEOUT_S`): when it passes with nothing received, try again
        (the watchdog judges silence by ``last_rx`` and shuts the socket down when it fails)."""
        while True:
            try:
                return self.sock.recv_into(view, len(view), flags)
            except BlockingIOError:
                if self.failed is not None:
                    raise self.failed from None

    def _recv_exact(self, view: memoryview, *, frame_start: bool = False) -> bool:
        got, n = 0, len(view)
        while got < n:
            k = self._recv_into(view[got:got + min(n - got, _RECV_CHUNK)])
            if k == 0:
                if frame_start and got == 0:
                    return False
                raise PeerDeadError(f"peer {self.peer_name!r} closed the connection "
                                    f"mid-frame ({got}/{n} bytes)")
            got += k
            self.last_rx = time.monotonic()
        return True

    def _recv_crc(self, view: memoryview) -> int:
        """Receive exactly ``len(view)`` bytes into ``view``; return their crc32c, computed piece
        by piece right after each piece lands (while it is still in cache). Each call waits for a
        whole piece of up to ``_RECV_PIECE`` bytes (MSG_WAITALL; SO_RCVTIMEO bounds the wait,
        returning what arrived): header-checksummed payloads are small, one call each."""
        got, n, crc = 0, len(view), 0
        while got < n:
            piece = view[got:got + min(n - got, _RECV_PIECE)]
            k = self._recv_into(piece, _WAITALL)
            if k == 0:
                raise PeerDeadError(f"peer {self.peer_name!r} closed the connection "
                                    f"mid-frame ({got}/{n} bytes)")
            crc = crc32c(piece[:k], crc)
            got += k
            self.last_rx = time.monotonic()
        return crc

    def _recv_digest(self, view: memoryview, trailer: memoryview) -> int:
        """Receive exactly ``len(view)`` bytes into ``view`` and then the trailer; return the
        XXH3-64 of ``view``, each received span hashed right after it lands, while it is still in
        L1/L2. Each ``recv`` takes what the kernel has queued, up to ``_DIGEST_PIECE`` bytes.
        Measured on 2 cores (experiments/bench_transport.py, tcp / raw at 1 and 16 MiB writes):
        one MSG_WAITALL call per MiB hashed after it landed read 0.68-0.72x / 0.87x; these
        spans 0.76-0.81x / 0.87-0.92x (0.71-0.75x / 0.82-0.86x when hashed a MiB at a time)."""
        hasher = trailer_hasher()
        got, n = 0, len(view)
        while got < n:
            k = self._recv_into(view[got:got + min(n - got, _DIGEST_PIECE)])
            if k == 0:
                raise PeerDeadError(f"peer {self.peer_name!r} closed the connection "
                                    f"mid-frame ({got}/{n} bytes)")
            hasher.update(view[got:got + k])
            got += k
            self.last_rx = time.monotonic()
        self._recv_exact(trailer)
        return hasher.intdigest()

    def _recv_offloaded(self, view: memoryview) -> int:
        """Like :meth:`_recv_crc` with a trailer, but the digest runs on the checksum side thread,
        piece by piece as the pieces land, while this thread keeps receiving."""
        running = self._rx_crc.begin()
        got, handed, n = 0, 0, len(view)
        while got < n:
            k = self._recv_into(view[got:got + min(n - got, _RECV_CHUNK)])
            if k == 0:
                raise PeerDeadError(f"peer {self.peer_name!r} closed the connection "
                                    f"mid-frame ({got}/{n} bytes)")
            got += k
            self.last_rx = time.monotonic()
            if got - handed >= _CRC_PIECE or got == n:
                running.add(view[handed:got])
                handed = got
        return running.result()

    def _recv_verified(self, h: Header, view: memoryview, what: str) -> None:
        """Receive ``h``'s payload into ``view`` and check it: crc32c against the header field, or
        with FLAG_TRAILER its XXH3-64 against the trailer after it. Raises FrameError on a mismatch."""
        if not h.flags & FLAG_TRAILER:
            if self._recv_crc(view) != h.payload_crc:
                raise FrameError(f"{what} payload checksum mismatch")
            return
        trailer = bytearray(TRAILER_SIZE)
        if len(view) > _OFFLOAD_ABOVE and self.host.checksum_offload:
            crc = self._recv_offloaded(view)
            self._recv_exact(memoryview(trailer))
        else:
            crc = self._recv_digest(view, memoryview(trailer))
        if crc != TRAILER.unpack(trailer)[0]:
            raise FrameError(f"{what} payload checksum mismatch (trailer)")

    def _check_flags(self, h: Header) -> None:
        """Flag combinations that no sender produces."""
        if h.flags & FLAG_TRAILER:
            if h.flags & FLAG_NOCRC or h.payload_crc:
                raise FrameError(f"{h.op.name} frame with a checksum trailer also claims a header "
                                 f"checksum or none at all (flags {h.flags:#x})")
            if h.length == 0 or (h.op == Op.WRITE and self.ring_rx is not None):
                raise FrameError(f"{h.op.name} frame announces a checksum trailer but carries no "
                                 f"payload on the stream")
        elif h.flags & FLAG_NOCRC and h.op != Op.WRITE:
            raise FrameError(f"{h.op.name} frame without a payload checksum (only WRITE may skip it)")

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
                self._check_flags(h)
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
            self._rx_crc.close()
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
            text = self._recv_payload(h, MAX_ERROR_TEXT).decode(errors="replace")
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
        self._recv_verified(h, memoryview(buf), h.op.name)
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
        what = f"WRITE into region {region.name!r} [{h.offset}, {h.offset + h.length}) (not acknowledged):"
        try:
            if self.ring_rx is not None:
                if self._copy_from_ring(h, dest, verify) != h.payload_crc:
                    raise FrameError(f"{what} payload checksum mismatch")
            elif verify:
                self._recv_verified(h, dest, what)  # zero-copy: straight into the registered region
            else:
                self._recv_exact(dest)
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
            # While its payload arrives the call is in no queue; `fail` and the watchdog's deadline
            # still reach it here (a peer that drops mid-reply must not leave the caller waiting).
            self._receiving = op
        if op is None:  # the call timed out or was never ours: drain and ignore
            self._drain(h.length, h)
            return
        self._receive_reply(h, op)  # raising leaves it in `_receiving` for `fail`, which follows
        with self._cond:
            self._receiving = None

    def _receive_reply(self, h: Header, op) -> None:
        t = op.transfer
        if h.flags & FLAG_ERR:
            text = self._recv_payload(h, MAX_ERROR_TEXT).decode(errors="replace")
            t.fail(RemoteError(f"call to {self.peer_name!r} failed remotely: {text}"))
            return
        into = op.reply_into
        if into is not None and h.length > len(into):
            self._drain(h.length, h)
            t.fail(RemoteError(f"reply of {h.length} bytes does not fit the {len(into)}-byte "
                               f"'into' buffer"))
            return
        if into is not None:
            value = into[:h.length]
            self._recv_verified(h, value, "REPLY")
        else:
            value = self._recv_payload(h, self.host.max_message)
        self.host.metrics.begin("rx", "reply")
        self.host.metrics.end("rx", "reply", h.length, True)
        t.complete(value)

    def _drain(self, n: int, h: Header | None = None) -> None:
        if n > self.host.max_message:
            raise FrameError(f"payload of {n} bytes exceeds max_message")
        if h is not None and h.flags & FLAG_TRAILER:
            n += TRAILER_SIZE  # nobody wants the payload: its trailer goes with it, unchecked
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            self._recv_exact(scratch[:k])
            n -= k
