"""Prefix reuse across the prefill/decode split (issue 19, item 3).

The decode role keeps finished requests' complete prompt pages in its paged cache under the
chained page hash of `jkv.kvcache.prefix` (`DecodeWorker(prefix_caching=True)`). A request whose
prompt starts with cached pages shares them, and only its new rows cross the link:

    decode, plan      hit = DecodePages.plan(..., prompt)       cached leading pages shared (mask 1)
                      `mark_cached`: staging mask LOCAL and `on_device` over [0, hit), so landing,
                      the lookahead and the fetch lanes never ask for those rows
                      `uncached_blocks`, `uncached_kr`: the block plan and Kr cover blocks that end
                      past `hit` only (SmartGen's importance order and Eq. 2 apply to the new part)
    decode, hand-in   the "prefill" entry carries "prefix": `handin_prefix` (the cached tokens and
                      the key of the last cached page, with the namespace's dtype and page size)
    prefill           `prefill_geometry` checks the key against its own hash of the same tokens
                      (same weights: the namespace holds the model's fingerprint) and returns a
                      geometry whose `runs` start at `hit`: proactive and speculative pushes skip
                      the cached rows, a block that straddles `hit` sends its new rows only
    decode, finish    `keep_finished`: rows that arrived since the last step are landed, rows the
                      selective transfer never moved are fetched from the owner (one "fetch" per
                      layer, before "free"), and the leading pages whose every row (all layers and
                      KV heads) is on the device are offered to the cache

Only prompt pages are cached, never pages with generated tokens: their KV was computed by
sparse decode steps, not by a prefill, so a later prompt that contains them would see different
KV than a prefill gives it, and greedy tokens would differ from a run without prefix caching.
A request whose KV moves compressed (KVServe) or token-dropped neither uses nor feeds the cache:
its landed rows are lossy, and a hit would also change what a run without caching lands.
The selector metadata ("meta") still covers the whole prompt (it is computed from the prefill's
keys and is small next to the KV). The prefill side computes only what its own prefix cache
lacks (jkv/disagg/prefill_cache.py); its layer hook still sees the whole prompt's KV.

Threads: everything here runs on the decode worker's engine thread, or on the prefill worker's
main loop (`prefill_geometry`).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from jkv.kvbuffers.fetch import FetchCall, iter_reply, keep_rows, read_reply
from jkv.kvbuffers.geometry import LOCAL, BlockGeometry
from jkv.kvcache.prefix import extend_page_keys, prefix_namespace
from transport import TransportError

log = logging.getLogger(__name__)


# -------------------------------------------------------------------- decode side: the plan
def prefix_eligible(compression, keep=None) -> bool:
    """A request may use and feed the decode side's prefix cache: its KV moves uncompressed and
    whole (see the module docstring)."""
    return compression is None and keep is None


def mark_cached(lv, hit: int) -> None:
    """Rows [0, hit) of a planned request are in shared device pages: staging mask LOCAL (the
    lookahead skips them, release counts them) and on the device (landing never copies them)."""
    lv.prefix_hit = int(hit)
    if hit:
        lv.kv.mask[:, :hit] = LOCAL
        lv.on_device[:, :, :hit] = True


def uncached_blocks(order: np.ndarray, geometry: BlockGeometry, hit: int) -> np.ndarray:
    """The flat block ids of `order` (same order) with a token past `hit`: i32[<= len(order)]."""
    if not hit:
        return order
    M = geometry.blocks_per_layer
    stop = np.minimum((np.asarray(order) % M + 1) * geometry.block_tokens, geometry.num_tokens)
    return np.asarray(order)[stop > hit]


def uncached_kr(transfer, kr_all: int, remaining: int) -> int:
    """Kr over the uncached blocks: a forced fraction applies to them; Eq. 2's count of blocks
    that fit the prefill window is unchanged (a block keeps its size) but capped by them."""
    if transfer.mode != "full" and transfer.kr_fraction is not None:
        return min(remaining, int(math.ceil(transfer.kr_fraction * remaining)))
    return min(remaining, kr_all)


def handin_prefix(pages, lv) -> dict:
    """The hand-in's "prefix" field of a request with a hit: what the prefill side checks."""
    ns = pages.cache.prefix_namespace
    key = extend_page_keys([], lv.req.prompt_token_ids, ns, limit=lv.prefix_hit // ns.chunk_tokens)[-1]
    return dict(tokens=lv.prefix_hit, key=key.hex(), dtype=ns.dtype, page_size=ns.chunk_tokens)


# -------------------------------------------------------------------- prefill side
@dataclasses.dataclass(frozen=True)
class SkipPrefixGeometry(BlockGeometry):
    """A prompt's block geometry whose first `skip_tokens` tokens the decode side already holds:
    `runs` starts after them, so no push carries a cached row (block ids are unchanged)."""

    skip_tokens: int = 0

    def runs(self, layer_blocks) -> list[tuple[int, int]]:
        return [(max(start, self.skip_tokens), stop) for start, stop in super().runs(layer_blocks)
                if stop > self.skip_tokens]


def prefill_geometry(model, request: dict) -> BlockGeometry:
    """The geometry of one "prefill" entry; with a "prefix" field, one that skips the cached rows
    after checking that this worker hashes the same leading tokens to the same key. Raises
    ValueError (the batch fails with the reason) on a prefix the decode side could not hold."""
    n, L, M = len(request["tokens"]), model.cfg.num_layers, int(request["max_blocks"])
    prefix = request.get("prefix")
    if not prefix:
        return BlockGeometry(n, L, M)
    skip, P = int(prefix["tokens"]), int(prefix["page_size"])
    if "compression" in request or not (0 < skip < n and skip % P == 0):
        raise ValueError(f"request {request['rid']}: a cached prefix of {skip} tokens (pages of {P}) for a prompt of "
                         f"{n} tokens{' with compression' if 'compression' in request else ''} is not one a decode "
                         "worker plans; the decode worker and this prefill worker run different jkv versions")
    ns = prefix_namespace(model, prefix["dtype"], P)
    key = extend_page_keys([], request["tokens"], ns, limit=skip // P)[-1]
    if key.hex() != prefix["key"]:
        raise ValueError(f"request {request['rid']}: the decode side's cached prefix of {skip} tokens has key "
                         f"{prefix['key']} but this prefill worker hashes those tokens to {key.hex()}: the two roles "
                         "load different weights; start them from one checkpoint")
    return SkipPrefixGeometry(n, L, M, skip)


# -------------------------------------------------------------------- decode side: finish
def complete_pages(on_device: np.ndarray, page_size: int) -> int:
    """Leading full pages of the prompt whose every row is on the device.
    on_device: bool[L, H_kv, N] (`LiveRequest.on_device`)."""
    L, H, n = on_device.shape
    full = n // page_size
    if not full:
        return 0
    ok = on_device[:, :, :full * page_size].reshape(L, H, full, page_size).all(axis=(0, 1, 3))
    return full if ok.all() else int(np.argmin(ok))


def keep_finished(worker, lv, pull: bool = True) -> int:
    """A finished request's complete prompt pages go to the decode side's prefix cache (engine
    thread, before its owner is told to free it). Returns the pages it holds complete.

    pull: first fetch the prompt rows the selective transfer never moved, so every full page can
    be cached. That fetch runs on the engine thread; the caller passes False when other requests
    decode after this step, so caching never stalls their steps (then only pages already complete
    on the device are kept)."""
    pages = worker.pages
    if not (pages.cache.prefix_caching and lv.finished and prefix_eligible(lv.compression, lv.keep)):
        return 0
    n, P = lv.geometry.num_tokens, pages.page_size
    if n < P:
        return 0
    table = pages.table([lv.rid], lv.kv.capacity)
    for layer in range(worker.model.cfg.num_layers):  # what arrived since the request's last step
        pages.land([lv], layer, table, worker.phases)
    if pull and complete_pages(lv.on_device, P) < n // P and not lv.released and worker.owner_alive(lv.owner):
        _pull_missing(worker, lv, n // P * P, table)
    done = complete_pages(lv.on_device, P)
    if done > lv.prefix_hit // P:
        pages.cache.commit_pages(lv.rid, lv.req.prompt_token_ids[:done * P])
    return done


def _pull_missing(worker, lv, limit: int, table) -> None:
    """Fetch from the owner the rows below `limit` the selective transfer never moved (one "fetch"
    per layer, all in flight at once) and land them. A failure only leaves pages uncached."""
    H, D = worker.model.cfg.num_kv_heads, worker.model.cfg.head_dim
    calls = []
    try:
        peer = worker.endpoint.peer(lv.owner)
        for layer in range(worker.model.cfg.num_layers):
            call = FetchCall(layer)
            call.add(lv.rid, [(h, np.flatnonzero(~lv.on_device[layer, h, :limit]).astype(np.int32))
                              for h in range(H)])
            if call.rows:
                calls.append((call, peer.call_async("fetch", call.payload())))
        for call, transfer in calls:
            reply, _ = read_reply(transfer.result(), call, D, f"fetch reply from {lv.owner!r}")
            for h, positions, k, v in iter_reply(reply, call.segments):
                keep_rows(lv, call.layer, h, positions, k, v)
            worker.pages.land([lv], call.layer, table, worker.phases)
    except (KeyError, TransportError, RuntimeError) as e:
        log.warning("request %s: fetching its remaining prompt rows for the prefix cache from %r failed (%s); "
                    "its incomplete pages are not cached", lv.req.request_id, lv.owner, e)


__all__ = ["SkipPrefixGeometry", "complete_pages", "handin_prefix", "keep_finished", "mark_cached",
           "prefill_geometry", "prefix_eligible", "uncached_blocks", "uncached_kr"]
