"""Batched selector metadata of the decode worker's running set (engine thread only).

Each request arrives with its own selector metadata per layer (`LiveRequest.meta`: the leaves
of `selector.prepare` for a batch of 1, shipped by its prefill worker in "meta" notifications,
or rebuilt here for a recomputed request). The decode step needs one pytree per layer with a
leading batch axis B (`selector.append` adds each step's key to it). So at every membership
change (a step boundary where requests join or leave):

    unstack(...)  each staying member's rows of the batch go back to its `meta` (they hold the
                  keys appended since it joined)
    stack(...)    the batch is rebuilt for the new members with N_cap = the largest member's
                  capacity, each member's leaves copied into the top-left corner of its row

Dense layers (below `dense_layer_count`) have no metadata (None). Selectors that ship none
(length-only ones) are rebuilt from zeros and the lengths (`needs_metadata`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv.disagg.selectors import needs_metadata
from jkv.selection.base import dense_layer_count


def stack(selector, cfg, lives, capacity: int) -> list:
    """Per layer: the batched metadata of `lives` (leading axis B) at N_cap = capacity, or None
    for a dense layer. Raises RuntimeError when an active request lacks a layer's metadata."""
    B, H, D = len(lives), cfg.num_kv_heads, cfg.head_dim
    lengths = jnp.asarray([lv.geometry.num_tokens for lv in lives], jnp.int32)
    dense_below = dense_layer_count(selector, cfg.num_layers)
    out = []
    for layer in range(cfg.num_layers):
        if layer < dense_below:
            out.append(None)
        elif not needs_metadata(selector):
            out.append(selector.prepare(layer, jnp.zeros((B, H, capacity, D), jnp.float32), lengths))
        else:
            out.append(_stack_layer(selector, layer, lives, lengths, (B, H, capacity, D)))
    return out


def empty(selector, cfg, layer: int, batch: int, capacity: int):
    """A selected layer's batched metadata for `batch` requests at N_cap = capacity, all zeros:
    the shapes and dtypes `stack` gives that layer (the decode programs' warm-up compiles with it)."""
    H, D = cfg.num_kv_heads, cfg.head_dim
    lengths = jnp.ones(batch, jnp.int32)
    if not needs_metadata(selector):
        return selector.prepare(layer, jnp.zeros((batch, H, capacity, D), jnp.float32), lengths)
    leaves, treedef = _zero_leaves(selector, layer, lengths, (batch, H, capacity, D))
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves])


def _zero_leaves(selector, layer: int, lengths, shape):
    """(zeroed numpy leaves, treedef) of `selector.prepare(layer, K[shape], lengths)`."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    target = jax.eval_shape(functools.partial(selector.prepare, layer), spec, lengths)
    leaves_t, treedef = jax.tree_util.tree_flatten(target)
    return [np.zeros(t.shape, t.dtype) for t in leaves_t], treedef


def _stack_layer(selector, layer: int, lives, lengths, shape):
    leaves, treedef = _zero_leaves(selector, layer, lengths, shape)
    for b, lv in enumerate(lives):
        if lv.recomputed and layer not in lv.meta:
            K = jnp.asarray(lv.kv.kv[0][layer][None])
            lv.meta[layer] = [np.asarray(x) for x in
                              jax.tree_util.tree_leaves(selector.prepare(layer, K, lengths[b:b + 1]))]
        got = lv.meta.get(layer)
        if got is None:
            if lv.active:
                raise RuntimeError(f"request {lv.req.request_id}: no selector metadata for layer {layer}")
            continue
        for dst, src in zip(leaves, got):
            region = tuple(slice(0, min(a, s)) for a, s in zip(dst.shape[1:], src.shape[1:]))
            dst[b][region] = src[0][region]
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves])


def unstack(selector, running, batch_meta, keep) -> None:
    """Each member of `running` that stays (its id in `keep`) takes its rows of `batch_meta`
    back into its `meta` (nothing for selectors that ship no metadata)."""
    if batch_meta is None or not needs_metadata(selector) or not any(id(lv) in keep for lv in running):
        return
    # One host copy per layer, sliced on the host: a device slice per member compiled a program
    # for each (batch, shape) inside the step a request left at (tests/smartgen/test_smartgen_compiles.py).
    host = [None if meta is None else [np.asarray(x) for x in jax.tree_util.tree_leaves(meta)] for meta in batch_meta]
    for b, lv in enumerate(running):
        if id(lv) not in keep:
            continue
        for layer, leaves in enumerate(host):
            if leaves is not None:
                lv.meta[layer] = [x[b:b + 1].copy() for x in leaves]  # not a view holding the batch
