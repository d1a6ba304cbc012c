"""`PagedKVCache`: the device-resident paged KV cache and its per-request page tables.

    cache = PagedKVCache(model.cfg, PageConfig(page_size=16, num_pages=4096))
    cache.reserve("r1", len(prompt))                         # pages for the prompt
    table = cache.table(["r1", None])                         # i32[B, max_pages]; None = idle row
    logits, cache.kv = model.prefill_chunk(cache.kv, table, tokens, start, lengths)
    cache.reserve("r1", position + 1)                         # grows by a page every P tokens
    logits, cache.kv = model.paged_decode_step(cache.kv, cache.table(["r1"]), tok, positions)
    cache.free("r1")                                          # pages back to the pool

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

import threading
from typing import Hashable, Sequence

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.paged import init_pages

from .pages import NULL_PAGE, PageAllocator, PageConfig

MIN_TABLE_PAGES = 4


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


class PagedKVCache:
    """Device pages plus per-request page tables. Request ids are any hashable key."""

    def __init__(self, model_cfg: ModelConfig, page_cfg: PageConfig | None = None, dtype=None, sharding=None):
        self.model_cfg = model_cfg
        self.page_cfg = page_cfg if page_cfg is not None else PageConfig()
        self.dtype = jnp.dtype(dtype if dtype is not None else model_cfg.dtype)
        # sharding: `Model.kv_sharding` under tensor parallelism (pages split by KV head), else None
        self.kv = init_pages(model_cfg, self.page_cfg.num_pages, self.page_cfg.page_size, self.dtype, sharding)
        self.allocator = PageAllocator(self.page_cfg.num_pages)
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return (f"PagedKVCache(page_size={self.page_size}, pages {self.pages_in_use}/"
                f"{self.allocator.capacity} in use, {len(self._pages)} requests, {self.dtype})")

    @property
    def page_size(self) -> int:
        return self.page_cfg.page_size

    # ------------------------------------------------------------ per request
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

    def free(self, request_id: Hashable) -> int:
        """Drop the request's references to its pages; returns how many pages became free.

        Safe to call twice (and for an id never reserved): cancel, failure and finish paths may
        each free a request, and only the first call releases anything.
        """
        with self._lock:
            pages = self._pages.pop(request_id, None)
            self._lengths.pop(request_id, None)
            return len(self.allocator.decref(pages)) if pages else 0

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

    def stats(self) -> dict[str, int]:
        """Counters for /metrics and results."""
        return {"kv_pages_in_use": self.pages_in_use, "kv_pages_free": self.pages_free,
                "kv_bytes_in_use": self.bytes_in_use, "kv_bytes_total": self.bytes_total,
                "kv_requests": len(self._pages)}
