"""The jitted decode programs that the sm_90a compile check and the GPU check build, in one place.

    dense_decode_program(cfg)        -> (fn, avals): one dense decode step, every layer
                                        (models.transformer.decode_step_compute + write_decode_kv)
    sparse_decode_layer_program(cfg) -> (fn, avals): one SmartGen decode layer on a device cache:
                                        q/k/v -> top-k selection (InfiniGen partial scores) ->
                                        split/reorder by the remote/local mask -> gather -> sparse
                                        attention -> output projection + MLP
    worker_layer_programs(cfg)       -> {name: (fn, avals, donated)}: the SmartGen decode worker's
                                        own per-layer programs on the paged cache (`fused`,
                                        `landed`, `attend_landed` of jkv/disagg/decode_program.py)

All take abstract shapes (jax.ShapeDtypeStruct) so they can be lowered for a GPU that is not
there; `small_config()` is a random-weight model with SmolLM2-135M's layer geometry (hidden 576,
9 query / 3 KV heads, head dim 64, FFN 1536) but 4 layers and a 4,096-token vocabulary, small
enough to travel to a GPU machine (weights ~40 MB in bf16) and to compile in seconds.

The sparse layers read the ops through `pallas_kernels.dispatch`, so the backend active when they
are traced (Mosaic / Triton / XLA) is what they compile. `sparse_decode_layer_program` attends over
the selected prefix of the cache only (the step's own new k/v is written separately, as in
jkv.selection.sparse_decode); the worker's programs write it into its page themselves.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jkv.disagg import decode_pages, decode_program
from jkv.kvcache import sparse
from jkv.selection import get_selector
from models import paged, transformer as tfm
from models.config import ModelConfig
from models.model import tiny_config
from pallas_kernels import dispatch


def small_config(**overrides: Any) -> ModelConfig:
    """SmolLM2-135M's layer geometry, 4 layers, 4,096-token vocab, bf16 (see module docstring)."""
    base = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_layers=4,
                num_heads=9, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    base.update(overrides)
    return tiny_config("llama", **base)


def param_avals(cfg: ModelConfig) -> Any:
    """Abstract parameter tree of `cfg` (no weights are materialised)."""
    return jax.eval_shape(lambda: tfm.init_params(cfg, 0))


def dense_decode_program(cfg: ModelConfig, batch: int = 8, n_max: int = 4096
                         ) -> tuple[Callable, tuple]:
    """One dense decode step: (params, cache, tokens i32[B], positions i32[B]) ->
    (logits f32[B, V], cache with the step's k/v written at positions). cache: per layer (K, V),
    each [B, H_kv, n_max, D]; donated, as Model.decode_step does."""
    dtype = jnp.dtype(cfg.dtype)
    kv = jax.ShapeDtypeStruct((batch, cfg.num_kv_heads, n_max, cfg.head_dim), dtype)
    cache = tuple((kv, kv) for _ in range(cfg.num_layers))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def step(params, cache, tokens, positions):
        logits, new_k, new_v = tfm.decode_step_compute(cfg, params, cache, tokens, positions)
        return logits, tfm.write_decode_kv(cache, new_k, new_v, positions)

    return step, (param_avals(cfg), cache, ids, ids)


def paged_decode_program(cfg: ModelConfig, batch: int = 8, num_pages: int = 2049, page_size: int = 16,
                         max_pages: int = 256) -> tuple[Callable, tuple]:
    """One dense decode step on the paged KV cache (models/paged.py, what DenseEngine and the
    serve batcher run): (params, cache, page_table i32[B, max_pages], tokens i32[B], positions
    i32[B]) -> (logits f32[B, V], cache with the step's k/v written into its page slots).
    cache: per layer (K, V), each [num_pages, H_kv, P, D]; donated, as Model.paged_decode_step
    does. Attention goes through dispatch.paged_decode_attention_partials (the Mosaic paged
    kernel under backend mosaic)."""
    dtype = jnp.dtype(cfg.dtype)
    kv = jax.ShapeDtypeStruct((num_pages, cfg.num_kv_heads, page_size, cfg.head_dim), dtype)
    cache = tuple((kv, kv) for _ in range(cfg.num_layers))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    table = jax.ShapeDtypeStruct((batch, max_pages), jnp.int32)

    def step(params, cache, page_table, tokens, positions):
        logits, new_k, new_v = paged.paged_decode_step_compute(cfg, params, cache, page_table, tokens, positions)
        return logits, paged.paged_write(cache, page_table, positions, new_k, new_v)

    return step, (param_avals(cfg), cache, table, ids, ids)


def sparse_decode_layer_program(cfg: ModelConfig, batch: int = 8, n_max: int = 4096,
                                ratio: float = 0.2) -> tuple[Callable, tuple]:
    """One SmartGen decode layer (see module docstring). Arguments:
    (layer_params, x [B, hidden], K, V [B, H_kv, n_max, D], positions i32[B] (cached tokens per
    request), kv_mask i8[B, n_max] (2 remote, 1 local, 0 padding)) -> x [B, hidden].
    k = ceil(ratio * n_max) entries per KV head; InfiniGen partial dim d_p = ceil(0.3 D)."""
    k = math.ceil(ratio * n_max)
    d_p = math.ceil(0.3 * cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    h_kv, head_dim = cfg.num_kv_heads, cfg.head_dim
    rows = batch * h_kv

    def layer(layer_params, x, K, V, positions, kv_mask):
        q, _, _ = tfm.layer_qkv(cfg, layer_params, x, positions)
        group = q.shape[1] // h_kv
        keys = K.reshape(rows, n_max, head_dim)
        values = V.reshape(rows, n_max, head_dim)
        valid_len = jnp.repeat(positions, h_kv)
        q_partial = q.reshape(rows, group, head_dim)[..., :d_p]
        kv_index = dispatch.topk_select_fused(q_partial, keys[..., :d_p], valid_len, k)
        reordered, remote, local = dispatch.split_reorder(kv_index, kv_mask, h_kv)
        idx = jnp.maximum(reordered, 0)[..., None]  # -1 padding slots are never read
        k_sel = jnp.take_along_axis(keys, idx, axis=1)
        v_sel = jnp.take_along_axis(values, idx, axis=1)
        count = remote + local  # remote entries first, then local: one lane over both

        def attention(q, k_sel, v_sel, count):  # [B, H_kv, k, D] -> the kernels' [B*H_kv, k, D]
            return dispatch.sparse_decode_attention(
                q, k_sel.reshape(rows, k, head_dim), v_sel.reshape(rows, k, head_dim),
                count.reshape(rows),
            )

        return tfm.layer_attend_and_mlp(
            cfg, layer_params, x, q, k_sel.reshape(batch, h_kv, k, head_dim),
            v_sel.reshape(batch, h_kv, k, head_dim), count.reshape(batch, h_kv),
            attention_fn=attention,
        )

    layer_avals = jax.eval_shape(lambda p: p["layers"][0], param_avals(cfg))
    kv = jax.ShapeDtypeStruct((batch, h_kv, n_max, head_dim), dtype)
    return layer, (
        layer_avals,
        jax.ShapeDtypeStruct((batch, cfg.hidden_size), dtype),
        kv,
        kv,
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, n_max), jnp.int8),
    )



def worker_layer_programs(cfg: ModelConfig, batch: int = 8, page_size: int = 16, capacity: int = 4096,
                          selector: str = "oracle") -> dict[str, tuple[Callable, tuple, tuple[int, ...]]]:
    """The decode worker's per-layer programs on the paged cache, for a selected (not dense) layer,
    as `LayerPrograms` jits them (jkv/disagg/decode_program.py): name -> (fn, avals, donated
    argument numbers: the layer's pages and the mask).

        fused          (layer_params, metadata, x [B, hidden], x_query, pos i32[B], now_cached i32[B],
                        K, V [num_pages, H_kv, P, D], mask i8[L, num_pages, H_kv, P], layer i32[],
                        table i32[B, capacity / P], fetchable bool[B])
                        -> (metadata, kv_index i32[B*H_kv, k], selected i32[B*H_kv], remote_count
                        i32[B*H_kv], x, K, V, mask): q, k, v, the new token's page write, select,
                        split, gather, attention, MLP
        landed         fused's arguments + landing (DecodePages.landing's pieces of 1 .. 512 rows)
                        -> (metadata, kv_index, selected, reordered, remote_count, x, q [B, H, D], K,
                        V, mask): the same with the staged rows landed first
        attend_landed  (layer_params, x, q, K, V, mask, layer, table, kv_index, landing) -> (x, K, V,
                        mask): a true miss's second program

    x_query is what the worker passes for `selector` (`decode_program.query_input`: None for
    oracle, the previous layer's input for InfiniGen). metadata: the selector's (f32 [B, H_kv,
    capacity, D] keys for oracle). num_pages = B * capacity / P + 1 (the null page): every request
    can hold `capacity` tokens. k = 20% of capacity (the selector's max_ratio)."""
    chosen = get_selector(selector)
    h_kv, head_dim = cfg.num_kv_heads, cfg.head_dim
    max_pages = capacity // page_size
    num_pages = batch * max_pages + 1
    dtype = jnp.dtype(cfg.dtype)
    layer_i = cfg.num_layers - 1

    def aval(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

    def pin(K, V, mask):
        return K, V, mask

    def fused(params, meta, x, x_query, pos, now_cached, K, V, mask, layer, table, fetchable):
        return decode_program.fused(cfg, chosen, pin, capacity, False, params, chosen.layer_state(layer_i), meta,
                                    x, x_query, pos, now_cached, K, V, mask, layer, table, fetchable)

    def landed(params, meta, x, x_query, pos, now_cached, K, V, mask, layer, table, fetchable, landing):
        return decode_program.landed(cfg, chosen, pin, capacity, False, params, chosen.layer_state(layer_i), meta,
                                     x, x_query, pos, now_cached, K, V, mask, layer, table, fetchable, landing)

    def attend_landed(params, x, q, K, V, mask, layer, table, kv_index, landing):
        return decode_program.attend_landed(cfg, pin, params, x, q, K, V, mask, layer, table, kv_index, landing)

    params = jax.eval_shape(lambda p: p["layers"][layer_i], param_avals(cfg))
    meta = jax.eval_shape(lambda K, n: chosen.prepare(layer_i, K, n),
                          aval((batch, h_kv, capacity, head_dim), jnp.float32), aval((batch,), jnp.int32))
    pages = aval((num_pages, h_kv, page_size, head_dim))
    mask = jax.eval_shape(lambda: sparse.init_mask(cfg.num_layers, num_pages, h_kv, page_size))
    ids, x = aval((batch,), jnp.int32), aval((batch, cfg.hidden_size))
    table = aval((batch, max_pages), jnp.int32)
    x_query = decode_program.query_input(chosen, layer_i, False, x)
    args = (params, meta, x, x_query, ids, ids, pages, pages, mask, aval((), jnp.int32), table,
            aval((batch,), jnp.bool_))
    landing = tuple((*[aval((1 << b,), jnp.int32)] * 3, *[aval((1 << b, head_dim))] * 2)
                    for b in range(decode_pages.LANDING_BITS))
    kv_index = jax.eval_shape(fused, *args)[1]
    q = aval((batch, cfg.num_heads, head_dim))
    return {"fused": (fused, args, (6, 7, 8)),
            "landed": (landed, (*args, landing), (6, 7, 8)),
            "attend_landed": (attend_landed, (params, x, q, pages, pages, mask, args[9], table, kv_index, landing),
                              (3, 4, 5))}
