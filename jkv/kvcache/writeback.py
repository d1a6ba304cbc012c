"""Asynchronous write-back of the prefix cache: device pages the allocator evicts are copied to the
host tier (L2) and the remote tier (L3) off the engine thread, and so are a finished request's
cached pages, to L3 only (`submit(host=False)`: they stay in L1; L3 is what other servers share).

    engine thread (allocator's eviction hook)      host stage thread          remote stage thread
    snapshot = gather_pages(kv, pages)  -- job -->  np.asarray(snapshot)  -->  pool.put per page
    (dispatch only, no wait)                         L2 put per page           (network, op timeout)

Why a snapshot and not pinned pages: `gather_pages` returns a new device array whose value is fixed
when it is dispatched (JAX orders it before any later program that donates and rewrites the cache),
so the evicted pages go back to the allocator at once and are reused while the copy is in flight;
nothing the copy reads can be freed under it. The job owns the snapshot until the host stage has
copied it to host memory, then drops it.

Bounds: each stage holds at most `max_pages` pages (device snapshots in the host stage, host arrays
in the remote stage). A job that does not fit is dropped, its pages counted in `dropped` (a later
request recomputes them: a write-back is an optimisation, never needed for correct tokens). A page
that came from L3 and is evicted again is written again: that refreshes it in the pool's LRU, and
no stale "the pool has it" list can outlive a pool that restarted empty.

Which tiers get a page: both, when it leaves the device (write-through from L1 eviction). L3 is
then a superset of what L2 held, so an L2 eviction loses nothing and needs no hook into the host
pool's own LRU, and the L3 copy exists as early as possible for other servers sharing the pool.

Threads: two daemon threads started here and joined by `close()`; counters are guarded by `_cond`.
`flush()` waits until both stages are empty (tests, shutdown).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from jkv.kvpool.base import KVPool
from jkv.kvpool.hashing import ChunkKey, ChunkNamespace

log = logging.getLogger(__name__)

DEFAULT_MAX_PAGES = 256


class WriteBack:
    """The two write-back stages (see the module docstring). host_pool: L2 or None; remote: a
    `remote_tier.RemoteTier` or None (at least one of them)."""

    def __init__(self, namespace: ChunkNamespace, host_pool: KVPool | None, remote=None,
                 max_pages: int = DEFAULT_MAX_PAGES):
        if host_pool is None and remote is None:
            raise ValueError("WriteBack needs a host pool (L2) or a remote tier (L3) to write to")
        if max_pages < 1:
            raise ValueError(f"{max_pages=} must be >= 1 (pages a write-back stage may hold)")
        self.namespace = namespace
        self.host_pool = host_pool
        self.remote = remote
        self.max_pages = max_pages
        self._cond = threading.Condition()
        self._host_jobs: collections.deque = collections.deque()  # (snapshot [R, L, 2, H_kv, P, D], keys, to_host)
        self._remote_jobs: collections.deque = collections.deque()  # (host array [n, ...], keys)
        self._host_pages = self._remote_pages = 0  # pages queued in each stage
        self._busy = 0  # jobs taken off a queue and not finished
        self._closed = False
        self.host_writes = 0  # pages written to L2
        self.remote_writes = 0  # pages written to L3
        self.dropped = {"host": 0, "remote": 0}  # pages not written: stage full, or L3 unreachable
        self._threads = [threading.Thread(target=self._run, args=(stage,), name=f"jkv-prefix-writeback-{stage}",
                                          daemon=True) for stage in ("host", "remote")]
        for t in self._threads:
            t.start()

    def _key(self, digest: bytes) -> ChunkKey:
        return ChunkKey(self.namespace, -1, digest)

    # ---------------------------------------------------------------- engine thread
    def submit(self, snapshot, keys: list[bytes], host: bool = True) -> bool:
        """Queue a gathered snapshot (its first len(keys) rows are the pages of `keys`); never
        blocks. host=False: L3 only (a finished request's pages, which stay in L1; the host stage
        only copies them off the device). False (pages counted as dropped, under the tier they were
        for) when the host stage is full or closed, or nothing would be written."""
        n = len(keys)
        with self._cond:
            if not host and self.remote is None:
                return False
            if self._closed or self._host_pages + n > self.max_pages:
                self.dropped["host" if host else "remote"] += n
                return False
            self._host_jobs.append((snapshot, keys, host))
            self._host_pages += n
            self._cond.notify_all()
        return True

    # ---------------------------------------------------------------- stage threads
    def _run(self, stage: str):
        jobs = self._host_jobs if stage == "host" else self._remote_jobs
        while True:
            with self._cond:
                while not jobs and not self._closed:
                    self._cond.wait()
                if not jobs:
                    return  # closed and drained
                job = jobs.popleft()  # host stage: (snapshot, keys, to_host); remote stage: (host array, keys)
                self._busy += 1
            keys = job[1]
            try:
                if stage == "host":
                    self._write_host(*job)
                else:
                    self._write_remote(*job)
            except Exception:  # a write-back is never worth the engine: log it, count it, go on
                log.exception("prefix cache write-back (%s stage) failed for %d pages", stage, len(keys))
                with self._cond:
                    self.dropped[stage] += len(keys)
            finally:
                with self._cond:
                    self._busy -= 1
                    if stage == "host":
                        self._host_pages -= len(keys)
                    else:
                        self._remote_pages -= len(keys)
                    self._cond.notify_all()

    def _write_host(self, snapshot, keys: list[bytes], to_host: bool):
        data = np.asarray(snapshot)[:len(keys)]  # the device-to-host copy, off the engine thread
        del snapshot
        if to_host and self.host_pool is not None:
            stored = sum(self.host_pool.put(self._key(k), np.ascontiguousarray(data[i])) for i, k in enumerate(keys))
            with self._cond:
                self.host_writes += stored
        if self.remote is None:
            return
        with self._cond:
            if self._closed or self._remote_pages + len(keys) > self.max_pages:
                self.dropped["remote"] += len(keys)
                return
            self._remote_jobs.append((data, keys))
            self._remote_pages += len(keys)
            self._cond.notify_all()

    def _write_remote(self, data: np.ndarray, keys: list[bytes]):
        stored = self.remote.put_pages(data, keys)
        with self._cond:
            self.remote_writes += stored
            self.dropped["remote"] += len(keys) - stored

    # ---------------------------------------------------------------- any thread
    @property
    def pending_pages(self) -> int:
        """Pages queued or being written in either stage."""
        with self._cond:
            return self._host_pages + self._remote_pages

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until both stages are empty; False if `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._host_jobs or self._remote_jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (for at most `timeout` seconds), then stop the stage threads.
        Idempotent. Jobs still queued when the threads are told to stop are written first;
        a remote stage stuck on an unreachable pool ends within its op timeout."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.warning("prefix cache write-back thread %s did not stop within %.1f s", t.name, timeout)
