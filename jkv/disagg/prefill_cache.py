"""The prefill role's own prefix cache: a request whose prompt starts with cached pages is
prefilled from its first uncached token (issue 19 item 3, last sentence).

    cache = PrefillPrefixCache(model, budget_tokens=16384)
    plans = [cache.plan(tokens) for tokens in prompts]        # shares cached leading pages
    logits = model.prefill_after(new_tokens, start, todo, context=lambda l: cache.context(plans, l, T),
                                 on_layer=hook)               # hook: cache.store_layer(plan, l, kv) per row
    cache.commit(plan)                                        # after the last layer; cache.release on failure

Pages hold `page_size` prompt tokens of every layer, K and V, in the model's dtype, on the host
(`pages: [num_pages, L, 2, H_kv, P, D]`), keyed by the chained page hash of `jkv.kvcache.prefix`
in the namespace every tier uses (model id + weights fingerprint, dtype, page size): the decode
role's L1, the host pool and a remote pool name a prefix with the same key. Only full pages are
cached, and at most `shareable_pages` of a prompt (its last token is always computed: its logits
give the first token). `PageAllocator` gives reference counts and LRU eviction under the budget.

What a page holds is exact prefill KV, written by the per-layer hook before a compressed
request's codec overwrites its host copy (KVServe's absorb) and before a token-dropping request's
keep table is decided, so requests that move compressed or token-dropped use and feed this cache
like any other: the cache changes what is computed, never what is sent (the decode side's rule
that lossy KV neither uses nor feeds its cache is about the landed, lossy rows).

Lifetime of a plan: `plan` takes a reference on the shared pages and allocates the request's new
full pages (none when the budget is all referenced: the request is then computed whole and
caches nothing); `store_layer` fills the new pages layer by layer; `commit` registers them
under their keys and drops every reference; `release` drops them without registering (a failed
or abandoned prefill). Pages hold no reference after the prefill: pushes and on-demand rows are
served from the request's own host copy, so eviction never races a transfer.

Threads: the prefill worker's main loop runs plan/context/store_layer/commit/release; `stats`
may be read from any thread (the allocator's lock guards its state; counters are ints).
"""
from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np

from jkv.kvcache.pages import OutOfPages, PageAllocator
from jkv.kvcache.prefix import extend_page_keys, prefix_namespace, shareable_pages

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16  # the decode role's default (jkv.kvcache.pages.DEFAULT_PAGE_SIZE)
_CHUNK_BUCKET = 64  # new-token counts are padded to a multiple of this (few compiled shapes)


@dataclasses.dataclass
class CachePlan:
    """One request's use of the cache: its first `len(shared)` pages come from it (start =
    len(shared) * P tokens are not computed); `new` pages receive its next full pages."""

    keys: list[bytes]  # of every full page of the prompt
    shared: list[int]
    new: list[int]
    num_tokens: int
    page_size: int
    open: bool = True  # holds references (until commit or release)

    @property
    def start(self) -> int:
        """Tokens whose KV comes from the cache (a page multiple, < num_tokens)."""
        return len(self.shared) * self.page_size


class PrefillPrefixCache:
    def __init__(self, model, budget_tokens: int, page_size: int = DEFAULT_PAGE_SIZE):
        """budget_tokens: tokens of KV (all layers, K and V) the cache may hold, a multiple of
        page_size >= page_size; host memory is budget_tokens * 2 * L * H_kv * D * itemsize."""
        if page_size < 1 or budget_tokens < page_size:
            raise ValueError(f"{budget_tokens=} must be >= {page_size=} >= 1 (one page); pass 0 to the worker to "
                             "run without a prefill prefix cache")
        cfg = model.cfg
        self.page_size = int(page_size)
        self.dtype = jnp.dtype(cfg.dtype)
        self.namespace = prefix_namespace(model, self.dtype, self.page_size)
        num_pages = budget_tokens // self.page_size + 1  # + the allocator's null page
        self.allocator = PageAllocator(num_pages)
        self.pages = np.zeros((num_pages, cfg.num_layers, 2, cfg.num_kv_heads, self.page_size, cfg.head_dim),
                              self.dtype)
        self.query_tokens = 0  # prompt tokens looked up (the shareable part)
        self.hit_tokens = 0  # of those, tokens whose KV came from the cache
        self.computed_tokens = 0  # prompt tokens the prefill computed (hits are not)

    @property
    def budget_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    def plan(self, tokens) -> CachePlan:
        """Start one request (tokens: i32[N], its prompt): share its cached leading pages and
        allocate its other full pages."""
        P, n = self.page_size, len(tokens)
        keys = extend_page_keys([], tokens, self.namespace)
        shareable = shareable_pages(n, P)
        shared = self.allocator.match(keys[:shareable])
        try:  # every full page of the prompt (the last one too, when the prompt fills it) can be cached
            new = self.allocator.allocate(len(keys) - len(shared))
        except OutOfPages:  # every page is referenced by this batch: compute, cache nothing more
            new = []
        self.query_tokens += shareable * P
        self.hit_tokens += len(shared) * P
        self.computed_tokens += n - len(shared) * P
        return CachePlan(keys, shared, new, n, P)

    def context(self, plans: list[CachePlan], layer: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The cached KV of `layer` for a batch: (K, V), each [B, H_kv, width, D], row b's first
        plans[b].start positions from its shared pages, zeros after."""
        _, L, _, H, P, D = self.pages.shape
        out = np.zeros((2, len(plans), H, width, D), self.dtype)
        for b, plan in enumerate(plans):
            if plan.shared:
                rows = self.pages[plan.shared, layer]  # [S, 2, H_kv, P, D]
                out[:, b, :, :plan.start] = rows.transpose(1, 2, 0, 3, 4).reshape(2, H, plan.start, D)
        return out[0], out[1]

    def store_layer(self, plan: CachePlan, layer: int, kv_layer: np.ndarray) -> None:
        """Copy a request's exact KV of `layer` into its new pages. kv_layer: f32[2, H_kv, N, D]
        (its host copy, before any codec overwrites it)."""
        if not plan.new:
            return
        P, first = self.page_size, len(plan.shared)
        rows = kv_layer[:, :, first * P:(first + len(plan.new)) * P]  # [2, H_kv, n_new * P, D]
        two, H, _, D = rows.shape
        self.pages[plan.new, layer] = rows.reshape(two, H, len(plan.new), P, D).transpose(2, 0, 1, 3, 4)

    def commit(self, plan: CachePlan) -> int:
        """After every layer was stored: register the new pages under their keys (later prompts
        share them) and drop the plan's references. Returns the pages newly cached."""
        if not plan.open:
            return 0
        first = len(plan.shared)
        cached = sum(self.allocator.cache_page(page, plan.keys[first + i]) for i, page in enumerate(plan.new))
        self.release(plan)
        return cached

    def release(self, plan: CachePlan) -> None:
        """Drop the plan's references (idempotent); pages never committed go back to the free list."""
        if plan.open:
            plan.open = False
            self.allocator.decref(plan.shared + plan.new)

    def stats(self) -> dict[str, int]:
        """Counters for /metrics and the "stats" RPC."""
        a = self.allocator
        return dict(prefill_prefix_query_tokens=self.query_tokens, prefill_prefix_hit_tokens=self.hit_tokens,
                    prefill_computed_tokens=self.computed_tokens, prefill_prefix_cached_pages=a.num_cached,
                    prefill_prefix_pages_in_use=a.num_used, prefill_prefix_evictions=a.evictions,
                    prefill_prefix_budget_tokens=self.budget_tokens)


def prefill_rows(model, cache: PrefillPrefixCache | None, tokens: np.ndarray, lengths: np.ndarray,
                 plans: list[CachePlan] | None, on_layer):
    """The batch's prefill: whole prompts (`Model.prefill`) when no row hits the cache, else each
    row from its first uncached token (`Model.prefill_after`, the cached rows as context), the hook
    seeing the whole prompts' KV either way; then the plans are committed (released if it raised:
    nothing a failed prefill computed is cached). on_layer must `store_layer` each plan's layer.
    tokens: i32[B, T] right-padded prompts; lengths: i32[B]. Returns logits f32[B, V] at each
    prompt's last token."""
    try:
        logits = _prefill(model, cache, tokens, lengths, plans, on_layer)
    except BaseException:
        for plan in plans or ():
            cache.release(plan)
        raise
    for plan in plans or ():  # every layer is stored: later prompts share these pages
        cache.commit(plan)
    return logits


def _prefill(model, cache, tokens, lengths, plans, on_layer):
    if not plans or not any(p.start for p in plans):
        return model.prefill(tokens, lengths, on_layer=on_layer)[0]
    B, T = tokens.shape
    start = np.asarray([p.start for p in plans], np.int32)
    todo = (lengths - start).astype(np.int32)  # >= 1: the last prompt token is never cached
    C = -(-int(todo.max()) // _CHUNK_BUCKET) * _CHUNK_BUCKET
    new = np.zeros((B, C), np.int32)
    for b in range(B):
        new[b, :todo[b]] = tokens[b, start[b]:lengths[b]]
    return model.prefill_after(new, start, todo, lambda layer: cache.context(plans, layer, T), on_layer=on_layer)


__all__ = ["CachePlan", "PrefillPrefixCache", "prefill_rows"]
