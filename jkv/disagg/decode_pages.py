"""The decode worker's device KV: the paged cache, the SmartGen KV mask next to it, and landing.

    pages = DecodePages(model.cfg, PageConfig(page_size=16, num_pages=1025))
    pages.plan(rid, prompt_len, tokens)        # pages for the request; mask REMOTE over the prompt
    hit = pages.plan(rid, n, tokens, prompt)   # with prefix caching: cached leading pages shared
    table = pages.table(rids, capacity)        # i32[B, ceil(N_cap / P)] (host), idle rows null
    pages.land(lives, layer, table, clock)     # staging -> device pages, then mask 1 (per layer)
    landing = pages.landing(lives, layer, table, clock)  # the same rows, for the layer's program
    pages.free(rid)

Two tiers (DESIGN.md "Where KV lives"): L1 is `cache` (per layer K, V `[num_pages, H_kv, P, D]`
in the model's dtype, on the default JAX device) with `mask` (i8[L, num_pages, H_kv, P], see
jkv/kvcache/sparse.py); L2 is each request's host staging buffer (`RequestKV`: the transport's
registered regions "kv/<rid>", "mask/<rid>"), where every byte from the network lands: block
writes and their mask bytes (proactive and speculative pushes), decoded "ckv" frames, on-demand
and lookahead replies (`fetch.keep_rows`: rows plus `fetched`), recomputed prompts.

Landing (engine thread, once per layer before its split and once after its on-demand replies): read
the staging mask first, then copy the rows it shows LOCAL (or `fetched`) and not yet on the device
into the pages in one batch per layer, in the same program that flips their device mask entries to
1: `landing` hands them to the layer's own decode program as its inputs (pieces of 1, 2, .., 512
rows; jkv/disagg/decode_program.py `landed`), `land` runs programs of its own (a bulk past 1,023
rows, a failed fetch's retry, prefix caching). A transport writes a row before its mask byte, so a
row read after its mask byte is complete; a device 1 is written with its row, so a 1 is always safe
to read.
GPUDirect RDMA: a NIC that writes straight into device memory does the same protocol without this
step: its WRITE puts the rows into the pages (the page table of the request is the region) and its
ordered second WRITE flips the device mask byte; `land` then finds nothing to copy.

Only these copies move KV host->device, and `land` / `landing` count them by cause into the step
clock and `h2d_bytes` (totals): "arrived" (block writes and "ckv" frames), "fetched" (on-demand and
lookahead replies), "other" (a prompt recomputed here after its owner failed). The step's own
new K, V are computed on the device and written there, inside the layer's program
(jkv/disagg/decode_program.py): no host->device bytes.
Uploads go in power-of-two pieces of at most MAX_PIECE rows, so every byte counted is a row (no
padding crosses) and a fixed set of compiled programs (one per piece size, 1 .. MAX_PIECE) serves
every batch size. `warm_up` compiles them all before the first step: which sizes a step needs
depends on what arrived and what was fetched, so compiling on first use put compiles inside
smartgen's first decode step (its TTST).

Tensor parallelism (`sharding=Model.kv_sharding`): the pages are split by KV head over the decode
model's mesh and the mask is replicated on it. Rows arrive in blocks of KV-head slices of the
prefill's layout (global head order, jkv/disagg/head_slices.py: the prefill side may run any degree;
a slice may span two of these shards or be part of one), a run's staging mask byte after its last
slice, and `land`'s one program scatters each row into the shard that holds its head; `land` (and
the layer programs, decode_program.py) pin their outputs to these layouts, so the cache never
drifts to another (a drift would recompile the step programs and move the cache).

Threads: everything runs on the decode worker's engine thread (plan, land, write, gather, free);
the host shadows it reads (`LiveRequest.on_device`, `landed`) belong to that thread too.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kvbuffers.geometry import DROPPED, LOCAL, PAD, REMOTE
from jkv.kvcache import H2D_CAUSES as CAUSES, NULL_PAGE, PageConfig, PagedKVCache
from jkv.kvcache import sparse

# An auto-sized pool (no PageConfig given) starts with room for this many tokens and doubles when a
# request handed in does not fit (`DecodePages.plan`); a PageConfig (--num-pages) fixes the size.
# Each growth recompiles the running set's programs at hand-in, serially with the first token: a
# 1,024-token start grew twice for `jkv demo`'s 4 x 536 tokens and raised its TTFT from ~3 s to ~26 s
# (2 cores), so the start stays at the old fixed size until growth happens once per batch and its
# compiles overlap the prefill.
FIRST_DECODE_TOKENS = 16384


log = logging.getLogger(__name__)

MAX_PIECE = 4096  # rows per upload piece: a 4 x 512-token batch of 3 KV heads lands in 2 pieces
# A decode layer program lands up to 2**LANDING_BITS - 1 rows itself, as pieces of 1, 2, .., 512 rows
# (`landing`): an unused piece is the null one, whose scatter costs ~1K rows of device work a layer.
LANDING_BITS = 10


def upload_pieces(n: int) -> list[int]:
    """n as MAX_PIECE pieces, then the rest as a sum of distinct powers of two, largest first
    (upload piece sizes: each one of the log2(MAX_PIECE) + 1 sizes `warm_up` compiles)."""
    rest = n % MAX_PIECE
    return [MAX_PIECE] * (n // MAX_PIECE) + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


@jax.jit
def _append_pad_pages(mask, pad):
    """mask i8[L, num_pages, H_kv, P] with pad i8[L, extra, H_kv, P] (PAD) appended, on mask's devices."""
    return jnp.concatenate([mask, pad.astype(mask.dtype)], axis=1)


_warm_landing: set = set()  # (K, V, mask) avals whose landing programs are compiled (this process)


@functools.lru_cache(maxsize=4)
def _pinned_programs(sharding):
    """(mask sharding, set_page_masks, land_rows) with their outputs pinned: the
    pages to `sharding` (split by KV head), the mask replicated on its mesh. Cached per sharding, so
    a fresh decode worker on the same mesh reuses the compiled programs."""
    mask_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    pages_out = (sharding, sharding, mask_sharding)
    return (mask_sharding, jax.jit(sparse._set_page_masks, donate_argnums=(0,), out_shardings=mask_sharding),
            jax.jit(sparse._land_rows, donate_argnums=(0, 1, 2), out_shardings=pages_out))


class DecodePages:
    def __init__(self, model_cfg, page_cfg: PageConfig | None = None, dtype=None, sharding=None,
                 prefix_namespace=None):
        """sharding: the decode model's `kv_sharding` (None: one device, no tensor parallelism).
        prefix_namespace: keeps finished requests' complete prompt pages in a prefix cache
        (jkv/disagg/prefix_split.py; `jkv.kvcache.prefix_namespace(model, dtype, page_size)`)."""
        self.growable = page_cfg is None  # sized to need: see FIRST_DECODE_TOKENS
        if page_cfg is None:
            page_cfg = PageConfig.for_tokens(FIRST_DECODE_TOKENS)
        self.cache = PagedKVCache(model_cfg, page_cfg, dtype, sharding=sharding, prefix_namespace=prefix_namespace)
        self.num_kv_heads, self.head_dim = model_cfg.num_kv_heads, model_cfg.head_dim
        self.mask = sparse.init_mask(model_cfg.num_layers, page_cfg.num_pages, model_cfg.num_kv_heads,
                                     page_cfg.page_size)
        self._set_masks, self._land_rows = sparse.set_page_masks, sparse.land_rows
        self._mask_sharding = None
        if sharding is not None:
            self._mask_sharding, self._set_masks, self._land_rows = _pinned_programs(sharding)
            self.mask = jax.device_put(self.mask, self._mask_sharding)
        self.row_bytes = 2 * model_cfg.head_dim * self.cache.dtype.itemsize  # one K row and one V row
        self.h2d_bytes = self.cache.h2d_bytes  # the cache's counters (its stats and /metrics read them)
        self._null_pieces = None  # null_landing's, made on first use

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    # ------------------------------------------------------------ per request
    def plan(self, rid, prompt_len: int, tokens: int, prompt=None) -> int:
        """Reserve pages for `tokens` tokens (prompt + generated) and set their mask: REMOTE over
        the prompt, PAD after. With prefix caching and the prompt (i32[N]) given, the prompt's cached
        leading full pages are shared instead (their mask is 1 already: only complete pages are
        cached). Returns the prompt tokens already on the device (a page multiple, < prompt_len).
        Raises OutOfPages (nothing reserved) when the pool is short."""
        P = self.page_size
        if self.growable:
            self._fit(self.cache.page_cfg.pages_for(tokens))
        if prompt is not None and self.cache.prefix_caching:
            hit = self.cache.reserve_prefix(rid, prompt, tokens)
            new = self.cache.pages_of(rid)[hit // P:]
        else:
            hit, new = 0, self.cache.reserve(rid, tokens)
        first = len(self.cache.pages_of(rid)) - len(new)
        token = (first + np.arange(len(new)))[:, None] * P + np.arange(P)[None, :]
        values = np.where(token < prompt_len, REMOTE, PAD).astype(np.int8)
        width = 1 << max(len(new) - 1, 0).bit_length()  # a few compiled shapes
        pages = np.full(width, NULL_PAGE, np.int32)
        pages[:len(new)] = new
        padded = np.full((width, P), PAD, np.int8)
        padded[:len(new)] = values
        self.mask = self._set_masks(self.mask, jnp.asarray(pages), jnp.asarray(padded))
        return hit

    @property
    def num_pages(self) -> int:
        return self.cache.page_cfg.num_pages

    def _fit(self, pages: int) -> None:
        """Auto-sized pool: double it until `pages` more pages are free (a new request handed in).
        It never shrinks, so live requests keep their pages (ids, bytes, mask); programs over the
        pool compile for the new size class at hand-in (the decode worker's `_plan`)."""
        size = self.num_pages
        while self.cache.pages_free + size - self.num_pages < pages:
            size *= 2
        if size == self.num_pages:
            return
        extra = size - self.num_pages
        log.info("decode KV pool: %d -> %d pages of %d tokens (a request needs %d, %d free)", self.num_pages, size,
                 self.page_size, pages, self.cache.pages_free)
        self.cache.grow(size)
        L, _, H, P = self.mask.shape
        self.mask = _append_pad_pages(self.mask, jnp.full((L, extra, H, P), PAD, jnp.int8))
        if self._mask_sharding is not None:  # replicated on the model's mesh under TP, as before. Not on
            # one device: a committed mask would commit the pages it meets, and the programs compiled at
            # hand-in for uncommitted pages would compile again inside the next steps
            self.mask = jax.device_put(self.mask, self._mask_sharding)

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
        into the pages, then flip their device mask to 1 (land programs of their own). Returns the
        bytes copied."""
        rows = self._collect(lives, layer, table, clock)
        if rows is None:
            return 0
        self._upload(layer, *rows)
        return len(rows[0]) * self.row_bytes

    def landing(self, lives, layer: int, table: np.ndarray, clock):
        """`land` for a decode layer program that lands the rows itself (`sparse.land_pieces`):
        the same rows, counted the same, returned as the program's LANDING_BITS pieces (piece b:
        2**b rows or, where the count has no such bit, the device-resident null piece, so no
        padding crosses). Rows past the pieces' 2**LANDING_BITS - 1 (a bulk arrival) land here
        first, by `land`'s programs. None: nothing to land."""
        rows = self._collect(lives, layer, table, clock)
        if rows is None:
            return None
        inside = len(rows[0]) % (1 << LANDING_BITS)
        if len(rows[0]) > inside:
            self._upload(layer, *(r[inside:] for r in rows))
        pieces, at = [], 0
        for b in range(LANDING_BITS):
            if inside >> b & 1:
                s = slice(at, at + (1 << b))
                at += 1 << b
                pieces.append(tuple(np.asarray(r[s], np.int32) for r in rows[:3])
                              + tuple(np.asarray(r[s], self.cache.dtype) for r in rows[3:]))
            else:
                pieces.append(self.null_landing()[b])
        return tuple(pieces)

    def null_landing(self) -> tuple:
        """The landing pieces of nothing: per size 2**b, rows aimed at the null page (PAD), made on
        the device once (no host bytes)."""
        if self._null_pieces is None:
            self._null_pieces = tuple(
                (*(jnp.zeros(1 << b, jnp.int32) for _ in range(3)),
                 *(jnp.zeros((1 << b, self.head_dim), self.cache.dtype) for _ in range(2)))
                for b in range(LANDING_BITS))
        return self._null_pieces

    def replace(self, layer: int, K, V, mask) -> None:
        """A decode layer program's updated pages and mask (it donated the old ones)."""
        self._set_layer(layer, K, V)
        self.mask = mask

    def _collect(self, lives, layer: int, table: np.ndarray, clock):
        """The rows `land` copies: (pages, heads, slots, k [R, D], v [R, D]) or None; marks them
        on the device and counts their bytes by cause."""
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
            return None
        pages, heads, slots, k, v, cause = (np.concatenate(x) for x in zip(*parts))
        for c, name in enumerate(CAUSES):
            nbytes = int((cause == c).sum()) * self.row_bytes
            self.h2d_bytes[name] += nbytes
            clock.count(f"h2d_{name}_bytes_n", nbytes)
        return pages, heads, slots, k, v

    def _upload(self, layer, pages, heads, slots, k, v) -> None:
        dtype = self.cache.dtype
        k, v = np.asarray(k, dtype), np.asarray(v, dtype)
        at = 0
        for size in upload_pieces(len(pages)):
            s = slice(at, at + size)
            at += size
            K, V = self.cache.kv[layer]
            K, V, self.mask = self._land_rows(
                K, V, self.mask, np.int32(layer), pages[s].astype(np.int32), heads[s].astype(np.int32),
                slots[s].astype(np.int32), k[s], v[s], np.full(size, LOCAL, np.int8))
            self._set_layer(layer, K, V)

    def warm_up(self) -> int:
        """Compile the landing program for every upload piece size (1, 2, 4 .. MAX_PIECE rows) of
        this cache's shapes, ahead of time (nothing runs, nothing is written). Once per process
        for a shape. Returns the number of programs compiled."""
        K, V = self.cache.kv[0]
        key = (K.shape, K.dtype, self.mask.shape, self._land_rows)  # the TP-pinned program is its own
        if key in _warm_landing:
            return 0
        D, count = self.head_dim, 0
        for b in range(MAX_PIECE.bit_length()):
            rows = [jax.ShapeDtypeStruct((1 << b,), jnp.int32)] * 3
            kv = [jax.ShapeDtypeStruct((1 << b, D), K.dtype)] * 2
            self._land_rows.lower(K, V, self.mask, np.int32(0), *rows, *kv,
                                   jax.ShapeDtypeStruct((1 << b,), jnp.int8)).compile()
            count += 1
        _warm_landing.add(key)
        return count

    def _set_layer(self, layer, K, V) -> None:
        kv = self.cache.kv
        self.cache.kv = kv[:layer] + ((K, V),) + kv[layer + 1:]

    def stats(self) -> dict[str, int]:
        """The cache's page counters and its host->device KV bytes by cause (totals)."""
        return self.cache.stats()
