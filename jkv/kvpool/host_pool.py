"""In-process host-memory KV pool with a byte capacity and LRU eviction.

This is the store at the core of the `jkv pool` server (the server adds the transport in front
of it). Concurrency: one `threading.Lock` guards the LRU map and counters; payload copies into
callers' buffers happen under the lock too, so a concurrent `put`/eviction can never tear a read
(entries are immutable bytes objects, so the copy is a single memcpy per chunk).
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence

import numpy as np

from jkv.kvpool.base import (ChunkMeta, KVPool, Payload, PoolStats, buffer_views, check_fits,
                             checked_put, verified)
from jkv.kvpool.hashing import ChunkKey

log = logging.getLogger(__name__)


class HostKVPool(KVPool):
    """LRU pool of chunk payloads in this process's memory, at most `capacity_bytes` of payload.

    A hit (get) refreshes recency; contains/longest_prefix do not (a probe is not a use).
    A payload larger than the whole capacity is rejected (put returns False).
    """

    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"{capacity_bytes=} must be an int >= 1 (bytes of payload to keep)")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, tuple[bytes, ChunkMeta]] = (
            collections.OrderedDict())
        self._bytes_used = 0
        self._hits = self._misses = self._puts = self._rejected = self._evictions = 0

    def put(self, key: ChunkKey, payload: Payload, meta: ChunkMeta | None = None) -> bool:
        view, meta = checked_put(key, payload, meta)
        data = view.tobytes()
        with self._lock:
            if meta.nbytes > self.capacity_bytes:
                self._rejected += 1
                log.warning("rejected %s: %d bytes exceed pool capacity %d", key.name,
                            meta.nbytes, self.capacity_bytes)
                return False
            old = self._entries.pop(key.name, None)
            if old is not None:
                self._bytes_used -= old[1].nbytes
            while self._bytes_used + meta.nbytes > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes_used -= evicted.nbytes
                self._evictions += 1
            self._entries[key.name] = (data, meta)
            self._bytes_used += meta.nbytes
            self._puts += 1
        return True

    def get_many(self, keys: Sequence[ChunkKey],
                 buffers: Sequence[np.ndarray | bytearray | memoryview]) -> list[ChunkMeta | None]:
        views = buffer_views(keys, buffers)
        out: list[ChunkMeta | None] = []
        with self._lock:
            for i, (key, view) in enumerate(zip(keys, views)):
                entry = self._entries.get(key.name)
                if entry is None or not verified(key, entry[1], memoryview(entry[0])):
                    self._misses += 1
                    out.append(None)
                    continue
                data, meta = entry
                check_fits(key, meta, view, i)
                view[:meta.nbytes] = data
                self._entries.move_to_end(key.name)
                self._hits += 1
                out.append(meta)
        return out

    def lookup_many(self, keys: Sequence[ChunkKey]) -> list[tuple[bytes, ChunkMeta] | None]:
        """Like get_many, but hands out the stored (immutable) bytes instead of copying them into
        buffers: the `jkv pool` server sends them straight into its reply. Counts hits/misses and
        refreshes recency exactly as get_many does."""
        out: list[tuple[bytes, ChunkMeta] | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key.name)
                if entry is None or not verified(key, entry[1], memoryview(entry[0])):
                    self._misses += 1
                    out.append(None)
                    continue
                self._entries.move_to_end(key.name)
                self._hits += 1
                out.append(entry)
        return out

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k.name in self._entries for k in keys]

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._entries.pop(key.name, None)
            if entry is None:
                return False
            self._bytes_used -= entry[1].nbytes
            return True

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(entries=len(self._entries), bytes_used=self._bytes_used,
                             capacity_bytes=self.capacity_bytes, hits=self._hits,
                             misses=self._misses, puts=self._puts, rejected_puts=self._rejected,
                             evictions=self._evictions, errors=0)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes_used = 0
