"""CALVO's loading stages as the paged engine's loading stage (`jkv serve --kv-layout paged` with a
prefix cache tier: `--prefix-cache-host-bytes` (L2) and/or `--prefix-cache-l3` (L3)).

A request whose prompt has shareable pages that L1 (device pages) lacks but L2 holds, or that an L3
may hold, does not load at admission on the engine thread: it enters CALVO's pipeline
(jkv/scheduling/pipeline.py, the machinery the experiments use) and the engine keeps stepping the
running requests while its pages move:

    engine thread                 FETCH  L3 -> L2              UPLOAD  L2 -> L1              COMPUTE
    kv.reserve_for_load           one chunk (CHUNK_PAGES       device_put of the staging     hands the request
      (all its pages, now)        pages) from the host pool,   row (the host->device copy),  back: inbox
    loader.start  ----------->    then the rest from L3, into  inbox "landed" (its pages,    "loaded"
                                  an L2 staging row            the device rows)
    inbox "landed": scatter the rows into the request's pages (one program; `kv.kv` stays the engine's)
    inbox "loaded": kv.finish_load (cache the pages, count hits), seat it, prefill from the first
                    page not loaded

Each stage is a dispatcher and an executor thread; every stage's queue is ordered by the engine's
`--schedule` policy (srpt / lstf re-rank on each dispatch by the load left).

The link is ordered (CALVO §3.1: a dispatcher drives its executor with blocks of the
highest-priority request): the fetch dispatcher chooses each chunk when the link is free, so a
short request that arrives while a long one loads takes the link at the long one's next chunk
boundary. A chunk handed to the executor ahead (fetch depth 2) would hide the round trip between
chunks but commit the link for one more chunk; it pays only on a fast link, so the depth follows
the measured fetch time: 2 while a chunk's fetch takes under AHEAD_MAX_S (the wait it can add is
small there, the round trip is not), else 1 (starts at 1). Measured through the server:
experiments/prefix_serve_policies.py, docs/calvo.md.

Proactive allocation: the engine reserves all the request's pages when it enters the stages (`PagedKVCache.
reserve_for_load`, CALVO §3.1: the load's destination is allocated before the load), so the
pipeline's own L1 bookkeeping never waits; the L2 staging area (`host_chunks` rows) bounds the
chunks in flight, and chunk i+1 is fetched while chunk i is uploaded.

Failures never give wrong KV: a page missing from both tiers, a failed or timed-out L3 read (each
bounded by the op timeout, `RemoteTier.read`) ends the request's loaded run at that page and it
recomputes the rest; a stage that raises makes it recompute its whole prefix. Cancel: `cancel`
drops it from the pipeline (its staging rows come back when its tasks in flight end) and the
engine frees its pages; "landed" / "loaded" events that arrive for it afterwards are ignored, so
nothing lands in pages it no longer holds.

Threads: the pipeline's six threads (started here, joined by `close`). The executors touch host
memory, the pools and `jax.device_put` only; `start`, `apply`, `cancel` run on the engine thread,
which alone replaces `kv.kv`. A `_Load`'s `limit` and `remote` are written by the fetch executor
and read by the upload executor and the engine after the pipeline's lock or the inbox ordered them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable

import jax
import numpy as np

from jkv.kvcache.host_tier import scatter_pages
from jkv.kvcache.paged import LoadPlan, PagedKVCache
from jkv.scheduling.core import PipelineRequest, Stage
from jkv.scheduling.pipeline import LoadingPipeline, PipelineConfig, StageFunctions
from jkv.scheduling.policies import Policy, RequestInfo

log = logging.getLogger(__name__)

CHUNK_PAGES = 4  # pages per pipeline chunk: one L3 round trip, one host->device copy; the link is
# handed to the highest-priority request chunk by chunk, so a chunk is how long a request that just
# arrived may wait behind a load already on the link (0.59 s a page of SmolLM2 float32 KV at 10 Mbit/s)
HOST_CHUNKS = 8  # L2 staging rows: chunks fetched and not yet uploaded, over all loading requests
AHEAD_MAX_S = 0.05  # fetch the next chunk while one is on the link only while a fetch takes less


@dataclasses.dataclass(eq=False)
class _Load:
    key: Hashable
    plan: LoadPlan
    started: float  # time.perf_counter() when it entered the stages
    limit: int  # plan pages loadable: lowered to the first page both tiers missed
    remote: set[int] = dataclasses.field(default_factory=set)  # plan indices read from L3


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A request the stages are done with: its first `cached_tokens` prompt tokens are in its pages
    (`pages` of them loaded, from L3 when `tier` is "l3", else L2, in `seconds`)."""

    key: Hashable
    cached_tokens: int
    pages: int
    tier: str
    seconds: float


class PrefixLoader:
    """The loading stages for one `PagedKVCache` with an L2 and/or L3 tier (see the module docstring).

    post: puts an event on the engine's inbox (any thread); the engine hands it back to `apply`.
    """

    def __init__(self, kv: PagedKVCache, policy: Policy, post: Callable[[tuple], None],
                 chunk_pages: int | None = None, host_chunks: int = HOST_CHUNKS):
        if kv.host is None and kv.remote is None:
            raise ValueError("PrefixLoader loads from the host (L2) or remote (L3) tier; the cache has neither")
        self.kv = kv
        self.post = post
        self.chunk_pages = chunk_pages or CHUNK_PAGES
        self.staging = np.zeros((host_chunks, self.chunk_pages, *kv.page_shape), kv.dtype)  # the L2 rows
        self._loads: dict[Hashable, _Load] = {}  # engine thread
        config = PipelineConfig(host_slots=host_chunks, device_slots=max(1, kv.page_cfg.usable_pages), fetch_depth=1)
        self.pipeline = LoadingPipeline(StageFunctions(self._fetch, self._upload, self._compute), config, policy,
                                        clock=time.perf_counter)

    # ------------------------------------------------------------ engine thread
    def start(self, key: Hashable, info: RequestInfo, plan: LoadPlan) -> None:
        """Load plan.keys into plan.pages (the request holds them); `info` orders it (its arrival on
        time.perf_counter's clock). Its "loaded" event comes through `post` when it is done."""
        load = self._loads[key] = _Load(key, plan, time.perf_counter(), len(plan.keys))
        chunks = -(-len(plan.keys) // self.chunk_pages)
        future = self.pipeline.submit(PipelineRequest(dataclasses.replace(info, request_id=key), chunks, payload=load))
        future.add_done_callback(lambda f: self.post(("loaded", key, f)))

    def apply(self, event: tuple) -> Loaded | None:
        """An event `post` delivered: a landed chunk is written into its pages (None); a finished
        load gives its `Loaded`. Events of a request cancelled meanwhile give None."""
        kind, key = event[0], event[1]
        load = self._loads.get(key)
        if load is None:
            return None
        if kind == "landed":
            pages, rows = event[2], event[3]
            self.kv.kv = scatter_pages(self.kv.kv, pages, rows)
            return None
        del self._loads[key]
        chunks = 0
        try:
            chunks = event[2].result().loaded_chunks
        except concurrent.futures.CancelledError:
            pass  # the pipeline closed under it: it recomputes
        except Exception as e:  # a stage raised (logged by the pipeline): recompute everything
            log.warning("loading the cached prefix of %s failed (%s); it is recomputed", key, e)
        pages = min(chunks * self.chunk_pages, load.limit, len(load.plan.keys))
        cached = self.kv.finish_load(key, pages, load.remote)
        tier = "l3" if any(i < pages for i in load.remote) else "l2"
        return Loaded(key, cached, pages, tier, time.perf_counter() - load.started)

    def cancel(self, key: Hashable) -> None:
        """Stop loading for `key` (the engine frees its pages); later events for it are ignored."""
        if self._loads.pop(key, None) is not None:
            self.pipeline.cancel(key)

    def set_policy(self, policy: Policy) -> None:
        self.pipeline.set_policy(policy)

    @property
    def loading(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        """Cancel what is loading and join the stage threads (a fetch in flight ends within the L3
        op timeout)."""
        self._loads.clear()
        self.pipeline.close()

    # ------------------------------------------------------------ stage executors
    def _fetch(self, request: PipelineRequest, chunk: int, host_slot: int) -> bool:
        """L3 -> L2: the chunk's pages into staging row `host_slot`, from the host pool while it has
        them, then from L3. False (the pipeline stops the request's prefix there) if none came."""
        started = time.perf_counter()
        try:
            return self._fetch_chunk(request.payload, chunk, host_slot)
        finally:
            depth = 2 if time.perf_counter() - started < AHEAD_MAX_S else 1
            if depth != self.pipeline.depth(Stage.FETCH):
                self.pipeline.set_depth(Stage.FETCH, depth)

    def _fetch_chunk(self, load: _Load, chunk: int, host_slot: int) -> bool:
        lo = chunk * self.chunk_pages
        keys = load.plan.keys[lo:lo + self.chunk_pages]
        row = self.staging[host_slot]
        n = self.kv.host.read(keys, list(row[:len(keys)])) if self.kv.host is not None else 0
        if n < len(keys) and self.kv.remote is not None:
            pages = self.kv.remote.read(keys[n:])
            for i, page in enumerate(pages):
                row[n + i] = page
                load.remote.add(lo + n + i)
            n += len(pages)
        row[n:] = 0  # rows past the run are written to the null page: zeros, never stale NaN-able bytes
        if n < len(keys):
            load.limit = min(load.limit, lo + n)
        return n > 0

    def _upload(self, request: PipelineRequest, chunk: int, host_slot: int, device_slot: int) -> None:
        """L2 -> L1: copy staging row `host_slot` to the device and hand it to the engine to write into
        the request's pages (rows past its loadable run go to the null page)."""
        load: _Load = request.payload
        lo = chunk * self.chunk_pages
        n = max(0, min(load.limit, len(load.plan.keys)) - lo)
        if n == 0:
            return
        pages = np.zeros(self.chunk_pages, np.int32)  # i32[CHUNK_PAGES]
        pages[:min(n, self.chunk_pages)] = load.plan.pages[lo:lo + min(n, self.chunk_pages)]
        # a copy, finished before the staging row is released to another chunk
        rows = jax.device_put(self.staging[host_slot], may_alias=False).block_until_ready()
        self.post(("landed", load.key, pages, rows))

    @staticmethod
    def _compute(request: PipelineRequest, loaded_chunks: int, device_slots: tuple[int, ...]) -> int:
        """The prefix is in L1: the request goes back to the engine (the future's callback posts it),
        which prefills it between its decode steps."""
        return loaded_chunks


__all__ = ["PrefixLoader", "Loaded", "CHUNK_PAGES", "HOST_CHUNKS", "AHEAD_MAX_S"]
