"""Page geometry and the host-side page allocator of the paged KV cache (pure Python, no JAX).

A page holds `page_size` consecutive tokens of one request, for every layer and KV head (the
device arrays live in `paged.PagedKVCache`). Page `NULL_PAGE` (0) is never handed out: idle batch
rows and the padding entries of a page table point at it, so a write from an idle row or a read
past a request's pages lands in a scratch page and never in another request's live page.

Pages are reference-counted so that a prefix can be shared by several requests. Prefix caching
(`prefix.py` computes the keys) adds one state: a *full* page whose tokens are known may be
registered under a key (`cache_page`). Such a page is never written again (a request only writes
positions past its prompt's cached pages), so it is shared read-only and needs no copy-on-write.
When its count reaches 0 it is not freed but parked in an LRU of evictable cached pages, where a
later request with the same prefix can take it back (`match`); `allocate` evicts the least recently
used of them only when the free list is empty. States of a page:

    free  --allocate-->  in use (refcount >= 1)  --decref to 0-->  free           (no key)
                         in use, cached          --decref to 0-->  evictable      (keyed)
    evictable  --match-->  in use, cached;   evictable  --allocate (evict)-->  in use (key dropped)

`num_free` counts what `allocate` can hand out (free + evictable), `num_used` the pages requests
hold. The allocator is guarded by a lock, so a scheduler thread and a cancelling HTTP handler may
both call it; the eviction hook runs on the allocating thread, after the lock is released and
before `allocate` returns (so the evicted pages still hold their old KV while it runs).
"""
from __future__ import annotations

import collections
import dataclasses
import operator
import threading
from typing import Callable, Hashable, Iterable

NULL_PAGE = 0
DEFAULT_PAGE_SIZE = 16
DEFAULT_NUM_PAGES = 1024


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs."""

    def __init__(self, needed: int, free: int, capacity: int | None = None):
        self.needed = needed
        self.free = free
        self.capacity = capacity
        total = f" of {capacity}" if capacity is not None else ""
        super().__init__(
            f"the paged KV cache needs {needed} free pages but only {free}{total} are free; "
            "raise --num-pages (or the KV byte budget), lower the concurrency, or shorten "
            "prompts / max_tokens")


@dataclasses.dataclass(frozen=True)
class PageConfig:
    """Geometry of the page pool.

    page_size: tokens per page (P). num_pages: pages in the pool, including the reserved null
    page 0, so `num_pages - 1` pages hold request KV.
    """
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int = DEFAULT_NUM_PAGES

    def __post_init__(self):
        for name in ("page_size", "num_pages"):
            value = getattr(self, name)
            if isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be an int")
            try:  # numpy integers are fine (sizes are often computed with numpy); 16.0 is not
                object.__setattr__(self, name, operator.index(value))
            except TypeError:
                raise TypeError(f"{name}={value!r} must be an int") from None
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1 (tokens per page; 16 is usual)")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is the reserved null "
                             "page; at least one page must hold KV)")

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds when every usable page is full."""
        return self.usable_pages * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        """Pages a request of n_tokens tokens occupies."""
        if n_tokens < 0:
            raise ValueError(f"{n_tokens=} must be >= 0")
        return -(-n_tokens // self.page_size)

    @classmethod
    def for_tokens(cls, max_tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> "PageConfig":
        """A pool that holds max_tokens tokens in full pages (plus the null page).

        max_tokens should be the sum over concurrent requests of prompt + max_tokens, since
        each request rounds up to whole pages: sum(ceil(n_r / P)) pages are needed at most.
        """
        if max_tokens < 1:
            raise ValueError(f"{max_tokens=} must be >= 1")
        return cls(page_size=page_size, num_pages=-(-max_tokens // page_size) + 1)

    @classmethod
    def for_bytes(cls, budget_bytes: int, bytes_per_token: int,
                  page_size: int = DEFAULT_PAGE_SIZE) -> "PageConfig":
        """The largest pool whose device KV fits budget_bytes.

        bytes_per_token: KV bytes of one token over all layers (`paged.kv_bytes_per_token`).
        """
        if bytes_per_token < 1:
            raise ValueError(f"{bytes_per_token=} must be >= 1")
        num_pages = budget_bytes // (bytes_per_token * page_size)
        if num_pages < 2:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds {num_pages} pages of {page_size} tokens "
                f"at {bytes_per_token} bytes a token; give at least {2 * bytes_per_token * page_size} "
                "bytes (2 pages: the null page and one usable page)")
        return cls(page_size=page_size, num_pages=int(num_pages))


class PageAllocator:
    """Free list, reference counts and cached-prefix pages of pages 1..num_pages-1 (page 0 is the
    null page).

    Allocation pops the most recently freed page first (its memory is likely still cached), then
    evicts the least recently used evictable cached page. Every method checks its whole argument
    before changing anything, so a failed call leaves the allocator as it was.

    on_evict: called with [(page, key), ...] when `allocate` evicts cached pages (e.g. to write
    them to a host tier); the pages still hold the evicted KV during the call.
    """

    def __init__(self, num_pages: int, on_evict: Callable[[list[tuple[int, Hashable]]], None] | None = None):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self.on_evict = on_evict
        self._refcount = [0] * num_pages
        # Reversed so that the first allocations get pages 1, 2, 3, ... (readable in tests and logs).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._key_of: dict[int, Hashable] = {}  # cached page -> its key
        self._page_of: dict[Hashable, int] = {}  # key -> cached page
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.evictions = 0  # cached pages dropped to make room, over the allocator's life
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def grow(self, num_pages: int) -> None:
        """Add pages [self.num_pages, num_pages) to the free list (a pool that grew; never shrinks).
        The lower ids still go first, so existing pages and page tables are untouched."""
        with self._lock:
            if num_pages <= self.num_pages:
                return
            self._refcount.extend([0] * (num_pages - self.num_pages))
            self._free[:0] = range(num_pages - 1, self.num_pages - 1, -1)
            self.num_pages = num_pages

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages held by at least one reference."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered under a prefix key (held by requests or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Cached pages no request holds (kept until `allocate` needs them)."""
        return len(self._evictable)

    def refcount(self, page: int) -> int:
        page = operator.index(page)
        self._check_ids([page])
        return self._refcount[page]

    def key_of(self, page: int):
        """The key a cached page is registered under, or None."""
        return self._key_of.get(operator.index(page))

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with reference count 1, evicting cached pages (least recently used
        first) when the free list runs short. Raises OutOfPages (nothing allocated or evicted)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{n=} must be an int >= 0 (pages to allocate)")
        evicted = []
        with self._lock:
            if n > len(self._free) + len(self._evictable):
                raise OutOfPages(n, len(self._free) + len(self._evictable), self.capacity)
            pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
            while len(pages) < n:
                page, _ = self._evictable.popitem(last=False)
                key = self._key_of.pop(page)
                del self._page_of[key]
                evicted.append((page, key))
                pages.append(page)
            for p in pages:
                self._refcount[p] = 1
            self.evictions += len(evicted)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference to each page (a page listed twice gains two); each must be in use."""
        pages = [operator.index(p) for p in pages]
        with self._lock:
            self._check_ids(pages)
            free = [p for p in pages if self._refcount[p] == 0]
            if free:
                raise ValueError(f"pages {free[:8]} are free; only a page in use can gain a reference "
                                 "(allocate it first)")
            for p in pages:
                self._refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference per listed page; returns the pages whose count reached 0 (free again,
        or evictable if cached).

        Raises ValueError (and changes nothing) if a page would drop below 0: a double free.
        """
        pages = [operator.index(p) for p in pages]
        with self._lock:
            self._check_ids(pages)
            drops: dict[int, int] = {}
            for p in pages:
                drops[p] = drops.get(p, 0) + 1
            over = [p for p, d in drops.items() if d > self._refcount[p]]
            if over:
                raise ValueError(f"pages {over[:8]} would be released more often than they are "
                                 f"referenced (refcounts {[self._refcount[p] for p in over[:8]]}): "
                                 "a double free")
            freed = []
            for p, d in drops.items():
                self._refcount[p] -= d
                if self._refcount[p] == 0:
                    if p in self._key_of:
                        self._evictable[p] = None  # most recently used: evicted last
                    else:
                        self._free.append(p)
                    freed.append(p)
            return freed

    # ------------------------------------------------------------ prefix caching
    def cache_page(self, page: int, key: Hashable) -> bool:
        """Register an in-use, full page as holding the KV named by `key` (its chained prefix hash).

        The caller promises the page is never written again. Returns False (and registers nothing)
        when another page already holds `key` (two requests computed the same prefix at once: the
        second copy stays private and is freed as usual) or when this page is already cached.
        """
        page = operator.index(page)
        with self._lock:
            self._check_ids([page])
            if self._refcount[page] == 0:
                raise ValueError(f"page {page} is free; only a page a request holds can be cached")
            if key in self._page_of or page in self._key_of:
                return False
            self._key_of[page] = key
            self._page_of[key] = page
            return True

    def match(self, keys: Iterable[Hashable]) -> list[int]:
        """The cached pages of the longest leading run of `keys`, each with one more reference (an
        evictable page comes back into use). Stops at the first key that is not cached."""
        pages = []
        with self._lock:
            for key in keys:
                page = self._page_of.get(key)
                if page is None:
                    break
                if self._refcount[page] == 0:
                    del self._evictable[page]
                self._refcount[page] += 1
                pages.append(page)
        return pages

    def cached_run(self, keys: Iterable[Hashable]) -> int:
        """How many of `keys`, from the first, are cached (a probe: no reference, no recency)."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._page_of:
                    break
                n += 1
        return n

    def clear_cache(self) -> int:
        """Forget every cached key: evictable pages go to the free list, pages requests still hold
        become plain pages (freed when released). Returns how many keys were dropped."""
        with self._lock:
            n = len(self._key_of)
            self._free.extend(self._evictable)
            self._evictable.clear()
            self._key_of.clear()
            self._page_of.clear()
            return n

    def check(self) -> None:
        """Assert the allocator's invariants (tests, leak checks): every usable page is exactly one
        of free / evictable / in use, and the key maps are inverse."""
        with self._lock:
            free, evictable = set(self._free), set(self._evictable)
            used = {p for p in range(1, self.num_pages) if self._refcount[p] > 0}
            assert len(free) == len(self._free), "a page is twice in the free list"
            assert not (free & evictable) and not (free & used) and not (evictable & used)
            assert free | evictable | used == set(range(1, self.num_pages)), "a page is in no state: leaked"
            assert all(p in self._key_of for p in evictable), "an evictable page has no key"
            assert not free & set(self._key_of), "a free page still has a key"
            assert {k: p for p, k in self._key_of.items()} == self._page_of

    def _check_ids(self, pages: list[int]) -> None:
        bad = [p for p in pages if not NULL_PAGE < p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:8]} are not in 1..{self.num_pages - 1} "
                             f"(page {NULL_PAGE} is the reserved null page)")
