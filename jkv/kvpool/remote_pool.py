"""Client of the built-in `jkv pool` server: the same `KVPool` interface as `HostKVPool` and
`RedisKVPool`, so the loading pipeline's FETCH stage (`pool_fetch`) uses it unchanged.

A get is one RPC: the request names the keys and the caller's buffer sizes; the reply (the
hits' payloads, concatenated) lands straight in a per-thread staging buffer (`call(into=)`),
from which each verified payload is copied into the caller's preallocated buffer. The client
re-verifies every payload (length, CRC32C, key name) against its metadata, so even a faulty
server can only cause misses, never a wrong hit.

Failure model (as `RedisKVPool`): a dead connection (server killed), an operation past
`op_timeout_s` (server stopped or overloaded) or a refused connect marks the pool dead for
`retry_after_s`; meanwhile every read misses and every write is dropped without touching the
network, and the pipeline recomputes. After `retry_after_s` the next call reconnects.
A pending get never waits longer than `op_timeout_s`.

Concurrency: any thread may call any method (the pipeline's executors do). The transport's
`Peer` is thread-safe; a small lock guards reconnecting, the dead-until timestamp and counters.
Staging buffers are per thread. The endpoint's own threads (sender, reader, watchdog, ...) are
joined by `close()`.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence

import numpy as np

from jkv.kvpool import protocol
from jkv.kvpool.base import (ChunkMeta, KVPool, Payload, PoolStats, Reachability, buffer_views,
                             checked_put)
from jkv.kvpool.hashing import ChunkKey

log = logging.getLogger(__name__)


class RemoteKVPool(Reachability, KVPool):
    """KV pool client for a `jkv pool` server at `address`.

    secret: the deployment's shared secret (the server's --secret-env value).
    backend: "tcp" | "shm" | "rdma", as the server was started.
    bandwidth: optional pacing of what this client sends (puts), e.g. "10gbit".
    op_timeout_s: deadline of one operation; slower counts as a dead pool.
    retry_after_s: how long to treat the pool as dead after a failure before reconnecting.
    """

    def __init__(self, address: str, *, secret: bytes | str, backend: str = "tcp",
                 bandwidth: str | float | None = None, op_timeout_s: float = 2.0,
                 retry_after_s: float = 1.0, name: str | None = None):
        from transport import Endpoint

        if not op_timeout_s > 0 or retry_after_s < 0:
            raise ValueError(f"{op_timeout_s=} must be > 0 and {retry_after_s=} >= 0")
        self.address = address
        self._op_timeout_s = op_timeout_s
        self._init_bookkeeping(address, retry_after_s)
        self._bandwidth = bandwidth
        self._endpoint = Endpoint(name or f"kvpool-client-{secrets.token_hex(4)}", backend,
                                  secret=secret, timeout=max(op_timeout_s, 0.5),
                                  op_timeout=op_timeout_s)
        self._peer = None
        self._closed = False
        self._local = threading.local()

    # -- connection and failure handling ----------------------------------------------------------
    def _get_peer(self):
        """The live peer, (re)connecting if due; None while the pool counts as dead."""
        from transport import TransportError

        with self._lock:
            if self._closed:
                raise RuntimeError("RemoteKVPool is closed; create a new one")
            if self._peer is not None and self._peer.alive:
                return self._peer
            if self._dead and time.monotonic() < self._dead_until:
                return None
            old, self._peer = self._peer, None
        if old is not None:
            old.close()
        try:
            peer = self._endpoint.connect(self.address, bandwidth=self._bandwidth,
                                          connect_timeout=self._op_timeout_s)
        except TransportError as exc:
            self._mark_failed("connect", exc)
            return None
        with self._lock:
            if self._peer is None:
                self._peer = peer
            elif self._peer is not peer:  # another thread connected first; keep one
                peer = self._peer
        self._mark_ok()
        return peer

    def _call(self, op: str, method: str, message, into=None):
        """(header, tail) of the reply, or None if the pool is (or just became) unreachable."""
        from transport import RemoteError, TransportError

        peer = self._get_peer()
        if peer is None:
            return None
        try:
            reply = peer.call(method, message, timeout=self._op_timeout_s, into=into)
        except RemoteError as exc:  # the server answered but refused: not a dead pool
            log.warning("KV pool %s refused %s: %s", self.address, op, exc)
            with self._lock:
                self._errors += 1
            return None
        except TransportError as exc:
            self._mark_failed(op, exc)
            return None
        try:
            return protocol.decode(reply)
        except ValueError as exc:
            log.warning("KV pool %s sent an unreadable %s reply: %s", self.address, op, exc)
            with self._lock:
                self._errors += 1
            return None

    def _staging(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 1 << 16), np.uint8)
            self._local.staging = buf
        return buf[:nbytes]

    # -- KVPool ---------------------------------------------------------------------------------
    def put(self, key: ChunkKey, payload: Payload, meta: ChunkMeta | None = None) -> bool:
        view, meta = checked_put(key, payload, meta)
        message = protocol.encode({"key": key.name, "meta": protocol.meta_to_dict(meta)}, view)
        reply = self._call("put", protocol.PUT, message)
        return self._count_put(reply is not None and bool(reply[0].get("stored")))

    def get_many(self, keys: Sequence[ChunkKey],
                 buffers: Sequence[np.ndarray | bytearray | memoryview]) -> list[ChunkMeta | None]:
        views = buffer_views(keys, buffers)
        if not keys:
            return []
        names = [k.name for k in keys]
        caps = [v.nbytes for v in views]
        staging = self._staging(protocol.reply_bound(names, caps))
        reply = self._call("get_many", protocol.GET,
                           protocol.encode({"keys": names, "caps": caps}), into=staging)
        metas_raw = None if reply is None else reply[0].get("metas")
        if metas_raw is None or len(metas_raw) != len(keys):
            with self._lock:
                self._misses += len(keys)
            return [None] * len(keys)
        tail = reply[1]
        out: list[ChunkMeta | None] = []
        offset = 0
        for i, (key, view, raw) in enumerate(zip(keys, views, metas_raw)):
            if raw is None:
                out.append(None)
                continue
            if "too_big" in raw:
                raise ValueError(f"buffers[{i}] holds {view.nbytes} bytes but {key.name} needs "
                                 f"{raw['too_big']}; allocate buffers of the chunk size")
            meta = protocol.meta_from_dict(raw)
            payload = tail[offset:offset + meta.nbytes]
            offset += meta.nbytes
            out.append(self._fill_verified(key, meta, payload, view, i))
        return self._tally(out)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        reply = self._call("contains", protocol.CONTAINS,
                           protocol.encode({"keys": [k.name for k in keys]}))
        present = None if reply is None else reply[0].get("present")
        if present is None or len(present) != len(keys):
            return [False] * len(keys)
        return [bool(p) for p in present]

    def delete(self, key: ChunkKey) -> bool:
        reply = self._call("delete", protocol.DELETE, protocol.encode({"key": key.name}))
        return reply is not None and bool(reply[0].get("deleted"))

    def server_stats(self) -> PoolStats | None:
        """The server's own counters and occupancy (None while the pool is unreachable)."""
        reply = self._call("stats", protocol.STATS, protocol.encode({}))
        return None if reply is None else PoolStats(**reply[0])

    def stats(self) -> PoolStats:
        """This client's hit/miss/put counters plus the server's occupancy when reachable."""
        server = self.server_stats()
        with self._lock:
            return PoolStats(entries=server.entries if server else 0,
                             bytes_used=server.bytes_used if server else 0,
                             capacity_bytes=server.capacity_bytes if server else None,
                             hits=self._hits, misses=self._misses, puts=self._puts,
                             rejected_puts=self._rejected,
                             evictions=server.evictions if server else 0, errors=self._errors)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._endpoint.close()
