"""`PagedKVCache`: the device-resident paged KV cache and its per-request page tables.

    cache = PagedKVCache(model.cfg, PageConfig(page_size=16, num_pages=4096))
    cache.reserve("r1", len(prompt))                         # pages for the prompt
    table = cache.table(["r1", None])                         # i32[B, max_pages]; None = idle row
    logits, cache.kv = model.prefill_chunk(cache.kv, table, tokens, start, lengths)
    cache.reserve("r1", position + 1)                         # grows by a page every P tokens
    logits, cache.kv = model.paged_decode_step(cache.kv, cache.table(["r1"]), tok, positions)
    cache.free("r1")                                          # pages back to the pool

With prefix caching (`prefix_namespace` given), a request starts with `reserve_prefix`: its
prompt's leading full pages that are cached come back shared (read-only, reference-counted) and
compute starts at the first uncached token; `commit_pages` registers the request's full pages
as their KV is written, so later requests can share them; `free` parks cached pages in the
allocator's LRU instead of freeing them (`pages.PageAllocator`, evicted only when it runs short).

Who owns what: `kv` (a tuple over layers of (K, V), each [num_pages, H_kv, P, D], on the default
JAX device, or split by KV head over the model's mesh when given `sharding=model.kv_sharding`, in
the model's dtype unless told otherwise) is replaced by every model call that
writes it (the old arrays are donated), so callers always store the returned tuple back in
`cache.kv`. The page tables, lengths and reference counts are host bookkeeping here and in
`pages.PageAllocator`; the device programs (models/paged.py) only read tables built by `table()`.
Bookkeeping methods take a lock, so a scheduler thread and a cancelling thread may both call
them; the device arrays are used by one thread at a time (the one that runs the model).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Collection, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kvpool.base import KVPool
from jkv.kvpool.hashing import ChunkNamespace
from models.config import ModelConfig
from models.paged import init_pages

from .host_tier import HostTier, gather_snapshot, load_pages
from .pages import NULL_PAGE, OutOfPages, PageAllocator, PageConfig
from .prefix import extend_page_keys, shareable_pages
from .remote_tier import RemoteTier
from .writeback import WriteBack

# Causes of host->device KV copies (`PagedKVCache.h2d_bytes`, /metrics jkv_kv_host_to_device_bytes):
# "arrived" rows pushed by a prefill worker (disaggregated decode), "fetched" rows or pages pulled on
# demand (a fetch reply; a prefix page loaded back from the host or remote tier), "other" (a prompt
# recomputed on the host after its owner failed).
H2D_CAUSES = ("arrived", "fetched", "other")

MIN_TABLE_PAGES = 4


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What `reserve_for_load` gives the loading stages: the request shares its first `shared`
    pages from L1; keys[i] (a shareable page L1 lacks) is to be loaded from L2 or L3 into pages[i],
    a page the request already holds."""

    shared: int
    keys: list[bytes]
    pages: list[int]


def kv_bytes_per_token(model_cfg: ModelConfig, dtype=None) -> int:
    """Device KV bytes of one token over all layers (K and V)."""
    itemsize = jnp.dtype(dtype if dtype is not None else model_cfg.dtype).itemsize
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize


def bucket_pages(n: int) -> int:
    """Table width for n pages: a power of two (at least MIN_TABLE_PAGES) up to 512 pages, then
    a multiple of 256, so a few compiled programs serve every length while attention cost (which
    follows the width) stays within 2x of the live length."""
    if n <= MIN_TABLE_PAGES:
        return MIN_TABLE_PAGES
    if n <= 512:
        return 1 << (n - 1).bit_length()
    return -(-n // 256) * 256


def _append_zero_pages(pages, extra: int, sharding=None):
    """pages [num_pages, ...] -> [num_pages + extra, ...], the new pages zero (on `sharding`)."""
    def grow(x):
        return jnp.concatenate([x, jnp.zeros((extra, *x.shape[1:]), x.dtype)])
    return (jax.jit(grow) if sharding is None else jax.jit(grow, out_shardings=sharding))(pages)


class PagedKVCache:
    """Device pages plus per-request page tables. Request ids are any hashable key."""

    def __init__(self, model_cfg: ModelConfig, page_cfg: PageConfig | None = None, dtype=None,
                 prefix_namespace: ChunkNamespace | None = None, host_pool: KVPool | None = None,
                 sharding=None, remote_pool: KVPool | None = None, remote_timeout_s: float = 1.0,
                 writeback_pages: int | None = None):
        """prefix_namespace: turns prefix caching on; pages are keyed in it (`prefix.prefix_namespace`:
        model, dtype and page size; its chunk_tokens must equal page_cfg.page_size). host_pool: the
        L2 tier (`host_tier.HostTier`): evicted cached pages are written there and loaded back on a
        hit (needs prefix_namespace). remote_pool: the L3 tier (`remote_tier.RemoteTier`, every
        operation bounded by remote_timeout_s): evicted pages are written there too, and pages
        missing in L1 and L2 are read from it (`prefetch_remote`, then `reserve_prefix(remote=)`).
        Writes to L2 and L3 leave the engine thread (`writeback.WriteBack`, at most
        writeback_pages pages queued per stage). sharding: `Model.kv_sharding` under tensor
        parallelism (pages split by KV head), else None."""
        self.model_cfg = model_cfg
        self.page_cfg = page_cfg if page_cfg is not None else PageConfig()
        self.dtype = jnp.dtype(dtype if dtype is not None else model_cfg.dtype)
        if prefix_namespace is not None and prefix_namespace.chunk_tokens != self.page_cfg.page_size:
            raise ValueError(f"prefix_namespace keys chunks of {prefix_namespace.chunk_tokens} tokens but pages hold "
                             f"{self.page_cfg.page_size}; build it with prefix_namespace(model, dtype, page_size)")
        self.prefix_namespace = prefix_namespace
        self.kv = init_pages(model_cfg, self.page_cfg.num_pages, self.page_cfg.page_size, self.dtype, sharding)
        self._sharding = sharding
        self.allocator = PageAllocator(self.page_cfg.num_pages)
        self.host: HostTier | None = None
        self.remote: RemoteTier | None = None
        self.writeback: WriteBack | None = None
        if (host_pool is not None or remote_pool is not None) and prefix_namespace is None:
            raise ValueError("host_pool and remote_pool are tiers of the prefix cache: pass prefix_namespace too")
        if host_pool is not None:
            self.host = HostTier(host_pool, prefix_namespace)
        if remote_pool is not None:
            self.remote = RemoteTier(remote_pool, prefix_namespace, self.page_shape, self.dtype, remote_timeout_s,
                                     where=getattr(remote_pool, "url", None) or getattr(remote_pool, "address", ""))
        if self.host is not None or self.remote is not None:
            self.writeback = WriteBack(prefix_namespace, host_pool, self.remote,
                                       **({} if writeback_pages is None else {"max_pages": writeback_pages}))
            self.allocator.on_evict = self._write_back
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._keys: dict[Hashable, list[bytes]] = {}  # prefix keys of the request's leading full pages
        self._committed: dict[Hashable, int] = {}  # leading pages already offered to the cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (shareable part)
        self.prefix_hits = 0  # of those, tokens whose KV came from cached device pages
        self.prefix_hits_host = 0  # ... and from the host tier
        self.prefix_hits_remote = 0  # ... and from the remote tier
        self.finished_writes = 0  # pages of finished requests handed to the write-back for L3
        self.h2d_bytes = dict.fromkeys(H2D_CAUSES, 0)  # KV bytes copied host->device, by cause (totals)
        self._lock = threading.Lock()

    @property
    def prefix_caching(self) -> bool:
        return self.prefix_namespace is not None

    def __repr__(self):
        return (f"PagedKVCache(page_size={self.page_size}, pages {self.pages_in_use}/"
                f"{self.allocator.capacity} in use, {len(self._pages)} requests, {self.dtype})")

    @property
    def page_size(self) -> int:
        return self.page_cfg.page_size

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page's payload in the host and remote tiers: (L, 2, H_kv, P, D)."""
        cfg = self.model_cfg
        return (cfg.num_layers, 2, cfg.num_kv_heads, self.page_size, cfg.head_dim)

    def _write_back(self, evicted: list[tuple[int, bytes]]) -> None:
        """The allocator's eviction hook (the allocating thread, before the pages are reused):
        dispatch a snapshot of the evicted pages and hand it to the write-back (no wait)."""
        self.writeback.submit(gather_snapshot(self.kv, [p for p, _ in evicted]), [k for _, k in evicted])

    # ------------------------------------------------------------ per request
    def grow(self, num_pages: int) -> None:
        """Enlarge the pool to `num_pages` pages (never shrinks): every page keeps its id and bytes,
        the new ones are zero and free. The arrays are replaced (new shapes: programs over the pool
        compile for the new size); call it between steps, when no program reads `kv`."""
        extra = num_pages - self.page_cfg.num_pages
        if extra <= 0:
            return
        with self._lock:
            self.kv = tuple(tuple(_append_zero_pages(x, extra, self._sharding) for x in kv) for kv in self.kv)
            self.page_cfg = dataclasses.replace(self.page_cfg, num_pages=num_pages)
            self.allocator.grow(num_pages)

    def reserve(self, request_id: Hashable, n_tokens: int) -> list[int]:
        """Make request_id hold pages for n_tokens tokens; returns the pages newly allocated.

        Idempotent growth: a second call with a larger n extends the request's pages, one with a
        smaller or equal n changes nothing (a request never shrinks). Raises `OutOfPages`
        (nothing allocated, the request keeps what it had) when the pool is short.
        """
        if n_tokens < 0:
            raise ValueError(f"{n_tokens=} must be >= 0 (tokens request {request_id!r} must hold)")
        with self._lock:
            pages = self._pages.setdefault(request_id, [])
            need = self.page_cfg.pages_for(n_tokens) - len(pages)
            new = self.allocator.allocate(need) if need > 0 else []
            pages.extend(new)
            self._lengths[request_id] = max(self._lengths.get(request_id, 0), int(n_tokens))
            return new

    def prompt_keys(self, prompt) -> list[bytes]:
        """Keys of the prompt's shareable full pages (`prefix.shareable_pages`)."""
        return extend_page_keys([], prompt, self.prefix_namespace, limit=shareable_pages(len(prompt), self.page_size))

    def prefetch_remote(self, prompt):
        """Start reading from L3 the prompt's shareable pages after those L1 and L2 hold now (a
        `remote_tier.Prefetch`, or None when there is nothing to read); never blocks. Pass what
        `self.remote.collect` gives for it to `reserve_prefix(remote=)`."""
        if self.remote is None or not self.prefix_caching:
            return None
        keys = self.prompt_keys(prompt)
        l1, l2 = self._tier_run(keys)
        return self.remote.prefetch(keys, l1 + l2)

    def _tier_run(self, keys: list[bytes]) -> tuple[int, int]:
        """(pages of the leading run of `keys` in L1, pages right after them in L2): a probe, no copy."""
        with self._lock:
            l1 = self.allocator.cached_run(keys)
            return l1, self.host.available(keys[l1:]) if self.host is not None else 0

    def tier_run(self, prompt) -> tuple[int, int, int]:
        """Where the prompt's shareable pages are now, as tokens: (in L1, next ones in L2, the rest),
        (0, 0, 0) without prefix caching. A probe (no reference, no recency); the rest may or may
        not be in L3 (asking would take a round trip)."""
        if not self.prefix_caching:
            return 0, 0, 0
        keys = self.prompt_keys(prompt)
        l1, l2 = self._tier_run(keys)
        P = self.page_size
        return l1 * P, l2 * P, (len(keys) - l1 - l2) * P

    def reserve_prefix(self, request_id: Hashable, prompt, n_tokens: int, remote=None) -> int:
        """Start a new request: share its prompt's cached leading full pages, allocate pages for the
        rest of n_tokens tokens; returns the tokens whose KV is already in its pages (a multiple of
        the page size, always < len(prompt): compute starts there).

        prompt: i32[N] token ids. remote: (start, payloads) read from L3 for the prompt's shareable
        keys[start:start + len(payloads)] (`prefetch_remote`), each [L, 2, H_kv, P, D]; they are
        used when L1 and L2 reach at least `start` (else there is a gap and they are not). Without
        prefix caching this is `reserve` and returns 0. Raises `OutOfPages` with nothing held (the
        shared pages are released again) when the pool is short.
        """
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds pages; reserve_prefix starts a new request")
        if not self.prefix_caching:
            self.reserve(request_id, n_tokens)
            return 0
        P = self.page_size
        with self._lock:
            keys, shared, new = self._reserve_shared(request_id, prompt, n_tokens)
            in_host = self.host.available(keys[len(shared):]) if self.host is not None else 0
            loaded = 0
            if in_host:  # the next pages come back from L2 instead of being recomputed
                self.kv, loaded = self.host.load(self.kv, keys[len(shared):len(shared) + in_host], new,
                                                 self.page_shape, self.dtype)
            from_remote = 0
            if remote is not None:  # ... and the ones after them from L3, if they connect
                start, payloads = remote
                have = len(shared) + loaded
                if start <= have < start + len(payloads):
                    use = payloads[have - start:len(keys) - start]
                    self.kv = load_pages(self.kv, new[loaded:loaded + len(use)], use)
                    from_remote = len(use)
            for i in range(loaded + from_remote):
                self.allocator.cache_page(new[i], keys[len(shared) + i])
            hit = len(shared) + loaded + from_remote
            self._committed[request_id] = hit
            self.prefix_hits_host += loaded * P
            self.prefix_hits_remote += from_remote * P
            self.h2d_bytes["fetched"] += (loaded + from_remote) * self.page_bytes  # L2 / L3 pages loaded back
            return hit * P

    def _reserve_shared(self, request_id: Hashable, prompt, n_tokens: int):
        """Under the lock: share the prompt's cached leading pages and allocate the rest of its pages;
        returns (its shareable keys, the shared pages, the new pages). Raises `OutOfPages` with
        nothing held."""
        keys = self.prompt_keys(prompt)
        shared = self.allocator.match(keys)
        need = self.page_cfg.pages_for(max(n_tokens, len(prompt))) - len(shared)
        try:
            new = self.allocator.allocate(max(need, 0))  # may write evicted pages back (L2, L3)
        except OutOfPages as e:
            self.allocator.decref(shared)
            raise OutOfPages(e.needed + len(shared), e.free + len(shared), e.capacity) from None
        self._pages[request_id] = shared + new
        self._lengths[request_id] = max(int(n_tokens), len(prompt))
        self._keys[request_id] = keys
        self._committed[request_id] = len(shared)
        self.prefix_queries += len(keys) * self.page_size
        self.prefix_hits += len(shared) * self.page_size
        return keys, shared, new

    def reserve_for_load(self, request_id: Hashable, prompt, n_tokens: int) -> LoadPlan:
        """Start a new request whose prefix is loaded by the loading stages (jkv/serving/prefix_loader.py):
        share its prompt's cached leading pages, allocate all its other pages now (CALVO's proactive
        allocation: the loads land in pages the request already holds, so nothing can take them),
        and return which shareable pages to load into which of them. Call `finish_load` when the
        loads have landed, `free` to give everything back (cancel, failure). Raises `OutOfPages`
        with nothing held; ValueError without prefix caching."""
        if not self.prefix_caching:
            raise ValueError("reserve_for_load needs prefix caching (PagedKVCache(prefix_namespace=...))")
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds pages; reserve_for_load starts a new request")
        with self._lock:
            keys, shared, new = self._reserve_shared(request_id, prompt, n_tokens)
            rest = keys[len(shared):]
            return LoadPlan(len(shared), rest, new[:len(rest)])

    def finish_load(self, request_id: Hashable, loaded: int, from_remote: Collection[int] = ()) -> int:
        """The first `loaded` pages of the request's `LoadPlan` hold their KV now (their copies were
        issued); `from_remote`: the plan indices among them read from L3 (the others came from L2).
        Offers them to the prefix cache and counts the hits. Returns the tokens whose KV is in the
        request's pages (compute starts there); 0 if the request is gone (cancelled meanwhile)."""
        P = self.page_size
        with self._lock:
            pages = self._pages.get(request_id)
            if pages is None:
                return 0
            keys, start = self._keys[request_id], self._committed[request_id]
            n_remote = sum(i < loaded for i in from_remote)
            for i in range(start, start + loaded):
                self.allocator.cache_page(pages[i], keys[i])
            self._committed[request_id] = start + loaded
            self.prefix_hits_host += (loaded - n_remote) * P
            self.prefix_hits_remote += n_remote * P
            self.h2d_bytes["fetched"] += loaded * self.page_bytes  # L2 / L3 pages loaded back
            return (start + loaded) * P

    def commit_pages(self, request_id: Hashable, tokens) -> int:
        """Offer the request's full pages to the prefix cache: tokens (i32[N]) are the tokens whose
        KV is written in its pages, from position 0. Call it only after the program that wrote them
        was issued (later programs read the cache it returned). Returns the pages newly cached.

        A full page is never written again, which is what makes sharing it safe. A page whose key
        another page already holds (the same prefix computed twice at once) stays private.
        """
        if not self.prefix_caching:
            return 0
        with self._lock:
            pages = self._pages.get(request_id)
            if pages is None:
                return 0
            # keys may already reach past `tokens` (reserve_prefix keyed the whole shareable prompt);
            # only the pages `tokens` fills are written
            full = min(len(tokens) // self.page_size, len(pages))
            keys = extend_page_keys(self._keys.setdefault(request_id, []), tokens, self.prefix_namespace, limit=full)
            start = self._committed.get(request_id, 0)
            cached = sum(self.allocator.cache_page(pages[i], keys[i]) for i in range(start, full))
            self._committed[request_id] = max(start, full)
            return cached

    def free(self, request_id: Hashable, write_back: bool = False) -> int:
        """Drop the request's references to its pages; returns how many pages no request holds now
        (free, or evictable cached prefix pages).

        write_back (with an L3 tier; call it on the thread that runs the model): first hand the
        request's cached full pages that L3 is not known to hold to the write-back (asynchronous,
        bounded: a full stage drops them, counted), so other servers sharing the pool can hit them.

        Safe to call twice (and for an id never reserved): cancel, failure and finish paths may
        each free a request, and only the first call releases anything.
        """
        with self._lock:
            pages = self._pages.pop(request_id, None)
            self._lengths.pop(request_id, None)
            keys = self._keys.pop(request_id, None)
            committed = self._committed.pop(request_id, 0)
            if write_back and pages and keys and self.remote is not None:
                self._write_back_finished(pages[:min(committed, len(keys))], keys)
            return len(self.allocator.decref(pages)) if pages else 0

    def _write_back_finished(self, pages: list[int], keys: list[bytes]) -> None:
        """Under the lock: dispatch a snapshot of `pages` that are in the prefix cache under their key
        (a page kept private because another page holds its key is skipped: that one is written)
        and that L3 is not known to hold (`RemoteTier.holds`), and queue it for L3 only (L1 keeps
        them: no L2 copy)."""
        todo = [(p, keys[i]) for i, p in enumerate(pages)
                if self.allocator.key_of(p) == keys[i] and not self.remote.holds(keys[i])]
        if todo and self.writeback.submit(gather_snapshot(self.kv, [p for p, _ in todo]), [k for _, k in todo],
                                          host=False):
            self.finished_writes += len(todo)

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (evictable pages become free); returns the keys dropped."""
        with self._lock:
            for request_id, pages in self._pages.items():
                self._committed[request_id] = len(pages)  # what they hold now is private
            return self.allocator.clear_cache()

    def close(self, timeout: float = 5.0) -> None:
        """Finish the write-back (at most `timeout` seconds), stop its threads and the L3 loader,
        close the L3 pool. Idempotent; the device pages and the counters stay readable."""
        if self.writeback is not None:
            self.writeback.close(timeout)
        if self.remote is not None:
            self.remote.close()

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._pages

    @property
    def requests(self) -> list[Hashable]:
        with self._lock:
            return list(self._pages)

    def length(self, request_id: Hashable) -> int:
        """Tokens the request holds room for (the largest n_tokens reserved)."""
        with self._lock:
            return self._lengths[request_id]

    def pages_of(self, request_id: Hashable) -> list[int]:
        with self._lock:
            return list(self._pages[request_id])

    def table(self, request_ids: Sequence[Hashable | None], max_pages: int | None = None) -> np.ndarray:
        """Page table i32[B, max_pages] for a batch; row b lists request_ids[b]'s pages, then the
        null page. None (an idle row) gives an all-null row.

        max_pages defaults to `bucket_pages` of the batch's largest page count, so attention cost
        follows the live lengths. A smaller max_pages is allowed: the row then addresses only its
        first max_pages pages (chunked prefill reads just the pages before its chunk).
        """
        with self._lock:
            rows = [self._pages[r] if r is not None else [] for r in request_ids]
        if max_pages is None:
            max_pages = bucket_pages(max((len(p) for p in rows), default=0))
        if max_pages < 1:
            raise ValueError(f"{max_pages=} must be >= 1")
        out = np.full((len(rows), max_pages), NULL_PAGE, np.int32)
        for b, pages in enumerate(rows):
            n = min(len(pages), max_pages)
            out[b, :n] = pages[:n]
        return out

    # ------------------------------------------------------------------ stats
    @property
    def pages_in_use(self) -> int:
        return self.allocator.num_used

    @property
    def pages_free(self) -> int:
        return self.allocator.num_free

    @property
    def page_bytes(self) -> int:
        """Device bytes of one page over all layers, K and V."""
        return kv_bytes_per_token(self.model_cfg, self.dtype) * self.page_size

    @property
    def bytes_in_use(self) -> int:
        return self.pages_in_use * self.page_bytes

    @property
    def bytes_total(self) -> int:
        return self.page_cfg.num_pages * self.page_bytes

    @property
    def pages_cached(self) -> int:
        """Pages holding a cached prefix (shared by requests or evictable)."""
        return self.allocator.num_cached

    def stats(self) -> dict[str, int]:
        """Counters for /metrics and results."""
        out = {"kv_pages_in_use": self.pages_in_use, "kv_pages_free": self.pages_free,
               "kv_bytes_in_use": self.bytes_in_use, "kv_bytes_total": self.bytes_total,
               "kv_requests": len(self._pages), **{f"kv_h2d_{c}_bytes": n for c, n in self.h2d_bytes.items()}}
        if self.prefix_caching:
            out.update(prefix_cached_pages=self.pages_cached, prefix_evictable_pages=self.allocator.num_evictable,
                       prefix_query_tokens=self.prefix_queries, prefix_hit_tokens=self.prefix_hits,
                       prefix_evictions=self.allocator.evictions)
        if self.host is not None:
            pool = self.host.pool.stats()
            out.update(prefix_hit_tokens_host=self.prefix_hits_host, prefix_host_writes=self.writeback.host_writes,
                       prefix_host_pages=pool.entries, prefix_host_bytes=pool.bytes_used,
                       prefix_host_evictions=pool.evictions)
        if self.remote is not None:  # own counters only: a scrape never waits on the remote pool
            out.update(prefix_hit_tokens_remote=self.prefix_hits_remote, prefix_remote_writes=self.writeback.remote_writes,
                       prefix_remote_lookups=self.remote.lookups, prefix_l3_errors=self.remote.errors,
                       prefix_finished_writes=self.finished_writes)
        if self.writeback is not None:
            out.update(prefix_writeback_pending_pages=self.writeback.pending_pages,
                       prefix_writeback_dropped_host=self.writeback.dropped["host"],
                       prefix_writeback_dropped_remote=self.writeback.dropped["remote"])
        return out
