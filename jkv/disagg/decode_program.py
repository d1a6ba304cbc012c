"""The decode worker's per-layer device programs over the paged cache (SmartGen §4.2 on a device).

One layer of a decode step, each part inside the layer's program:

    project  the layer's q, k, v of its input x (`models.transformer.layer_qkv`, RoPE at the new
             token's position) and the selection's query: q, or for InfiniGen's speculation the
             same projection of the previous layer's input (`query_input`, `project_and_write`)
    write    the new token's K, V into its page slot, its mask to 1 (`sparse.write_new_token`)
    land     rows that wait in host staging (pushed, speculated, prefetched, fetched) come in as the
             program's inputs, rows plus their page slots (`DecodePages.landing`), and are scattered
             into their pages with their mask flipping to 1 (`sparse.land_pieces`)
    select   append the new key to the selector metadata, select (`Selector.select_traced`; every
             cached token in a dense layer), minus the rows a token-dropping profile dropped
             (`sparse.drop_dropped`, only when a request of the batch has one)
                                                                     -> kv_index i32[B*H_kv, k]
    split    the device KV mask of each row (`sparse.mask_rows`) and `dispatch.split_reorder`
                                                                     -> reordered, remote counts
    attend   gather every selected row from the pages (`sparse.gather_selected`), attention over
             them in selection order, then the MLP                   -> x [B, hidden]

Programs (a layer runs one of the first two, plus `attend_landed` after a true miss):

    fused          project → write → select → split → attend; everything local and nothing waiting
                   in staging
    landed         project → write → land → select → split → attend (`attend_now`; without it the
                   program ends after split and returns q for the second program); a request still
                   has rows to fetch, or rows wait in staging
    attend_landed  land → attend: a true miss's second program, after the synchronous fetch
    split          again after a fetch that failed (an owner died or refused a cancelled request)

Only the landed rows cross host→device in a step, each once, as program inputs: the landing
rows come as LANDING_BITS pieces (1, 2, .. 512 rows; a size the count lacks is a device-resident
null piece aimed at the null page), so no padding crosses and one compiled program serves every
count; a bulk past 1,023 rows a layer lands first by `DecodePages.land`'s own programs. With the
layer lookahead (smartgen) the prefetch has put the selected remote rows into staging before the
layer starts, `landed` lands them and its split finds nothing remote: one program per layer. A
selected row still remote after that (the hint missed it, or layer 0, which nothing looks ahead
to) is a true miss: its fetch sits between the split and the
attention, so the first program's attention is discarded and `attend_landed` runs once the rows
arrived. Without lookahead a miss is the rule, so `landed` stops before attention. All programs
are built from the same functions, so a token's output does not depend on which path ran.
Every program donates the layer's pages and the mask and returns them, pinned to the decode
model's mesh (`_pinner`, as decode_pages pins its own programs). `fused` and `landed` also return
the layer's selected-entry count (`valid_rows`), which the worker stacks once a step.

So a layer whose selected rows are all local or staged is one dispatch on the engine thread
(before: `Model.qkv`, `DecodePages.write_new` and this program, each jitted on its own). With the
layer lookahead the next layer's hint stays a separate `Model.qkv` + hint selection on the
lookahead's helper thread, started before this layer's program: computed inside it, the hint
would exist only after the layer's compute and the prefetch would no longer overlap it. The
selection's speculative query is therefore projected twice (by the hint, and again inside the
layer's program from the same input), a [B, hidden] x [hidden, H*D] product; in exchange the
selection never depends on whether a hint ran (the mode invariant: `partial` has no lookahead).

Attention goes through `pallas_kernels.dispatch`: on a GPU backend the sparse decode attention
kernel (Mosaic on Hopper, Triton elsewhere) over the gathered rows; on "xla" (CPU) the model's
`dense_attention_valid`, the attention the host-offloaded reference path runs
(`jkv.selection.sparse_decode`), so the two agree bit for bit. The backend is read at trace time
(see dispatch's docstring): choose it before the first step.

Programs are jitted once per (model config, selector value, KV sharding, dispatch backend) and
shared by every layer (the layer's params, selector state and pages are arguments) and by every
decode worker whose selector has the same class, config and fitted state (`programs_for`,
`Selector.program_key`); `capacity`, `dense`, `drops` and `attend_now` are static, and so is whether
the query is speculative (`x_query` None or an array).

Warm-up (`LayerPrograms.warm_up`): a step compiles nothing. Each program's shapes follow the
batch's shape class (B, N_cap) and the layer kind (dense, selected, selected with a speculative
query), so the worker compiles
every program a step of that class can run when the class first appears (requests handed in,
a membership change), not on first use: smartgen's first step is the first to run `landed`,
`attend_landed` and `split`, and compiling them there went straight into its time to second token.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv.disagg import decode_metadata
from jkv.kvcache import sparse
from jkv.sampling import sample_or_argmax
from jkv.selection.base import all_tokens_index
from models import transformer as tfm
from pallas_kernels import dispatch


def _dispatch_attention(q, K_sel, V_sel, valid):
    """[B, H, D] over K_sel, V_sel [B, H_kv, k, D] with valid i32[B, H_kv], by the dispatched kernel."""
    B, H_kv, k, D = K_sel.shape
    return dispatch.sparse_decode_attention(q, K_sel.reshape(B * H_kv, k, D), V_sel.reshape(B * H_kv, k, D),
                                            valid.reshape(B * H_kv))


def attention_fn():
    """The attention of `attend` under the dispatch backend in force now (None: the model's own)."""
    return None if dispatch.resolved_backend() == "xla" else _dispatch_attention


def valid_rows(kv_index) -> jax.Array:
    """Selected entries per row: i32[B*H_kv] (-1 marks the unused tail)."""
    return (kv_index >= 0).sum(axis=1).astype(jnp.int32)


def select(selector, H: int, capacity: int, dense: bool, state, meta, query, k_new, pos, now_cached,
           mask=None, layer=None, table=None, drops: bool = False):
    """-> (meta, kv_index i32[B*H_kv, k]); a dense layer keeps meta (None) and takes every token.
    drops: some request of the batch has a token-dropping profile: its DROPPED entries of the
    device mask (i8[L, num_pages, H_kv, P], with layer and table) leave the selection."""
    if dense:
        kv_index = all_tokens_index(now_cached, H, capacity)
    else:
        meta = selector.append_traced(state, meta, k_new, pos)
        dropped = sparse.dropped_slots(mask, layer, table, capacity) if drops else None
        kv_index = selector.select_traced(state, query, meta, now_cached, dropped)  # top-k among the kept
    return meta, sparse.drop_dropped(kv_index, mask, layer, table) if drops else kv_index


def split(mask, layer, table, fetchable, kv_index):
    """-> (reordered i32[B*H_kv, k], remote_count i32[B*H_kv]) against the device mask."""
    reordered, remote, _ = dispatch.split_reorder(kv_index, sparse.mask_rows(mask, layer, table, fetchable), 1)
    return reordered, remote


def attend(cfg, params, x, q, K, V, table, kv_index):
    """Gather the selected rows from the pages, attention in selection order, MLP -> x [B, hidden]."""
    K_sel, V_sel, valid = sparse.gather_selected(K, V, table, kv_index)
    return tfm.layer_attend_and_mlp(cfg, params, x, q, K_sel, V_sel, valid, attention_fn=attention_fn())


def query_input(selector, layer: int, dense: bool, x_prev):
    """The hidden state the selection's query of `layer` is projected from, inside the layer's
    program: x_prev (the previous layer's input: InfiniGen's speculation, `Selector.decode_query`)
    or None, the layer's own q. `decode_query` returns its q or `speculate()`, so asking it with
    q=None tells which."""
    return None if dense else selector.decode_query(layer, None, lambda: x_prev)


def project_and_write(cfg, params, x, x_query, pos, K, V, mask, layer, table):
    """The layer's projections of its input x [B, hidden] at positions pos i32[B] and the new
    token's k, v written into the pages (mask 1, `sparse.write_new_token`) -> (q [B, H, D],
    k [B, H_kv, D], query [B, H, D] (q, or the projection of x_query: `query_input`), K, V, mask)."""
    q, k, v = tfm.layer_qkv(cfg, params, x, pos)
    query = q if x_query is None else tfm.layer_qkv(cfg, params, x_query, pos)[0]
    return q, k, query, *sparse.write_new_token(K, V, mask, layer, table, pos, k, v)


def fused(cfg, selector, pin, capacity: int, dense: bool, params, state, meta, x, x_query, pos, now_cached,
          K, V, mask, layer, table, fetchable, drops: bool = False):
    """The whole layer: q, k, v and the new token's write, select, split, attend ->
    (meta, kv_index, selected i32[B*H_kv] (`valid_rows`), remote_count, x, K, V, mask). K, V,
    mask are donated; `pin` keeps their layouts."""
    q, k, query, K, V, mask = project_and_write(cfg, params, x, x_query, pos, K, V, mask, layer, table)
    K, V, mask = pin(K, V, mask)
    meta, kv_index = select(selector, cfg.num_kv_heads, capacity, dense, state, meta, query, k, pos, now_cached,
                            mask, layer, table, drops)
    _, remote = split(mask, layer, table, fetchable, kv_index)
    x = attend(cfg, params, x, q, K, V, table, kv_index)
    return meta, kv_index, valid_rows(kv_index), remote, x, K, V, mask


def landed(cfg, selector, pin, capacity: int, dense: bool, params, state, meta, x, x_query, pos, now_cached,
           K, V, mask, layer, table, fetchable, landing, drops: bool = False, attend_now: bool = True):
    """The whole layer with rows to land: q, k, v and the new token's write, `sparse.land_pieces`
    of `landing` (pieces of rows with their page slots: `DecodePages.landing`) into this layer's
    pages with their mask to 1, then select, split against the updated mask, and with
    `attend_now` gather, attention and the MLP.
    -> (meta, kv_index, selected, reordered i32[B*H_kv, k], remote_count i32[B*H_kv], x, q, K, V,
    mask); without `attend_now` x is the input (attention follows a fetch in `attend_landed`,
    which takes q). K, V, mask are donated; `pin` keeps their layouts (the decode model's mesh)."""
    q, k, query, K, V, mask = project_and_write(cfg, params, x, x_query, pos, K, V, mask, layer, table)
    K, V, mask = pin(*sparse.land_pieces(K, V, mask, layer, landing))
    meta, kv_index = select(selector, cfg.num_kv_heads, capacity, dense, state, meta, query, k, pos, now_cached,
                            mask, layer, table, drops)
    reordered, remote = split(mask, layer, table, fetchable, kv_index)
    if attend_now:
        x = attend(cfg, params, x, q, K, V, table, kv_index)
    return meta, kv_index, valid_rows(kv_index), reordered, remote, x, q, K, V, mask


def attend_landed(cfg, pin, params, x, q, K, V, mask, layer, table, kv_index, landing):
    """A true miss's second program: land the fetched rows (`landing`), then `attend` -> (x, K, V, mask)."""
    K, V, mask = pin(*sparse.land_pieces(K, V, mask, layer, landing))
    return attend(cfg, params, x, q, K, V, table, kv_index), K, V, mask


def _pinner(sharding):
    """(K, V, mask) -> the same with K, V split like `sharding` (by KV head) and the mask replicated
    on its mesh, as decode_pages pins its own programs' outputs; None: one device, as they are."""
    if sharding is None:
        return lambda K, V, mask: (K, V, mask)
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    pin = jax.lax.with_sharding_constraint
    return lambda K, V, mask: (pin(K, sharding), pin(V, sharding), pin(mask, replicated))


class LayerPrograms:
    """The jitted programs of one (model, selector, KV sharding); see the module docstring."""

    def __init__(self, cfg, selector, sharding=None):
        self.cfg, self.selector = cfg, selector
        pin, pages = _pinner(sharding), ("K", "V", "mask")
        self.fused = jax.jit(functools.partial(fused, cfg, selector, pin), donate_argnames=pages,
                             static_argnames=("capacity", "dense", "drops"))
        self.landed = jax.jit(functools.partial(landed, cfg, selector, pin), donate_argnames=pages,
                              static_argnames=("capacity", "dense", "drops", "attend_now"))
        self.attend_landed = jax.jit(functools.partial(attend_landed, cfg, pin), donate_argnames=pages)
        self.split = _split
        self._warm: set = set()  # shape classes warm_up has compiled

    def warm_up(self, model, pages, batch: int, capacity: int, dense_below: int, *, remote: bool = True,
                lookahead: bool = False, hint=None, drops: bool = False, selector=None,
                warmed: set | None = None) -> bool:
        """Compile every program a decode step of `batch` requests at N_cap = `capacity` runs, for
        each layer kind present (dense below `dense_below`, selected from it, with or without a
        speculative query): the model's embed and logits, `fused` and `landed` (each with its
        layer's q, k, v, the new token's page write and the selected-row count inside); with
        `remote` (a member may still fetch) also attend_landed, split and (without `lookahead`)
        `landed` stopping before attention; with `lookahead` the next layer's hint (`Model.qkv` of
        the next layer, then `hint` or the selector's own select). The layer programs are compiled
        ahead of time from shapes; the rest runs once on zeros (reads only: pages and mask are
        not written). Dispatch backend: the one in force now (see the module docstring). `drops`: a
        member has a token-dropping profile (the programs' static `drops` flag, as `_begin_step` sets it).

        These programs are shared by every worker whose selector has the same value (`programs_for`),
        so the layer programs compile once per class here, while the rest is the caller's own: its
        model's embed, qkv and logits and its `selector`'s select (a jit per selector object;
        default: the one these programs were built with) run once per class for the caller's
        `warmed` set (a decode worker's; None: the class counts as warm with the layer programs).
        False when this class was warm for both already."""
        K, V = pages.cache.kv[0]
        key = (batch, capacity, K.shape, K.dtype, pages.mask.shape, remote, lookahead, hint is not None,
               attention_fn() is None, drops)
        programs_cold = key not in self._warm
        caller_cold = programs_cold if warmed is None else key not in warmed
        if not (programs_cold or caller_cold):
            return False
        cfg, selector = self.cfg, self.selector if selector is None else selector
        i32 = np.zeros(batch, np.int32)
        x = model.embed(i32)
        q, k, v = model.qkv(0, x, i32)
        table = jnp.asarray(np.zeros((batch, -(-capacity // pages.page_size)), np.int32))  # host->device copies
        pos = jnp.asarray(i32)  # compile a small program per shape too
        step = dict(model=model, pages=pages, capacity=capacity, x=x, q=q, table=table, pos=pos, drops=drops)
        if programs_cold:
            kinds = {(layer < dense_below, query_input(self.selector, layer, layer < dense_below, x) is None): layer
                     for layer in range(cfg.num_layers)}  # a kind compiles its own programs, shared by its layers
            for (dense, _), layer in sorted(kinds.items()):
                self._warm_kind(layer, dense, remote, lookahead, **step)
            self._warm.add(key)
        if not caller_cold:
            return True
        if dense_below < cfg.num_layers:
            if lookahead:  # the lookahead thread's selection of the next layer
                meta, lengths = decode_metadata.empty(selector, cfg, dense_below, batch, capacity), i32 + 1
                np.asarray(hint(dense_below, q, meta, lengths) if hint is not None
                           else selector.select(dense_below, q, meta, lengths))
        rows = jnp.asarray(np.zeros(batch * cfg.num_kv_heads, np.int32))  # per layer, stacked once a step
        np.asarray(jnp.stack([rows] * cfg.num_layers))
        sample_or_argmax(model.logits(x), np.zeros(batch, np.float32), i32, np.ones(batch, np.float32),
                         np.zeros(batch, np.uint32), i32)  # greedy: a sampled batch compiles its sampler
        if warmed is not None:
            warmed.add(key)
        return True

    def _warm_kind(self, layer: int, dense: bool, remote: bool, lookahead: bool, model, pages, capacity, x, q,
                   table, pos, drops) -> None:
        """`warm_up`'s layer programs for the kind of `layer`, called as the decode worker calls them
        (jkv/disagg/decode_lanes.py)."""
        sel, batch = self.selector, x.shape[0]
        K, V = pages.cache.kv[layer]
        meta = None if dense else decode_metadata.empty(sel, self.cfg, layer, batch, capacity)
        args = dict(capacity=capacity, dense=dense, state=None if dense else sel.layer_state(layer),
                    meta=meta, x_query=query_input(sel, layer, dense, x), pos=pos, now_cached=pos, drops=drops,
                    params=model.layer_params(layer), x=x, K=K, V=V, mask=pages.mask, layer=np.int32(layer),
                    table=table, fetchable=jax.ShapeDtypeStruct((batch,), jnp.bool_))
        fused = self.fused.lower(**args)
        fused.compile()
        kv_index = fused.out_info[1]
        landing = pages.null_landing()
        self.landed.lower(**args, landing=landing, attend_now=True).compile()  # everything local, rows to land
        if remote:  # on-demand fetches: a true miss's second program, a failed fetch's split, and
            # without lookahead (a miss is the rule) the first program stops before attention
            self.attend_landed.lower(args["params"], x, q, K, V, pages.mask, np.int32(layer), table, kv_index,
                                     landing).compile()
            self.split.lower(pages.mask, np.int32(layer), table, args["fetchable"], kv_index).compile()
            if not lookahead:
                self.landed.lower(**args, landing=landing, attend_now=False).compile()

_split = jax.jit(split)


class _ByValue:
    """A selector as a cache key: equal to another selector's when their `Selector.program_key`
    values are (same class, config and fitted state), whichever object each is; an object that is
    not a `Selector` is equal only to itself."""

    __slots__ = ("selector", "key")

    def __init__(self, selector):
        self.selector = selector
        key = getattr(selector, "program_key", None)
        self.key = key() if callable(key) else ("object", selector)

    def __eq__(self, other):
        return isinstance(other, _ByValue) and self.key == other.key

    def __hash__(self):
        return hash(self.key)


def programs_for(cfg, selector, sharding=None) -> LayerPrograms:
    """The programs of (cfg, selector) over pages split like `sharding` (Model.kv_sharding; None: one
    device), cached: a benchmark makes a worker per run and must not recompile each run's first step.

    Cached by the selector's value (`Selector.program_key`), not its identity: every
    `LLM(disaggregation=...)`, `jkv serve` start or test builds its selector anew, and the programs
    trace nothing of it but its class, config and the shapes of its per-layer state (an argument).
    The dispatch backend is read at trace time, so it is part of the key too."""
    return _programs_for(cfg, _ByValue(selector), sharding, dispatch.resolved_backend())


@functools.lru_cache(maxsize=8)
def _programs_for(cfg, selector: _ByValue, sharding, backend: str) -> LayerPrograms:
    del backend  # a key only: traced under that backend
    return LayerPrograms(cfg, selector.selector, sharding)

