"""A connected peer: the operations one endpoint performs on another.

Every operation returns (or, for the blocking helper :meth:`Peer.call`, waits on) a
:class:`~transport.transfer.Transfer`. Write payloads are *not copied*: like an RDMA work
request, the buffer passed to :meth:`Peer.write` must stay unchanged until the transfer is
done. Regions are addressed by the name the remote side registered; the name → id table is
fetched once over RPC and refreshed when a name is missing.

Ordering: every operation travels on one connection (stream) and the remote applies the
frames of a connection in order, so a write's mask (``then=``) always lands after its block.
With one stream (the default) *all* operations to a peer are applied in submission order.
With ``connect(streams=N)`` writes rotate over the N streams (more cores move bytes) while
calls, notifications and region lookups stay on stream 0: writes are then ordered only
within themselves, not against other writes or a later notification — wait for a write's
completion before a notification that announces it.

Concurrency: any thread may call any method.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Iterable, NamedTuple

from transport.connection import Frame, Operation
from transport.errors import TransportError
from transport.region import RemoteRegion, as_byte_view, decode_region_table
from transport.transfer import Transfer
from transport.wire import FLAG_NOCRC, Op, pack_named

REGIONS_METHOD = "_jkv.regions"
RDMA_REGIONS_METHOD = "_jkv.rdma_regions"
RDMA_QP_METHOD = "_jkv.rdma_qp"


class Mask(NamedTuple):
    """Trailing write applied only after a block's bytes: ``value`` at ``offset`` of ``region``
    (e.g. the decode side's ``kv_mask: i8[B, N]`` set to 1 for the block's tokens)."""

    region: str
    offset: int
    value: bytes | int


class WriteItem(NamedTuple):
    region: str
    offset: int
    data: object  # bytes-like / numpy array, C-contiguous
    then: Mask | tuple | None = None


class Peer:
    def __init__(self, endpoint, conn, session: str = ""):
        self.endpoint = endpoint
        self.name: str = conn.peer_name
        self.session = session  # groups the streams of one connect(streams=N)
        self._conn = conn  # stream 0: calls, notifications, region lookups
        self._conns = [conn]  # every stream; writes rotate over them
        self._next = 0
        self._lock = threading.Lock()
        self._remote: dict[str, RemoteRegion] = {}

    def __repr__(self) -> str:
        return f"<Peer {self.name!r} of {self.endpoint.name!r} {'up' if self.alive else 'down'}>"

    @property
    def alive(self) -> bool:
        return all(c.failed is None for c in self._conns)

    @property
    def streams(self) -> int:
        return len(self._conns)

    @property
    def connections(self) -> tuple:
        """Its connections (streams), stream 0 first."""
        return tuple(self._conns)

    def add_stream(self, conn) -> None:
        """Endpoint: one more authenticated connection of this peer (``connect(streams=N)``)."""
        with self._lock:
            self._conns.append(conn)

    @property
    def error(self) -> TransportError | None:
        """Why the connection failed (None while alive)."""
        return next((c.failed for c in self._conns if c.failed is not None), None)

    def _stream(self):
        with self._lock:
            conn = self._conns[self._next % len(self._conns)]
            self._next += 1
        return conn

    # ------------------------------------------------------------------ regions
    def regions(self, refresh: bool = False, timeout: float | None = None) -> dict[str, RemoteRegion]:
        """The peer's registered regions by name (fetched over RPC, cached; with rdma also
        their NIC address and rkey)."""
        with self._lock:
            if self._remote and not refresh:
                return dict(self._remote)
        if self.endpoint.rdma is not None:
            rows = json.loads(bytes(self.call(RDMA_REGIONS_METHOD, b"", timeout=timeout)))
            table = {name: RemoteRegion(name, rid, nbytes, addr, rkey)
                     for name, rid, nbytes, addr, rkey in rows}
        else:
            table = decode_region_table(self.call(REGIONS_METHOD, b"", timeout=timeout))
        with self._lock:
            self._remote = table
        return dict(table)

    def _region(self, name: str) -> RemoteRegion:
        with self._lock:
            r = self._remote.get(name)
        if r is None:
            table = self.regions(refresh=True)
            r = table.get(name)
            if r is None:
                raise KeyError(f"peer {self.name!r} has no region {name!r}; it registered "
                               f"{sorted(table)} (register it before writing)")
        return r

    # ------------------------------------------------------------------ operations
    def _deadline(self, timeout: float | None) -> float | None:
        t = self.endpoint.op_timeout if timeout is None else timeout
        if t is not None and not t > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds (or None for the default)")
        return None if t is None else time.monotonic() + t

    def _write_frames(self, item: WriteItem, conn) -> tuple[list[Frame], int]:
        region, offset, data, then = item
        r = self._region(region)
        view = as_byte_view(data, what="write data")
        if offset < 0 or offset + len(view) > r.nbytes:
            raise ValueError(f"write of {len(view)} bytes at offset={offset} does not fit peer "
                             f"{self.name!r} region {region!r} of {r.nbytes} bytes")
        ring = conn.ring_tx
        step = ring.max_frame if ring is not None else max(len(view), 1)
        flags = 0 if self.endpoint.payload_checksum else FLAG_NOCRC
        frames = [Frame(Op.WRITE, [view[s:s + step]], r.id, offset + s, flags=flags)
                  for s in range(0, max(len(view), 1), step)]
        nbytes = len(view)
        if then is not None:
            mregion, moff, value = Mask(*then)
            mr = self._region(mregion)
            mview = as_byte_view(bytes([value]) if isinstance(value, int) else value,
                                 what="mask value")
            if moff < 0 or moff + len(mview) > mr.nbytes:
                raise ValueError(f"mask write of {len(mview)} bytes at offset={moff} does not fit "
                                 f"peer {self.name!r} region {mregion!r} of {mr.nbytes} bytes")
            frames.append(Frame(Op.WRITE, [mview], mr.id, moff, flags=flags))
            nbytes += len(mview)
        return frames, nbytes

    def write(self, region: str, offset: int, data, *, then: Mask | tuple | None = None,
              timeout: float | None = None) -> Transfer:
        """One-sided write of ``data`` at byte ``offset`` of the peer's ``region``; if ``then``
        is given, that mask write is applied only after every byte of ``data`` landed.
        Completes when the peer acknowledged both."""
        return self.write_many([WriteItem(region, offset, data, then)], timeout=timeout)

    def write_many(self, items: Iterable[WriteItem | tuple], *, timeout: float | None = None) -> Transfer:
        """Several writes (e.g. one layer's blocks, each with its mask) as one transfer. Applied
        in order; each mask right after its own block, so early blocks become usable early."""
        items = [WriteItem(*item) for item in items]
        if not items:
            raise ValueError("write_many needs at least one item")
        if self.endpoint.rdma is not None:
            return self._rdma_write_many(items, timeout)
        conn = self._stream()
        frames, nbytes = [], 0
        for item in items:
            f, n = self._write_frames(item, conn)
            frames += f
            nbytes += n
        t = Transfer("write", self.name, nbytes, self._deadline(timeout))
        return conn.submit(Operation(t, frames, "ack"))

    def _rdma_write_many(self, items: list[WriteItem], timeout: float | None) -> Transfer:
        planned, nbytes = [], 0
        for region, offset, data, then in items:
            view = as_byte_view(data, what="write data")
            self._check_fits(region, offset, len(view), "write")
            mask = None
            if then is not None:
                mregion, moff, value = Mask(*then)
                mview = as_byte_view(bytes([value]) if isinstance(value, int) else value,
                                     what="mask value")
                self._check_fits(mregion, moff, len(mview), "mask write")
                mask = (mregion, moff, mview)
                nbytes += len(mview)
            planned.append((region, offset, view, mask))
            nbytes += len(view)
        channel = self.endpoint.rdma_channel(self)
        t = Transfer("write", self.name, nbytes, self._deadline(timeout))
        t.add_done_callback(self.endpoint.transfer_finished)
        metrics = self.endpoint.metrics
        metrics.begin("tx", "write")
        t.add_done_callback(lambda tr: metrics.end("tx", "write", tr.nbytes, tr.error is None))
        try:
            channel.post_writes(planned, self.regions(), t)
        except TransportError as e:
            t.fail(e)
        return t

    def _check_fits(self, region: str, offset: int, length: int, what: str) -> None:
        r = self._region(region)
        if offset < 0 or offset + length > r.nbytes:
            raise ValueError(f"{what} of {length} bytes at offset={offset} does not fit peer "
                             f"{self.name!r} region {region!r} of {r.nbytes} bytes")

    def call_async(self, method: str, payload=b"", *, timeout: float | None = None,
                   into=None) -> Transfer:
        """Send an RPC request; the transfer's result is the reply (a bytearray, or a view of
        ``into`` when given — the reply is then received straight into that buffer)."""
        body = as_byte_view(payload, what="call payload")
        into_view = None if into is None else as_byte_view(into, writable=True, what="into")
        parts = pack_named(method, body)
        t = Transfer("call", self.name, len(body), self._deadline(timeout), method=method)
        return self._conn.submit(Operation(t, [Frame(Op.CALL, parts)], "reply", into_view))

    def call(self, method: str, payload=b"", *, timeout: float | None = None, into=None):
        """Blocking RPC: the reply bytes (see :meth:`call_async`). Raises TransportError."""
        return self.call_async(method, payload, timeout=timeout, into=into).result()

    def notify(self, kind: str, payload=b"", *, timeout: float | None = None) -> Transfer:
        """Small control message; the peer's handlers see notifications in send order.
        Completes when the peer has received it."""
        body = as_byte_view(payload, what="notify payload")
        t = Transfer("notify", self.name, len(body), self._deadline(timeout))
        return self._conn.submit(Operation(t, [Frame(Op.NOTIFY, pack_named(kind, body))], "ack"))

    def close(self) -> None:
        """Close this peer's connections; pending operations fail."""
        for conn in list(self._conns):
            conn.fail(TransportError(f"connection to {self.name!r} closed locally"))
        for conn in list(self._conns):
            conn.join(5.0)
