"""The L3 KV pool interface (CALVO §2.2: the remote CPU-DRAM prefix cache) and its metadata.

A pool maps `ChunkKey` -> (payload bytes, `ChunkMeta`). Readers fetch many chunks at once into
host buffers they preallocated (the L2 staging area), so a load costs one round trip and one
copy per chunk. Every backend obeys one rule: a pool may *miss* (evicted, unreachable, corrupt)
but must never return bytes that were not written under that key — a miss means "recompute",
a wrong hit means wrong tokens. Payloads are verified by length and CRC32C against the metadata
stored with them, and the metadata names its own key.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence

import crc32c
import numpy as np

from jkv.kvpool.hashing import ChunkKey, ChunkNamespace, chunk_keys

log = logging.getLogger(__name__)

Payload = bytes | bytearray | memoryview | np.ndarray


@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """Describes one stored chunk. `shape`/`dtype` let a reader view its buffer as the KV array
    (e.g. `[L, 2, H_kv, C, D]`); `nbytes` and `crc32c` verify the payload; `key_name` ties the
    metadata to the key it was written under."""

    key_name: str
    nbytes: int
    crc32c: int
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    num_tokens: int = 0

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "ChunkMeta":
        fields = json.loads(raw)
        fields["shape"] = tuple(fields["shape"])
        return cls(**fields)

    def view(self, buffer: np.ndarray | memoryview | bytearray) -> np.ndarray:
        """The first `nbytes` of `buffer` viewed as the stored array (`dtype`, `shape`)."""
        flat = np.frombuffer(memoryview(buffer).cast("B")[:self.nbytes], dtype=np.uint8)
        if not self.shape:
            return flat
        return flat.view(np.dtype(self.dtype)).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class PoolStats:
    entries: int
    bytes_used: int
    capacity_bytes: int | None
    hits: int
    misses: int
    puts: int
    rejected_puts: int
    evictions: int
    errors: int


def payload_view(payload: Payload) -> memoryview:
    """A flat byte view of `payload` (no copy for bytes and C-contiguous arrays)."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise ValueError(f"ndarray payload must be C-contiguous, got strides {payload.strides}; "
                             "pass np.ascontiguousarray(x)")
        return memoryview(payload.reshape(-1).view(np.uint8))
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).cast("B")
    raise TypeError(f"payload must be bytes or a numpy array, got {type(payload).__name__}")


def make_meta(key: ChunkKey, payload: Payload, num_tokens: int | None = None) -> ChunkMeta:
    """Metadata for `payload` stored under `key` (shape/dtype recorded for ndarray payloads)."""
    view = payload_view(payload)
    shape = tuple(payload.shape) if isinstance(payload, np.ndarray) else ()
    dtype = payload.dtype.name if isinstance(payload, np.ndarray) else "uint8"
    return ChunkMeta(key_name=key.name, nbytes=view.nbytes, crc32c=crc32c.crc32c(view),
                     dtype=dtype, shape=shape,
                     num_tokens=key.namespace.chunk_tokens if num_tokens is None else num_tokens)


def checked_put(key: ChunkKey, payload: Payload, meta: ChunkMeta | None) -> tuple[memoryview, ChunkMeta]:
    """(byte view, meta) for a put; ValueError when a caller's `meta` does not describe `payload`."""
    view = payload_view(payload)
    meta = meta or make_meta(key, payload)
    if meta.nbytes != view.nbytes or meta.key_name != key.name:
        raise ValueError(f"meta {meta} does not describe a {view.nbytes}-byte payload "
                         f"for {key.name}")
    return view, meta


class Reachability:
    """Dead-backend bookkeeping shared by the networked pools: after a failure the pool counts as
    unreachable for `retry_after_s` (every lookup a miss, i.e. recompute), then is tried again.
    Subclasses call `_init_bookkeeping` in their constructor."""

    _dead = False
    _dead_until = 0.0

    def _init_bookkeeping(self, where: str, retry_after_s: float) -> None:
        """`where` names the backend in logs; `_lock` guards the hit/miss/put/error counters."""
        self._where = where
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._hits = self._misses = self._puts = self._rejected = self._errors = 0
        self._corrupt = 0  # entries that failed verification (served as misses)

    def _usable(self) -> bool:
        with self._lock:
            return not self._dead or time.monotonic() >= self._dead_until

    @property
    def reachable(self) -> bool:
        """False while the pool counts as dead (no network touched: callers skip it cheaply)."""
        return self._usable()

    @property
    def errors(self) -> int:
        """Failed operations so far (timeouts, refused or lost connections, refusals)."""
        with self._lock:
            return self._errors

    @property
    def corrupt(self) -> int:
        """Entries that failed verification so far (each was a miss, never a hit)."""
        with self._lock:
            return self._corrupt

    def _mark_failed(self, op: str, exc: Exception) -> None:
        with self._lock:
            self._errors += 1
            self._dead_until = time.monotonic() + self._retry_after_s
            if not self._dead:
                self._dead = True
                log.warning("KV pool %s unreachable during %s (%s: %s); treating every lookup as "
                            "a miss (recompute) and retrying in %.1f s", self._where, op,
                            type(exc).__name__, exc, self._retry_after_s)

    def _count_put(self, stored: bool) -> bool:
        """Count a put as stored or rejected; returns `stored`."""
        with self._lock:
            if stored:
                self._puts += 1
            else:
                self._rejected += 1
        return stored

    def _tally(self, out: list) -> list:
        """Count a get_many's hits (non-None entries) and misses; returns `out`."""
        hits = sum(m is not None for m in out)
        with self._lock:
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def _mark_ok(self) -> None:
        with self._lock:
            if self._dead:
                self._dead = False
                log.warning("KV pool %s reachable again", self._where)

    def _fill_verified(self, key: ChunkKey, meta: ChunkMeta | None, payload: memoryview,
                       view: memoryview, index: int) -> ChunkMeta | None:
        """Copy a fetched chunk into the caller's `view` (buffers[index]) iff it is what was
        written under `key` (`verified`); otherwise log it and return None (a miss, never
        copied). ValueError if it verifies but does not fit the buffer."""
        if meta is None or not verified(key, meta, payload):
            log.warning("KV pool %s sent %s failing verification; treated as a miss",
                        self._where, key.name)
            with self._lock:
                self._corrupt += 1
            return None
        check_fits(key, meta, view, index)
        view[:meta.nbytes] = payload
        return meta


def buffer_views(keys: Sequence[ChunkKey], buffers) -> list[memoryview]:
    """One writable view per key for `get_many` (ValueError on a count mismatch or unusable buffer)."""
    if len(keys) != len(buffers):
        raise ValueError(f"got {len(keys)} keys but {len(buffers)} buffers; pass one each")
    return [buffer_view(k, b, i) for i, (k, b) in enumerate(zip(keys, buffers))]


def buffer_view(key: ChunkKey, buffer, index: int) -> memoryview:
    """Writable flat byte view of a caller's preallocated buffer (ValueError if unusable)."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise ValueError(f"buffers[{index}] for {key.name} must be a writeable C-contiguous "
                             "array")
        return memoryview(buffer.reshape(-1).view(np.uint8))
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError(f"buffers[{index}] for {key.name} is read-only; pass a bytearray or array")
    return view.cast("B")


def check_fits(key: ChunkKey, meta: ChunkMeta, view: memoryview, index: int) -> None:
    if view.nbytes < meta.nbytes:
        raise ValueError(f"buffers[{index}] holds {view.nbytes} bytes but {key.name} needs "
                         f"{meta.nbytes}; allocate buffers of the chunk size")


def verified(key: ChunkKey, meta: ChunkMeta, payload: memoryview) -> bool:
    """True iff `payload` is exactly what was written under `key` (length, CRC32C, key name)."""
    return (meta.key_name == key.name and meta.nbytes == payload.nbytes
            and crc32c.crc32c(payload) == meta.crc32c)


class KVPool(abc.ABC):
    """L3 prefix-cache pool. Thread-safe: executors of the loading pipeline call it concurrently.

    All methods degrade on backend failure rather than raise: reads miss, writes return False.
    Caller errors (a buffer too small, a non-contiguous array) raise ValueError.
    """

    @abc.abstractmethod
    def put(self, key: ChunkKey, payload: Payload, meta: ChunkMeta | None = None) -> bool:
        """Store a chunk (payload copied). False if rejected (too big, pool unreachable)."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[ChunkKey],
                 buffers: Sequence[np.ndarray | bytearray | memoryview]) -> list[ChunkMeta | None]:
        """Copy each hit's payload into the front of buffers[i]; return its meta, or None on a miss.

        buffers[i] must hold at least the stored payload (else ValueError naming the key).
        """

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key (a hint: a later get may still miss after eviction)."""

    @abc.abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove a chunk; True if it was present."""

    @abc.abstractmethod
    def stats(self) -> PoolStats:
        """Counters since creation plus current occupancy."""

    def close(self) -> None:
        """Release connections/memory. Idempotent."""

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def longest_prefix(self, tokens: Sequence[int] | np.ndarray, namespace: ChunkNamespace) -> int:
        """Number of leading full chunks of `tokens` present in the pool (0 on a dead pool)."""
        return self.longest_prefix_keys(chunk_keys(tokens, namespace))

    def longest_prefix_keys(self, keys: Sequence[ChunkKey]) -> int:
        hits = self.contains_many(keys)
        count = 0
        for present in hits:
            if not present:
                break
            count += 1
        return count

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
