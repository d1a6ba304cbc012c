"""The jitted decode programs that the sm_90a compile check and the GPU check build, in one place.

    dense_decode_program(cfg)        -> (fn, avals): one dense decode step, every layer
                                        (models.transformer.decode_step_compute + write_decode_kv)
    sparse_decode_layer_program(cfg) -> (fn, avals): one SmartGen decode layer on a device cache:
                                        q/k/v -> top-k selection (InfiniGen partial scores) ->
                                        split/reorder by the remote/local mask -> gather -> sparse
                                        attention -> output projection + MLP

Both take abstract shapes (jax.ShapeDtypeStruct) so they can be lowered for a GPU that is not
there; `small_config()` is a random-weight model with SmolLM2-135M's layer geometry (hidden 576,
9 query / 3 KV heads, head dim 64, FFN 1536) but 4 layers and a 4,096-token vocabulary, small
enough to travel to a GPU machine (weights ~40 MB in bf16) and to compile in seconds.

The sparse layers read the ops through `pallas_kernels.dispatch`, so the backend active when they
are traced (Mosaic / Triton / XLA) is what they compile. It attends over the selected prefix of the
cache only (the step's own new k/v is written separately, as in jkv.selection.sparse_decode).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jkv.disagg import decode_program
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



def sparse_paged_decode_layer_program(cfg: ModelConfig, batch: int = 8, page_size: int = 16,
                                      capacity: int = 4096, selector: str = "oracle"
                                      ) -> tuple[Callable, tuple]:
    """The decode worker's fused sparse layer on the paged cache (`decode_program.fused`, what
    `LayerPrograms.fused` jits; a selected layer, not a dense one). Arguments, as the worker
    passes them: (layer_params, metadata (the selector's, f32 [B, H_kv, capacity, D] keys for
    oracle), x [B, hidden], q, query [B, H, D], k_new [B, H_kv, D], pos i32[B], now_cached i32[B],
    K, V [num_pages, H_kv, P, D], mask i8[L, num_pages, H_kv, P], layer i32[], table
    i32[B, capacity / P], fetchable bool[B]) -> (metadata, kv_index i32[B*H_kv, k], remote_count
    i32[B*H_kv], x [B, hidden]). num_pages = B * capacity / P + 1 (the null page): every request
    can hold `capacity` tokens. k = 20% of capacity (the selector's max_ratio)."""
    chosen = get_selector(selector)
    h_kv, head_dim = cfg.num_kv_heads, cfg.head_dim
    max_pages = capacity // page_size
    num_pages = batch * max_pages + 1
    dtype = jnp.dtype(cfg.dtype)

    def aval(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

    def layer(params, meta, x, q, query, k_new, pos, now_cached, K, V, mask, layer_i, table, fetchable):
        return decode_program.fused(cfg, chosen, capacity, False, params, None, meta, x, q, query, k_new, pos,
                                    now_cached, K, V, mask, layer_i, table, fetchable)

    layer_avals = jax.eval_shape(lambda p: p["layers"][0], param_avals(cfg))
    meta = jax.eval_shape(lambda K, n: chosen.prepare(cfg.num_layers - 1, K, n),
                          aval((batch, h_kv, capacity, head_dim), jnp.float32), aval((batch,), jnp.int32))
    pages = aval((num_pages, h_kv, page_size, head_dim))
    mask = jax.eval_shape(lambda: sparse.init_mask(cfg.num_layers, num_pages, h_kv, page_size))
    ids = aval((batch,), jnp.int32)
    heads = aval((batch, cfg.num_heads, head_dim))
    return layer, (layer_avals, meta, aval((batch, cfg.hidden_size)), heads, heads,
                   aval((batch, h_kv, head_dim)), ids, ids, pages, pages, mask, aval((), jnp.int32),
                   aval((batch, max_pages), jnp.int32), aval((batch,), jnp.bool_))
