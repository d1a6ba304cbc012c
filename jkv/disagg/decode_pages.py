"""The decode worker's device KV: the paged cache, the SmartGen KV mask next to it, and landing.

    pages = DecodePages(model.cfg, PageConfig(page_size=16, num_pages=1025))
    pages.plan(rid, prompt_len, tokens)        # pages for the request; mask REMOTE over the prompt
    table = pages.table(rids, capacity)        # i32[B, ceil(N_cap / P)] (host), idle rows null
    pages.land(lives, layer, table, clock)     # staging -> device pages, then mask 1 (per layer)
    pages.free(rid)

Two tiers (DESIGN.md "Where KV lives"): L1 is `cache` (per layer K, V `[num_pages, H_kv, P, D]`
in the model's dtype, on the default JAX device) with `mask` (i8[L, num_pages, H_kv, P], see
jkv/kvcache/sparse.py); L2 is each request's host staging buffer (`RequestKV`: the transport's
registered regions "kv/<rid>", "mask/<rid>"), where every byte from the network lands: block
writes and their mask bytes (proactive and speculative pushes), decoded "ckv" frames, on-demand
and lookahead replies (`fetch.keep_rows`: rows plus `fetched`), recomputed prompts.

Landing (`land`, engine thread, once per layer before its split and once after its on-demand
replies): read the staging mask first, then copy the rows it shows LOCAL (or `fetched`) and not
yet on the device into the pages in one batch per layer, in the same program that flips their
device mask entries to 1. A transport writes a row before its mask byte, so a row read after its
mask byte is complete; a device 1 is written with its row, so a 1 is always safe to read.
GPUDirect RDMA: a NIC that writes straight into device memory does the same protocol without this
step: its WRITE puts the rows into the pages (the page table of the request is the region) and its
ordered second WRITE flips the device mask byte; `land` then finds nothing to copy.

Only these copies move KV host->device, and `land` counts them by cause into the step clock and
`h2d_bytes` (totals): "arrived" (block writes and "ckv" frames), "fetched" (on-demand and
lookahead replies), "other" (a prompt recomputed here after its owner failed). The step's own
new K, V are computed on the device and written there (`write_new`): no host->device bytes.
Uploads go in power-of-two pieces, so every byte counted is a row (no padding crosses) and a few
compiled programs serve every batch size.

Threads: everything runs on the decode worker's engine thread (plan, land, write, gather, free);
the host shadows it reads (`LiveRequest.on_device`, `landed`) belong to that thread too.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv.kvbuffers.geometry import DROPPED, LOCAL, PAD, REMOTE
from jkv.kvcache import NULL_PAGE, PageConfig, PagedKVCache
from jkv.kvcache import sparse

CAUSES = ("arrived", "fetched", "other")
DEFAULT_DECODE_TOKENS = 16384  # device KV tokens of the default pool (--num-pages overrides)


def _pow2_pieces(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first (upload piece sizes)."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


class DecodePages:
    def __init__(self, model_cfg, page_cfg: PageConfig | None = None, dtype=None):
        if page_cfg is None:
            page_cfg = PageConfig.for_tokens(DEFAULT_DECODE_TOKENS)
        self.cache = PagedKVCache(model_cfg, page_cfg, dtype)
        self.num_kv_heads, self.head_dim = model_cfg.num_kv_heads, model_cfg.head_dim
        self.mask = sparse.init_mask(model_cfg.num_layers, page_cfg.num_pages, model_cfg.num_kv_heads,
                                     page_cfg.page_size)
        self.row_bytes = 2 * model_cfg.head_dim * self.cache.dtype.itemsize  # one K row and one V row
        self.h2d_bytes = dict.fromkeys(CAUSES, 0)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    # ------------------------------------------------------------ per request
    def plan(self, rid, prompt_len: int, tokens: int) -> None:
        """Reserve pages for `tokens` tokens (prompt + generated) and set their mask: REMOTE over
        the prompt, PAD after. Raises OutOfPages (nothing reserved) when the pool is short."""
        P = self.page_size
        new = self.cache.reserve(rid, tokens)
        first = len(self.cache.pages_of(rid)) - len(new)
        token = (first + np.arange(len(new)))[:, None] * P + np.arange(P)[None, :]
        values = np.where(token < prompt_len, REMOTE, PAD).astype(np.int8)
        width = 1 << max(len(new) - 1, 0).bit_length()  # a few compiled shapes
        pages = np.full(width, NULL_PAGE, np.int32)
        pages[:len(new)] = new
        padded = np.full((width, P), PAD, np.int8)
        padded[:len(new)] = values
        self.mask = sparse.set_page_masks(self.mask, jnp.asarray(pages), jnp.asarray(padded))

    def mark_dropped(self, rid, dropped: np.ndarray) -> int:
        """A token-dropping profile's dropped prompt rows dropped bool[L, H_kv, N] become DROPPED in
        the device mask (never selected, fetched or landed; `sparse.drop_dropped`). The request's
        pages were planned (`plan`) and its prompt rows are not landed yet. Returns the entries."""
        layers, heads, tokens = np.nonzero(dropped)
        if not layers.size:
            return 0
        P = self.page_size
        pages = np.asarray(self.cache.pages_of(rid), np.int32)[tokens // P]
        width = 1 << (layers.size - 1).bit_length()  # a few compiled shapes; padding: null page, PAD
        cols = np.zeros((4, width), np.int32)
        cols[:, :layers.size] = layers, pages, heads, tokens % P
        values = np.full(width, PAD, np.int8)
        values[:layers.size] = DROPPED
        self.mask = sparse.set_entries(self.mask, *(jnp.asarray(c) for c in cols), jnp.asarray(values))
        return int(layers.size)

    def free(self, rid) -> int:
        """Return the request's pages (idempotent); their mask is set again by the next `plan`."""
        return self.cache.free(rid)

    def table(self, rids, capacity: int) -> np.ndarray:
        """i32[B, ceil(capacity / P)]: each request's pages, null-padded (a request already freed
        reads as an idle all-null row)."""
        present = set(self.cache.requests)
        return self.cache.table([r if r in present else None for r in rids], -(-capacity // self.page_size))

    # ------------------------------------------------------------ landing
    def land(self, lives, layer: int, table: np.ndarray, clock) -> int:
        """Copy the rows of `layer` that are in staging (LOCAL or fetched) and not on the device
        into the pages, then flip their device mask to 1. Returns the bytes copied."""
        P, parts = self.page_size, []
        for b, lv in enumerate(lives):
            if lv.landed[layer]:
                continue
            n = lv.geometry.num_tokens
            arrived = lv.kv.mask[layer, :n] == LOCAL  # the mask first: its rows are complete
            fetched = lv.fetched[layer, :, :n]
            want = (arrived[None, :] | fetched) & ~lv.on_device[layer, :, :n]
            heads, tokens = np.nonzero(want)
            if heads.size:
                cause = np.where(arrived[tokens], 0, 1) if not lv.recomputed else np.full(heads.size, 2)
                parts.append((table[b, tokens // P], heads, tokens % P, lv.kv.kv[0, layer, heads, tokens],
                              lv.kv.kv[1, layer, heads, tokens], cause))
                lv.on_device[layer, heads, tokens] = True
            lv.landed[layer] = bool(arrived.all() and lv.on_device[layer, :, :n].all())
        if not parts:
            return 0
        pages, heads, slots, k, v, cause = (np.concatenate(x) for x in zip(*parts))
        self._upload(layer, pages, heads, slots, k, v)
        for c, name in enumerate(CAUSES):
            nbytes = int((cause == c).sum()) * self.row_bytes
            self.h2d_bytes[name] += nbytes
            clock.count(f"h2d_{name}_bytes_n", nbytes)
        return len(cause) * self.row_bytes

    def _upload(self, layer, pages, heads, slots, k, v) -> None:
        dtype = self.cache.dtype
        k, v = np.asarray(k, dtype), np.asarray(v, dtype)
        at = 0
        for size in _pow2_pieces(len(pages)):
            s = slice(at, at + size)
            at += size
            K, V = self.cache.kv[layer]
            K, V, self.mask = sparse.land_rows(
                K, V, self.mask, np.int32(layer), pages[s].astype(np.int32), heads[s].astype(np.int32),
                slots[s].astype(np.int32), k[s], v[s], np.full(size, LOCAL, np.int8))
            self._set_layer(layer, K, V)

    def _set_layer(self, layer, K, V) -> None:
        kv = self.cache.kv
        self.cache.kv = kv[:layer] + ((K, V),) + kv[layer + 1:]

    # ------------------------------------------------------------ the step's device work
    def write_new(self, layer: int, table, positions, k, v) -> None:
        """The step's new K, V (device [B, H_kv, D]) at positions i32[B]; their mask flips to 1."""
        K, V = self.cache.kv[layer]
        K, V, self.mask = sparse.write_new_token(K, V, self.mask, np.int32(layer), table, positions, k, v)
        self._set_layer(layer, K, V)

    def stats(self) -> dict[str, int]:
        """The cache's page counters plus the host->device KV bytes by cause (totals)."""
        return {**self.cache.stats(), **{f"kv_h2d_{c}_bytes": n for c, n in self.h2d_bytes.items()}}
