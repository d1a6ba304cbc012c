"""The decode worker's per-layer device programs over the paged cache (SmartGen §4.2 on a device).

One layer of a decode step, after `Model.qkv` and the new token's K, V write (`DecodePages.write_new`):

    select   append the new key to the selector metadata, select (`Selector.select_traced`; every
             cached token in a dense layer), minus the rows a token-dropping profile dropped
             (`sparse.drop_dropped`, only when a request of the batch has one)
                                                                     -> kv_index i32[B*H_kv, k]
    split    the device KV mask of each row (`sparse.mask_rows`) and `dispatch.split_reorder`
                                                                     -> reordered, remote counts
    attend   gather every selected row from the pages (`sparse.gather_selected`), attention over
             them in selection order, then the MLP                   -> x [B, hidden]

`fused` is the whole layer in one jitted program: select → split → gather → attention → MLP.
The worker runs it when no request of the batch has rows left to fetch (everything local: `full`,
and `smartgen` once speculation has moved the rest); nothing crosses host<->device in it. While a
request still has remote rows the on-demand fetch (an RPC) must sit between the split and the
attention, so the same pieces run as three programs: `select`, `split` (again after a fetch that
failed), then `attend` once the fetched rows have landed in their pages. All four are built
from the same functions, so a token's output does not depend on which path ran.

Attention goes through `pallas_kernels.dispatch`: on a GPU backend the sparse decode attention
kernel (Mosaic on Hopper, Triton elsewhere) over the gathered rows; on "xla" (CPU) the model's
`dense_attention_valid`, the attention the host-offloaded reference path runs
(`jkv.selection.sparse_decode`), so the two agree bit for bit. The backend is read at trace time
(see dispatch's docstring): choose it before the first step.

Programs are jitted once per (model, selector) and shared by every layer (the layer's params,
selector state and pages are arguments); `capacity` and `dense` are static.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jkv.kvcache import sparse
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


def fused(cfg, selector, capacity: int, dense: bool, params, state, meta, x, q, query, k_new, pos, now_cached,
          K, V, mask, layer, table, fetchable, drops: bool = False):
    """The whole layer: (meta, kv_index, remote_count, x)."""
    meta, kv_index = select(selector, cfg.num_kv_heads, capacity, dense, state, meta, query, k_new, pos, now_cached,
                            mask, layer, table, drops)
    _, remote = split(mask, layer, table, fetchable, kv_index)
    return meta, kv_index, remote, attend(cfg, params, x, q, K, V, table, kv_index)


class LayerPrograms:
    """The jitted programs of one (model, selector) pair; see the module docstring."""

    def __init__(self, cfg, selector):
        self.cfg, self.selector = cfg, selector
        self.select = jax.jit(functools.partial(select, selector, cfg.num_kv_heads),
                              static_argnames=("capacity", "dense", "drops"))
        self.split = _split
        self.attend = jax.jit(functools.partial(attend, cfg))
        self.fused = jax.jit(functools.partial(fused, cfg, selector), static_argnames=("capacity", "dense", "drops"))


_split = jax.jit(split)


@functools.lru_cache(maxsize=8)
def programs_for(cfg, selector) -> LayerPrograms:
    """The programs of (cfg, selector), cached: a benchmark makes a worker per run and must not
    recompile each run's first step."""
    return LayerPrograms(cfg, selector)


def valid_rows(kv_index) -> jax.Array:
    """Selected entries per row: i32[B*H_kv] (-1 marks the unused tail)."""
    return (kv_index >= 0).sum(axis=1).astype(jnp.int32)
