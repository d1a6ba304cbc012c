"""Page geometry and the host-side page allocator of the paged KV cache (pure Python, no JAX).

A page holds `page_size` consecutive tokens of one request, for every layer and KV head (the
device arrays live in `paged.PagedKVCache`). Page `NULL_PAGE` (0) is never handed out: idle batch
rows and the padding entries of a page table point at it, so a write from an idle row or a read
past a request's pages lands in a scratch page and never in another request's live page.

Pages are reference-counted so that a prefix can later be shared by several requests: a page
returns to the free list when its count reaches 0. The allocator is guarded by a lock, so a
scheduler thread and a cancelling HTTP handler may both call it.
"""
from __future__ import annotations

import dataclasses
import operator
import threading
from typing import Iterable

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
    """Free list and reference counts of pages 1..num_pages-1 (page 0 is the null page).

    Allocation pops the most recently freed page first (its memory is likely still cached).
    Every method checks its whole argument before changing anything, so a failed call leaves
    the allocator as it was.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        # Reversed so that the first allocations get pages 1, 2, 3, ... (readable in tests and logs).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, page: int) -> int:
        page = operator.index(page)
        self._check_ids([page])
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with reference count 1. Raises OutOfPages (nothing allocated)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{n=} must be an int >= 0 (pages to allocate)")
        with self._lock:
            if n > len(self._free):
                raise OutOfPages(n, len(self._free), self.capacity)
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._refcount[p] = 1
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
        """Drop one reference per listed page; returns the pages that became free.

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
                    self._free.append(p)
                    freed.append(p)
            return freed

    def _check_ids(self, pages: list[int]) -> None:
        bad = [p for p in pages if not NULL_PAGE < p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:8]} are not in 1..{self.num_pages - 1} "
                             f"(page {NULL_PAGE} is the reserved null page)")
