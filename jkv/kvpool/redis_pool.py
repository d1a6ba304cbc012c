"""Redis (or Valkey) backed L3 KV pool, for pools that span machines (LMCache-style).

Layout: one Redis hash per chunk, key `jkv:<model>:<dtype>:c<C>:<chained hash hex>`, fields
`payload` (raw bytes) and `meta` (JSON `ChunkMeta`). One HSET writes both atomically and a
server-side eviction (`maxmemory-policy allkeys-lru`) drops both together, so a reader never
sees a payload without its metadata. Reads are one pipelined HMGET round trip per batch; each
payload is verified (length, CRC32C, key name) and copied into the caller's preallocated buffer.

Failure model: any connection error or timeout marks the pool dead for `retry_after_s`; while
dead every read misses and every write is dropped without touching the network, so a killed
server costs at most one timeout per `retry_after_s` and the engine recomputes instead of
loading. The transition dead/alive is logged once each way.

Concurrency: redis-py's client is thread-safe (a connection pool; each pipeline checks out one
connection); the counters and the dead-until timestamp are guarded by a small lock.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jkv.kvpool.base import (ChunkMeta, KVPool, Payload, PoolStats, Reachability, buffer_views,
                             checked_put)
from jkv.kvpool.hashing import ChunkKey

log = logging.getLogger(__name__)

_PAYLOAD = b"payload"
_META = b"meta"


class RedisKVPool(Reachability, KVPool):
    """KV pool client for a Redis server at `url` ("redis://host:port/db").

    socket_timeout_s: per-operation timeout; a slower answer counts as a dead pool.
    retry_after_s: how long to treat the pool as dead after a failure before trying again.
    ttl_s: optional expiry for stored chunks (None: rely on the server's maxmemory policy).
    retries: redis-py's own retries of a failed command (None: its default, 3 with backoff, so one
    operation may take 4x socket_timeout_s); 0 makes socket_timeout_s the bound of an operation.
    """

    def __init__(self, url: str, *, socket_timeout_s: float = 1.0, retry_after_s: float = 2.0,
                 ttl_s: int | None = None, retries: int | None = None):
        if socket_timeout_s <= 0 or retry_after_s < 0:
            raise ValueError(f"{socket_timeout_s=} must be > 0 and {retry_after_s=} >= 0")
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"{ttl_s=} must be None or >= 1 second")
        self.url = url
        if retries is not None and retries < 0:
            raise ValueError(f"{retries=} must be None (redis-py's default) or >= 0")
        extra = {} if retries is None else {"retry": Retry(NoBackoff(), retries)}
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s,
                                            decode_responses=False, **extra)
        self._ttl_s = ttl_s
        self._init_bookkeeping(url, retry_after_s)

    # -- KVPool -------------------------------------------------------------------------------
    def put(self, key: ChunkKey, payload: Payload, meta: ChunkMeta | None = None) -> bool:
        view, meta = checked_put(key, payload, meta)
        if not self._usable():
            return self._count_put(False)
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.hset(key.name, mapping={_PAYLOAD: view.tobytes(), _META: meta.to_json()})
            if self._ttl_s is not None:
                pipe.expire(key.name, self._ttl_s)
            pipe.execute()
        except redis.RedisError as exc:
            self._mark_failed("put", exc)
            return self._count_put(False)
        self._mark_ok()
        return self._count_put(True)

    def get_many(self, keys: Sequence[ChunkKey],
                 buffers: Sequence[np.ndarray | bytearray | memoryview]) -> list[ChunkMeta | None]:
        views = buffer_views(keys, buffers)
        if not keys:
            return []
        replies = self._batch("get_many", lambda pipe, k: pipe.hmget(k.name, _PAYLOAD, _META),
                              keys)
        if replies is None:
            with self._lock:
                self._misses += len(keys)
            return [None] * len(keys)
        return self._tally([
            None if payload is None          # no entry under this key: a plain miss
            else self._fill_verified(key, _parse_meta(key, raw_meta), memoryview(payload), view, i)
            for i, (key, view, (payload, raw_meta)) in enumerate(zip(keys, views, replies))])

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        replies = self._batch("contains", lambda pipe, k: pipe.exists(k.name), keys)
        if replies is None:
            return [False] * len(keys)
        return [bool(r) for r in replies]

    def delete(self, key: ChunkKey) -> bool:
        replies = self._batch("delete", lambda pipe, k: pipe.delete(k.name), [key])
        return bool(replies and replies[0])

    def stats(self) -> PoolStats:
        entries = bytes_used = 0
        capacity = None
        if self._usable():
            try:
                entries = int(self._client.dbsize())
                bytes_used = int(self._client.info("memory")["used_memory"])
                capacity = int(self._client.config_get("maxmemory").get(b"maxmemory", 0)) or None
                self._mark_ok()
            except redis.RedisError as exc:
                self._mark_failed("stats", exc)
        with self._lock:
            return PoolStats(entries=entries, bytes_used=bytes_used, capacity_bytes=capacity,
                             hits=self._hits, misses=self._misses, puts=self._puts,
                             rejected_puts=self._rejected, evictions=0, errors=self._errors)

    def close(self) -> None:
        self._client.close()

    def _batch(self, op: str, add, keys: Sequence[ChunkKey]) -> list | None:
        """One pipelined round trip; None if the pool is (or just became) unreachable."""
        if not self._usable():
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                add(pipe, key)
            replies = pipe.execute()
        except redis.RedisError as exc:
            self._mark_failed(op, exc)
            return None
        self._mark_ok()
        return replies


def _parse_meta(key: ChunkKey, raw: bytes | None) -> ChunkMeta | None:
    if raw is None:
        return None
    try:
        return ChunkMeta.from_json(raw)
    except (ValueError, TypeError, KeyError):
        log.warning("KV pool entry %s has unreadable metadata; treated as a miss", key.name)
        return None
