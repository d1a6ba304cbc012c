"""L3 of the prefix cache: a remote KV pool (Redis, or a `jkv pool` server) shared by servers.

Pages are stored under the same chained keys as in L1 and L2 (`ChunkKey(namespace, -1, page_key)`;
the namespace names the model id and weights fingerprint, the KV dtype and the page size), payload
`[L, 2, H_kv, P, D]` in the cache's dtype. Writes come from the write-back's remote stage
(`writeback.py`: evicted pages, and finished requests' pages); reads are prefetches, started by the
serving engine's loading stage (`read`, on its fetch thread: jkv/serving/prefix_loader.py) or by a
caller that admits requests itself (`PagedKVCache.prefetch_remote`):

    engine thread                                   loader thread (one of two)
    pre = tier.prefetch(keys, start)         -->    pool.get_many(keys)   (one round trip, op timeout)
    ... keeps stepping the running requests ...     verify every payload
    pages = tier.collect(pre)  None = not yet, [] = miss/failure/timeout, else the leading run

Failure model: every pool operation is bounded by the op timeout (`--prefix-cache-l3-timeout`);
`collect` also gives up on a prefetch its deadline passed (a stopped server, a client that retries),
so no request waits longer than the op timeout for L3. Any failure counts in `errors`
(`jkv_prefix_cache_l3_errors_total`), logs a warning (at most one per `WARN_EVERY_S`), and makes
the tier skip L3 for `retry_after_s` (the pool does the same after its own failures): those
requests recompute their prefix. After that the next request tries again, so the server recovers
by itself when the pool returns.

Integrity: the pool verifies length, CRC32C and the key name (which names model, weights, dtype and
page size) of every payload; the tier also checks the stored shape and dtype against the cache's
page. A page failing any check ends the run of usable pages there (counted in `errors`): the
request recomputes from that page on, it never gets wrong KV.

Threads: the loader pool's threads (started here, shut down by `close`) run only pool reads and
verification; the counters are guarded by `_lock`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time

import numpy as np

from jkv.kvpool.base import KVPool
from jkv.kvpool.hashing import ChunkKey, ChunkNamespace

log = logging.getLogger(__name__)

WARN_EVERY_S = 30.0
KNOWN_KEYS = 1 << 16  # keys remembered as stored in / read from the pool (`holds`), most recent first
SCHEMES = ("redis://", "rediss://", "unix://", "jkvpool://")


def open_remote_pool(url: str, op_timeout_s: float, retry_after_s: float) -> KVPool:
    """The pool `url` names: redis://host:port[/db] (also rediss://, unix://) for Redis or Valkey,
    jkvpool://ADDRESS for a `jkv pool` server over tcp (secret from $JKV_SECRET)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from jkv.kvpool.redis_pool import RedisKVPool

        return RedisKVPool(url, socket_timeout_s=op_timeout_s, retry_after_s=retry_after_s, retries=0)
    if url.startswith("jkvpool://"):
        from jkv.kvpool.remote_pool import RemoteKVPool

        secret = os.environ.get("JKV_SECRET")
        if not secret:
            raise ValueError(f"--prefix-cache-l3 {url} needs the pool server's shared secret in $JKV_SECRET")
        return RemoteKVPool(url[len("jkvpool://"):], secret=secret, op_timeout_s=op_timeout_s,
                            retry_after_s=retry_after_s)
    raise ValueError(f"--prefix-cache-l3 {url!r} must start with one of {', '.join(SCHEMES)} "
                     "(e.g. redis://127.0.0.1:6379/0, or jkvpool://ADDRESS of a `jkv pool` server)")


@dataclasses.dataclass
class Prefetch:
    """An L3 read in flight for keys[start:] of one request's shareable pages."""

    start: int
    keys: list[bytes]
    future: concurrent.futures.Future
    deadline: float  # time.monotonic() after which the engine stops waiting
    outcome: list[np.ndarray] | None = None  # set by the first `collect` that resolves it


class RemoteTier:
    """Read and write prefix pages in a remote pool (see the module docstring).

    page_shape: (L, 2, H_kv, P, D); dtype: the cache's KV dtype.
    """

    def __init__(self, pool: KVPool, namespace: ChunkNamespace, page_shape: tuple[int, ...], dtype,
                 op_timeout_s: float, retry_after_s: float | None = None, where: str = ""):
        if not op_timeout_s > 0:
            raise ValueError(f"{op_timeout_s=} must be > 0 seconds")
        self.pool = pool
        self.namespace = namespace
        self.page_shape = tuple(page_shape)
        self.dtype = np.dtype(dtype)
        self.op_timeout_s = op_timeout_s
        self.retry_after_s = retry_after_s if retry_after_s is not None else max(1.0, 2 * op_timeout_s)
        self.where = where or type(pool).__name__
        self._loader = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jkv-prefix-l3-load")
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self._last_warning = -float("inf")
        self._failures = 0  # timeouts the engine saw and pages failing verification
        self.loaded_pages = 0  # pages read back and verified (the engine counts the ones it used)
        self.lookups = 0  # prefetches started
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def _key(self, digest: bytes) -> ChunkKey:
        return ChunkKey(self.namespace, -1, digest)

    @property
    def errors(self) -> int:
        """Failed or timed-out L3 operations plus pages failing verification."""
        with self._lock:
            return self._failures + getattr(self.pool, "errors", 0) + getattr(self.pool, "corrupt", 0)

    def _usable(self) -> bool:
        with self._lock:
            skip = time.monotonic() < self._skip_until
        return not skip and getattr(self.pool, "reachable", True)

    def _failed(self, what: str, skip: bool = True, counted: bool = False) -> None:
        """Count a failure (unless the pool `counted` it already), skip L3 for retry_after_s (unless
        the pool is fine and only an entry was bad: `skip=False`), warn at most once per WARN_EVERY_S."""
        now = time.monotonic()
        with self._lock:
            self._failures += not counted
            if skip:
                self._skip_until = now + self.retry_after_s
            warn = now - self._last_warning >= WARN_EVERY_S
            if warn:
                self._last_warning = now
        if warn:
            log.warning("prefix cache L3 (%s): %s; requests recompute their prefix instead, L3 is retried in "
                        "%.1f s (further failures within %.0f s are counted in jkv_prefix_cache_l3_errors_total, "
                        "not logged)", self.where, what, self.retry_after_s, WARN_EVERY_S)

    # ---------------------------------------------------------------- reads
    def prefetch(self, keys: list[bytes], start: int) -> Prefetch | None:
        """Start reading keys[start:] (engine thread; never blocks). None when there is nothing to
        read or L3 is being skipped after a failure."""
        if start >= len(keys) or not self._usable():
            return None
        with self._lock:
            self.lookups += 1
        wanted = keys[start:]
        return Prefetch(start, wanted, self._loader.submit(self._fetch, wanted),
                        time.monotonic() + self.op_timeout_s)

    def _fetch(self, keys: list[bytes]) -> list[np.ndarray]:
        """Loader thread: the verified leading run of keys' pages (each page_shape, dtype)."""
        buffers = [np.empty(self.page_shape, self.dtype) for _ in keys]
        errors_before = getattr(self.pool, "errors", 0)
        try:
            metas = self.pool.get_many([self._key(k) for k in keys], buffers)
        except ValueError as e:  # an entry larger than a page: not this cache's page, whatever it is
            self._failed(f"a stored entry does not fit a page ({e}); not used", skip=False)
            return []
        if getattr(self.pool, "errors", 0) > errors_before:  # the pool counted the failure itself
            self._failed(f"lookup of {len(keys)} pages failed (see the KV pool's warning)", counted=True)
            return []
        n = 0
        for meta in metas:
            if meta is None:
                break  # a miss: the pool never wrote it, evicted it, or it failed the CRC (pool logs that)
            if tuple(meta.shape) != self.page_shape or meta.dtype != self.dtype.name:
                self._failed(f"a page under {keys[n].hex()} is {meta.dtype}{list(meta.shape)}, not the cache's "
                             f"{self.dtype.name}{list(self.page_shape)}; not used", skip=False)
                break
            n += 1
        with self._lock:
            self.loaded_pages += n
        self._remember(keys[:n])
        return buffers[:n]

    def _remember(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)

    def holds(self, key: bytes) -> bool:
        """This tier stored `key` in the pool or read it back, lately (the last KNOWN_KEYS such keys):
        a finished request need not write it again. A pool that lost it since costs a miss (and the
        eviction write-back writes it again)."""
        with self._lock:
            return key in self._known

    def collect(self, prefetch: Prefetch) -> list[np.ndarray] | None:
        """Engine thread: the prefetched pages for keys[start:start + n] (a leading run, maybe
        empty), or None while the read is in flight and its deadline has not passed. A read past
        its deadline is abandoned (counted, warned): the request recomputes. Resolved once: later
        calls give the same answer (a request that then waits for free pages asks again)."""
        if prefetch.outcome is not None:
            return prefetch.outcome
        if prefetch.future.done():
            try:
                prefetch.outcome = prefetch.future.result()
            except Exception as e:  # a pool must not raise, but a bug there must not stall admission
                self._failed(f"lookup raised {type(e).__name__}: {e}")
                prefetch.outcome = []
        elif time.monotonic() >= prefetch.deadline:
            prefetch.future.cancel()
            self._failed(f"no answer to a lookup within the op timeout ({self.op_timeout_s:.2f} s)")
            prefetch.outcome = []
        return prefetch.outcome

    def read(self, keys: list[bytes]) -> list[np.ndarray]:
        """A loading stage's thread (jkv/serving/prefix_loader.py): keys' verified leading run of
        pages, waiting at most the op timeout: a `prefetch` and its `collect`, so a read past its
        deadline is abandoned the same way (counted, warned; the request recomputes)."""
        pre = self.prefetch(keys, 0)
        if pre is None:
            return []
        while (pages := self.collect(pre)) is None:
            concurrent.futures.wait([pre.future], timeout=max(0.001, pre.deadline - time.monotonic()))
        return pages

    # ---------------------------------------------------------------- writes (write-back's remote stage)
    def put_pages(self, data: np.ndarray, keys: list[bytes]) -> int:
        """Write data[i] ([L, 2, H_kv, P, D]) under keys[i]; returns how many were stored. While
        L3 is skipped after a failure nothing is sent."""
        stored = 0
        for i, k in enumerate(keys):
            if not self._usable():
                break
            errors_before = getattr(self.pool, "errors", 0)
            if self.pool.put(self._key(k), np.ascontiguousarray(data[i])):
                stored += 1
                self._remember([k])
            elif getattr(self.pool, "errors", 0) > errors_before:
                self._failed("write of a page failed (see the KV pool's warning)", counted=True)
                break
        return stored

    def close(self) -> None:
        """Stop the loader threads (waits for a read in flight: at most the op timeout) and close
        the pool."""
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.pool.close()
