"""Endpoint: one process's presence on the transport (regions, handlers, peers, threads).

Typical use (decode side registers, prefill side writes)::

    ep = Endpoint("decode-0", backend="tcp", secret=b"...")
    ep.register("kv_pool", pool)        # e.g. u8[num_blocks, block_bytes], page-aligned
    ep.register("kv_mask", kv_mask)     # i8[B, N_max]
    ep.serve("fetch_rows", handler)     # handler(peer_name, payload) -> bytes-like
    addr = ep.listen()                  # "127.0.0.1:PORT" (tcp) / "@jkvt-..." (shm)

    pf = Endpoint("prefill-0", secret=b"...", bandwidth="10gbit")
    decode = pf.connect(addr)           # Peer, authenticated
    decode.write("kv_pool", off, block, then=Mask("kv_mask", moff, b"\\x01" * n)).wait()

Threads an endpoint starts (all named ``jkvt-*``, all joined by :meth:`Endpoint.close`):

* ``jkvt-watchdog-<name>`` — every tick sends heartbeats (PING after ``heartbeat`` s idle),
  fails a connection whose peer has been silent for ``timeout`` s (its pending operations
  fail with PeerDeadError), and fails operations past their per-operation deadline.
* ``jkvt-notify-<name>`` — delivers notifications in arrival order to ``on_notify``
  handlers, or queues them for :meth:`Endpoint.next_notification`.
* ``jkvt-accept-<name>`` (after :meth:`listen`) and one short-lived ``jkvt-auth-*`` thread
  per incoming connection, so a slow client cannot stall others' handshakes. At most
  ``max_handshakes`` of them run at once (more connections are refused on accept), each for
  at most ``handshake_timeout`` seconds (transport/admission.py).
* ``jkvt-rpc-<name>_N`` — a pool (``rpc_workers``) running ``serve`` handlers; replies are
  queued on the requesting connection.
* per connection, a sender and a reader thread (see :mod:`transport.connection`).

Handlers run on pool / dispatcher threads and may themselves call peers, but must not wait
for their *own* endpoint's RPC pool to free up.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import secrets as _secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from transport.address import parse_tcp, parse_unix
from transport.admission import Acceptor, HandshakeGate, RefusalLog
from transport.auth import ConfigCheck, Deadline, HandshakeBusy, client_handshake, server_handshake
from transport.checksum import offload_default
from transport.connection import Connection, Frame, Operation
from transport.errors import AuthError, OpTimeout, TransportError
from transport.metrics import Metrics
from transport.pacing import TokenBucket
from transport.peer import RDMA_QP_METHOD, RDMA_REGIONS_METHOD, REGIONS_METHOD, Peer
from transport.rdma_control import RdmaControl
from transport.region import Region, RegionTable, as_byte_view
from transport.shm import ShmRing
from transport.transfer import Transfer
from transport.wire import FLAG_ERR, Op

log = logging.getLogger(__name__)

BACKENDS = ("tcp", "shm", "rdma")
Handler = Callable[[str, memoryview], object]


def _peer_liveness(extra: dict) -> float | None:
    """The liveness timeout a peer announced in its handshake extra (None from an older peer or
    a nonsensical value: then only this side's own heartbeat applies)."""
    value = extra.get("liveness_s")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


@dataclass(frozen=True)
class Notification:
    peer: str
    kind: str
    payload: bytes


class Endpoint(RdmaControl):
    """See the module docstring. ``timeout``: seconds of peer silence before its pending
    operations fail; ``op_timeout``: default per-operation deadline (None = no deadline);
    ``bandwidth``: per-endpoint pacing for all peers (``connect(bandwidth=)`` adds per-peer);
    ``payload_checksum=False`` skips the crc32c of WRITE payloads (headers, RPC and
    notifications stay checksummed) — both sides must agree, a checksumming receiver rejects
    unchecksummed writes. Only for trusted links where the CPU cost matters.
    ``handshake_timeout``: overall deadline of one handshake, either side (default ``timeout``);
    ``max_handshakes``: incoming connections allowed to be unauthenticated at once — more are
    refused on accept (the client's ``connect`` retries them until its deadline).
    ``config_check``: this endpoint's configuration, sent to every peer in the handshake, and the
    test it applies to theirs; a refused peer is never adopted (transport/auth.py).
    ``checksum_offload``: large payloads' crc32c on side threads while the socket copies (True),
    or on the socket threads on cache-hot pieces (False); None picks side threads only when the
    process has >= 4 cores (transport.checksum.offload_default). Same wire format either way."""

    def __init__(self, name: str, backend: str = "tcp", *, secret: bytes | str,
                 bandwidth: str | float | None = None, timeout: float = 5.0,
                 heartbeat: float | None = None, op_timeout: float | None = 60.0,
                 max_message: int = 256 << 20, rpc_workers: int = 4, ring_bytes: int = 32 << 20,
                 payload_checksum: bool = True, rdma_device=None, handshake_timeout: float | None = None,
                 max_handshakes: int = 32, config_check: ConfigCheck | None = None,
                 checksum_offload: bool | None = None):
        if not isinstance(name, str) or not name or len(name.encode()) > 200:
            raise ValueError(f"endpoint name {name!r} must be a non-empty string (<= 200 bytes)")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 8:
            raise ValueError("secret must be a shared bytes/str of at least 8 bytes "
                             "(the same value on every endpoint of the deployment)")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        heartbeat = timeout / 5 if heartbeat is None else heartbeat
        if not 0 < heartbeat < timeout:
            raise ValueError(f"heartbeat={heartbeat} must be in (0, timeout={timeout})")
        if op_timeout is not None and not op_timeout > 0:
            raise ValueError(f"op_timeout={op_timeout} must be > 0 seconds or None")
        if max_message < 4096:
            raise ValueError(f"max_message={max_message} must be >= 4096 bytes")
        if rpc_workers < 1:
            raise ValueError(f"rpc_workers={rpc_workers} must be >= 1")
        handshake_timeout = timeout if handshake_timeout is None else handshake_timeout
        if not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout={handshake_timeout} must be > 0 seconds")
        self.name, self.backend = name, backend
        self._secret = bytes(secret)
        self.timeout, self.heartbeat, self.op_timeout = timeout, heartbeat, op_timeout
        self.max_message, self.ring_bytes = max_message, ring_bytes
        self.payload_checksum = bool(payload_checksum)
        self.checksum_offload = offload_default() if checksum_offload is None else bool(checksum_offload)
        self.handshake_timeout, self.config_check = handshake_timeout, config_check
        self._gate = HandshakeGate(max_handshakes)
        self._refusals = RefusalLog(log, name)
        self.rdma = None
        if backend == "rdma":
            from transport.rdma import open_device
            # raises BackendUnavailable naming the fix (--transport tcp) on machines without RDMA
            self.rdma = rdma_device if rdma_device is not None else open_device()
        elif rdma_device is not None:
            raise ValueError(f"rdma_device is only used with backend='rdma', not {backend!r}")
        self._mr: dict[int, object] = {}  # rdma: region id -> MemoryKeys
        self._rdma_out: dict[str, object] = {}  # rdma: peer name -> RdmaChannel we write through
        self._rdma_in: dict[str, object] = {}  # rdma: peer name -> passive QP the peer writes through
        self.regions = RegionTable()
        self.metrics = Metrics()
        self.pacer = TokenBucket(bandwidth) if bandwidth is not None else None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._peers: dict[str, Peer] = {}
        self._conns: set[Connection] = set()
        self._handlers: dict[str, Handler] = {}
        self._notify_handlers: dict[str, Callable[[Notification], None]] = {}
        self._transfer_observers: tuple = ()
        self._inbox: queue.Queue[Notification] = queue.Queue()
        self._notify_q: queue.Queue = queue.Queue()
        self._rpc_workers = rpc_workers
        self._executor: ThreadPoolExecutor | None = None
        self._acceptor: Acceptor | None = None
        self.address: str | None = None
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name=f"jkvt-watchdog-{name}")
        self._dispatcher = threading.Thread(target=self._dispatch_notifications, daemon=True,
                                            name=f"jkvt-notify-{name}")
        self._watchdog.start()
        self._dispatcher.start()
        self._rdma_poller = None
        if self.rdma is not None:
            self._rdma_poller = threading.Thread(target=self._poll_rdma, daemon=True,
                                                 name=f"jkvt-rdma-{name}")
            self._rdma_poller.start()

    def __repr__(self) -> str:
        return f"<Endpoint {self.name!r} {self.backend} at {self.address}>"

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ regions / handlers
    def register(self, name: str, array) -> Region:
        """Expose a writable C-contiguous buffer to authenticated peers under ``name``
        (rdma: also registers it with the NIC)."""
        region = self.regions.register(name, array)
        if self.rdma is not None:
            from transport.rdma import buffer_address
            try:
                self._mr[region.id] = self.rdma.register(buffer_address(region.view), region.nbytes)
            except Exception:
                self.regions.unregister(name)
                raise
        return region

    def unregister(self, name: str) -> None:
        """Stop accepting writes into ``name``; frames aimed at it are rejected from now on."""
        region = self.regions.by_name(name)
        self.regions.unregister(name)
        keys = self._mr.pop(region.id, None)
        if keys is not None:
            self.rdma.deregister(keys)

    def serve(self, method: str, handler: Handler) -> None:
        """Answer ``call(method, payload)``: ``handler(peer_name, payload) -> bytes-like``.
        An exception in the handler reaches the caller as RemoteError."""
        if method.startswith("_jkv."):
            raise ValueError(f"method {method!r}: the '_jkv.' prefix is reserved")
        self._handlers[method] = handler

    def observe_transfers(self, observer: Callable[[Transfer], None]) -> None:
        """``observer(transfer)`` for every operation this endpoint starts, once done (COMPLETE or
        FAILED), on the thread that finished it (quick, never blocking; see Transfer's timings)."""
        with self._lock:
            self._transfer_observers = (*self._transfer_observers, observer)

    def transfer_finished(self, transfer: Transfer) -> None:
        for observer in self._transfer_observers:  # Connection hook; an observer's error is logged
            try:
                observer(transfer)
            except Exception:  # noqa: BLE001 - an observer must never break the transport thread
                log.exception("transfer observer %r failed on %r", observer, transfer)

    def on_notify(self, kind: str, handler: Callable[[Notification], None]) -> None:
        """Run ``handler(notification)`` on the dispatcher thread for every ``kind`` message."""
        self._notify_handlers[kind] = handler

    def next_notification(self, timeout: float | None = None) -> Notification:
        """Next notification with no ``on_notify`` handler, in arrival order."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise OpTimeout(f"no notification for {self.name!r} within {timeout}s") from None

    # ------------------------------------------------------------------ peers
    @property
    def peers(self) -> dict[str, Peer]:
        with self._lock:
            return dict(self._peers)

    def peer(self, name: str) -> Peer:
        with self._lock:
            p = self._peers.get(name)
        if p is None:
            raise KeyError(f"{self.name!r} has no connected peer {name!r} (have {sorted(self._peers)})")
        return p

    def listen(self, address: str | tuple | None = None) -> str:
        """Accept peers. tcp: binds 127.0.0.1 on a free port unless ``address`` says otherwise;
        shm: an abstract unix socket. Returns the address string peers pass to connect()."""
        if self._acceptor is not None:
            raise RuntimeError(f"{self.name!r} is already listening on {self.address}")
        if self.backend == "shm":
            address = address or f"@jkvt-{self.name}-{os.getpid()}-{_secrets.token_hex(4)}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(parse_unix(address))
            self.address = address
        else:
            host, port = parse_tcp(address) if address is not None else ("127.0.0.1", 0)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            self.address = f"{host}:{sock.getsockname()[1]}"
        sock.listen(64)
        self._acceptor = Acceptor(sock, self.name, self._authenticate_incoming, self._gate,
                                  self._refusals, self.metrics)
        self._acceptor.start()
        log.info("%r listening on %s", self.name, self.address)
        return self.address

    def connect(self, address: str | tuple, *, bandwidth: str | float | None = None,
                connect_timeout: float | None = None, streams: int = 1) -> Peer:
        """Connect and authenticate; retries refused connections for ``connect_timeout``
        seconds (default ``timeout``). ``bandwidth`` paces this peer only (shared by its
        streams). ``streams`` > 1 opens that many connections and spreads writes over them
        (each write's block and mask stay on one stream; see Peer for the ordering rules)."""
        self._check_open()
        if not isinstance(streams, int) or not 1 <= streams <= 16:
            raise ValueError(f"streams={streams!r} must be an int in [1, 16]")
        deadline = time.monotonic() + (self.timeout if connect_timeout is None else connect_timeout)
        pacer = TokenBucket(bandwidth) if bandwidth is not None else None
        session = _secrets.token_hex(8)
        peer = None
        for stream in range(streams):
            try:
                sock, peer_name, ring_tx, ring_rx, liveness = self._open_stream(
                    address, deadline, {"session": session, "stream": stream, "streams": streams})
            except TransportError:
                if peer is not None:
                    peer.close()
                raise
            if peer is None:
                peer = self._adopt(sock, peer_name, pacer, ring_tx, ring_rx, session=session,
                                   peer_liveness=liveness)
            else:
                self._attach(peer, sock, pacer, ring_tx, ring_rx, peer_liveness=liveness)
        return peer

    def _open_stream(self, address, deadline: float, info: dict):
        """Connect and authenticate one stream; refused connections and busy servers are
        retried with backoff until the monotonic ``deadline``."""
        delay = 0.02
        while True:
            try:
                return self._try_stream(address, deadline, info)
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout, HandshakeBusy) as e:
                if time.monotonic() + delay > deadline:
                    raise TransportError(f"{self.name!r} could not connect to {address!r}: {e}") from None
                self.metrics.incr("retries")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _try_stream(self, address, deadline: float, info: dict):
        sock = self._new_socket()
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.connect(parse_unix(address) if self.backend == "shm" else parse_tcp(address))
        except OSError:
            sock.close()
            raise
        ring_tx = ring_rx = None
        try:
            if self.backend == "shm":
                ring_tx = ShmRing.create(self.ring_bytes)
            extra = json.dumps({**info, "ring": ring_tx.name if ring_tx else None, **self._my_config()}).encode()
            peer_name, server_extra = client_handshake(sock, self._secret, self.name, self.backend,
                                                       Deadline(self.handshake_timeout), lambda: extra)
            heard = json.loads(server_extra)
            if self.config_check is not None:
                self.config_check.verify(heard)
            if ring_tx is not None:
                ring_rx = ShmRing.attach(heard["ring"])
            sock.settimeout(None)
        except (AuthError, OSError, ValueError, KeyError, TypeError) as e:
            for ring in (ring_tx, ring_rx):
                if ring is not None:
                    ring.close()
            sock.close()
            if isinstance(e, HandshakeBusy):
                raise
            self.metrics.incr("auth_failures")
            if isinstance(e, AuthError):
                raise
            raise AuthError(f"handshake with {address!r} failed: {e}") from e
        return sock, peer_name, ring_tx, ring_rx, _peer_liveness(heard)

    def _my_config(self) -> dict:
        """What this side tells a peer in the handshake: its liveness timeout (the peer heartbeats
        within a fifth of it) and, with ``config_check``, its configuration."""
        mine = {"liveness_s": self.timeout}
        return mine if self.config_check is None else {**mine, "config": self.config_check.config}

    def _new_socket(self) -> socket.socket:
        if self.backend == "shm":
            return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _adopt(self, sock, peer_name: str, pacer: TokenBucket | None = None,
               ring_tx: ShmRing | None = None, ring_rx: ShmRing | None = None, *,
               session: str = "", peer_liveness: float | None = None) -> Peer:
        """Wrap an authenticated socket in a Connection + Peer and start its threads."""
        pacers = [p for p in (pacer, self.pacer) if p is not None]
        conn = Connection(self, sock, peer_name, pacers=pacers, ring_tx=ring_tx, ring_rx=ring_rx,
                          peer_liveness=peer_liveness)
        peer = Peer(self, conn, session)
        with self._lock:
            if self._closed.is_set():
                sock.close()
                raise TransportError(f"endpoint {self.name!r} is closed")
            old = self._peers.get(peer_name)
            self._peers[peer_name] = peer
            self._conns.add(conn)
        conn.start()
        self.metrics.incr("peers_connected")
        if old is not None:
            for c in old.connections:
                c.fail(TransportError(f"replaced by a new connection from {peer_name!r}"))
        return peer

    def _attach(self, peer: Peer, sock, pacer: TokenBucket | None = None,
                ring_tx: ShmRing | None = None, ring_rx: ShmRing | None = None, *,
                peer_liveness: float | None = None) -> None:
        """Add one more stream (connection) to an existing peer."""
        pacers = [p for p in (pacer, self.pacer) if p is not None]
        conn = Connection(self, sock, peer.name, pacers=pacers, ring_tx=ring_tx, ring_rx=ring_rx,
                          peer_liveness=peer_liveness)
        with self._lock:
            if self._closed.is_set() or self._peers.get(peer.name) is not peer or not peer.alive:
                sock.close()
                for ring in (ring_tx, ring_rx):
                    if ring is not None:
                        ring.close()
                raise TransportError(f"peer {peer.name!r} is gone; stream not attached")
            peer.add_stream(conn)
            self._conns.add(conn)
        conn.start()

    def _authenticate_incoming(self, sock: socket.socket) -> None:
        """Acceptor: server side of the handshake on a handshake thread; adopts the peer."""
        rings: dict[str, ShmRing] = {}

        info: dict = {}

        def welcome_extra(client_extra: bytes) -> bytes:
            info.update(json.loads(client_extra))
            if self.config_check is not None:
                self.config_check.verify(info)
            if self.backend != "shm":
                return json.dumps({"ring": None, **self._my_config()}).encode()
            rings["rx"] = ShmRing.attach(info["ring"])
            rings["tx"] = ShmRing.create(self.ring_bytes)
            return json.dumps({"ring": rings["tx"].name, **self._my_config()}).encode()

        try:
            if self.backend != "shm":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer_name, _ = server_handshake(sock, self._secret, self.name, self.backend,
                                            Deadline(self.handshake_timeout), welcome_extra)
            sock.settimeout(None)
            session = str(info.get("session", ""))
            liveness = _peer_liveness(info)
            if int(info.get("stream", 0)) == 0:
                self._adopt(sock, peer_name, None, rings.get("tx"), rings.get("rx"), session=session,
                            peer_liveness=liveness)
            else:  # a further stream of a peer that connected with streams > 1
                with self._lock:
                    peer = self._peers.get(peer_name)
                if peer is None or not session or peer.session != session:
                    raise TransportError(f"stream {info.get('stream')} of {peer_name!r} names an "
                                         f"unknown session")
                self._attach(peer, sock, None, rings.get("tx"), rings.get("rx"), peer_liveness=liveness)
        except (AuthError, OSError, ValueError, KeyError, TypeError, TransportError) as e:
            self.metrics.incr("auth_failures")
            self._refusals.refused(str(e))
            for ring in rings.values():
                ring.close()
            sock.close()

    # ------------------------------------------------------------------ called by its connections
    # Connection's host interface (transport.connection.ConnectionHost): the reader thread
    # reports calls, notifications and its end here; not for users of the endpoint.
    def connection_failed(self, conn: Connection, error: TransportError) -> None:
        """``conn`` failed: its peer (every stream of it, and its rdma channels) goes down."""
        with self._lock:
            p = self._peers.get(conn.peer_name)
            if p is None or conn not in p.connections:
                return  # a stream of a peer that is already gone (or was replaced)
            del self._peers[conn.peer_name]
            channel = self._rdma_out.pop(conn.peer_name, None)
            passive = self._rdma_in.pop(conn.peer_name, None)
        if not self._closed.is_set():
            self.metrics.incr("peers_failed")
        for other in p.connections:  # one stream down takes the whole peer down
            other.fail(error)
        if channel is not None:  # the control channel is the liveness signal for RDMA too
            channel.fail(error)
            channel.close()
        if passive is not None:
            passive.close()

    def connection_closed(self, conn: Connection) -> None:
        """``conn``'s threads are done and its socket closed: release its shm rings."""
        with self._lock:
            self._conns.discard(conn)
        for ring in (conn.ring_tx, conn.ring_rx):
            if ring is not None:
                ring.close()

    def incoming_call(self, conn: Connection, seq: int, method: str, payload: memoryview) -> None:
        """A CALL arrived on ``conn``: run its handler on the RPC pool; the reply goes back on ``conn``."""
        with self._lock:
            if self._closed.is_set():
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._rpc_workers,
                                                    thread_name_prefix=f"jkvt-rpc-{self.name}")
            self._executor.submit(self._run_call, conn, seq, method, payload)

    def _run_call(self, conn: Connection, seq: int, method: str, payload: memoryview) -> None:
        try:
            if method == REGIONS_METHOD:
                result = self.regions.encode()
            elif method in (RDMA_REGIONS_METHOD, RDMA_QP_METHOD) and self.rdma is not None:
                result = self._rdma_control(conn.peer_name, method, payload)
            else:
                handler = self._handlers.get(method)
                if handler is None:
                    raise LookupError(f"endpoint {self.name!r} serves no method {method!r} "
                                      f"(serves {sorted(self._handlers)})")
                result = handler(conn.peer_name, payload)
            frame = Frame(Op.REPLY, [as_byte_view(b"" if result is None else result,
                                                  what=f"reply of {method!r}")], aux=seq)
        except Exception as e:  # the caller gets it as RemoteError; we log it
            log.warning("handler %r on %r failed: %s", method, self.name, e, exc_info=True)
            frame = Frame(Op.REPLY, [f"{type(e).__name__}: {e}".encode()[:4000]], aux=seq,
                          flags=FLAG_ERR)
        deadline = None if self.op_timeout is None else time.monotonic() + self.op_timeout
        conn.submit(Operation(Transfer("reply", conn.peer_name, frame.length, deadline),
                              [frame], "none"))

    def incoming_notify(self, conn: Connection, kind: str, payload: memoryview) -> None:
        """A NOTIFY arrived on ``conn``: queue it for the dispatcher thread (arrival order)."""
        self._notify_q.put(Notification(conn.peer_name, kind, bytes(payload)))

    def _dispatch_notifications(self) -> None:
        while True:
            n = self._notify_q.get()
            if n is None:
                return
            handler = self._notify_handlers.get(n.kind)
            if handler is None:
                self._inbox.put(n)
                continue
            try:
                handler(n)
            except Exception:
                log.exception("notification handler for %r on %r failed", n.kind, self.name)

    def _watch(self) -> None:
        tick = min(0.05, self.heartbeat / 2)
        while not self._closed.wait(tick):
            now = time.monotonic()
            with self._lock:
                conns = list(self._conns)
            for conn in conns:
                conn.tick(now)

    # ------------------------------------------------------------------ shutdown
    def _check_open(self) -> None:
        if self._closed.is_set():
            raise TransportError(f"endpoint {self.name!r} is closed")

    def close(self) -> None:
        """Fail every pending operation, close all connections and join every thread."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._acceptor is not None:
            self._acceptor.close()  # joins the acceptor and every handshake thread
        self._refusals.flush(force=True)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.fail(TransportError(f"endpoint {self.name!r} closed"))
        for conn in conns:
            conn.join()
        self._watchdog.join()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self._notify_q.put(None)
        self._dispatcher.join()
        if self._rdma_poller is not None:
            self._rdma_poller.join()
            for item in list(self._rdma_out.values()) + list(self._rdma_in.values()):
                item.close()
            self._rdma_out.clear()
            self._rdma_in.clear()
            for keys in self._mr.values():
                self.rdma.deregister(keys)
            self._mr.clear()
            self.rdma.close()
