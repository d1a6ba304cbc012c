"""Flax (linen) decoder for Llama / Qwen2 / Qwen3 and the pure functions the engine composes.

The model is exposed as pieces, not one opaque `__call__` (DESIGN.md "Models"):

- `prefill_layer(cfg, layer_params, x, positions, lengths)` runs one layer over a padded batch
  and returns that layer's K, V — the engine loops over layers so each layer's KV can leave the
  process as soon as the layer finishes.
- `layer_qkv` / `layer_attend_and_mlp` are the two halves of a decode layer, so the engine can
  interpose KV selection and fetching between projection and attention.
- `decode_step` is the fully jitted dense decode step with an on-device cache (the reference for
  every sparse path).

Shapes: B batch, T new tokens, N cached tokens, H query heads, H_kv KV heads, D head dim.
Params: `{"embed_tokens": {"embedding": [V, hidden]}, "layers": [layer params] * L,
"norm": {"scale": [hidden]}, "lm_head": {"kernel": [hidden, V]}}` (lm_head absent when tied).
Layer params are the linen tree of `DecoderLayer` (`q_proj.kernel: [hidden, H*D]`, ...). Layers
are kept as a list (not stacked) so the decode step reads each layer's weights in place.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels import dispatch

from .config import ModelConfig, llama3_inv_freq

# Queries are processed in chunks of this many tokens when a prompt is longer, bounding the
# [T, T] score matrix of prefill attention (prompts that are not a multiple of PREFILL_BLOCK).
PREFILL_QUERY_CHUNK = 512
# Prefill attention of a prompt longer than this (and a multiple of it) runs in blocks of this many
# queries x keys with an online softmax (`blocked_causal_attention`): a block's scores stay in cache.
PREFILL_BLOCK = 128
_MASK_VALUE = -1e30


def compute_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * y.astype(x.dtype)


def apply_rope(x, positions, inv_freq):
    """Rotary embedding (HF "rotate_half" layout). x: [B, T, heads, D], positions: i32[B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        dt = compute_dtype(c)
        dense = lambda n, bias=False: nn.Dense(n, use_bias=bias, dtype=dt, param_dtype=dt)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dt)
        self.q_proj = dense(c.num_heads * c.head_dim, c.qkv_bias)
        self.k_proj = dense(c.num_kv_heads * c.head_dim, c.qkv_bias)
        self.v_proj = dense(c.num_kv_heads * c.head_dim, c.qkv_bias)
        self.o_proj = dense(c.hidden_size, c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.rms_norm_eps, dt)
            self.k_norm = RMSNorm(c.rms_norm_eps, dt)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dt)
        self.gate_proj = dense(c.intermediate_size, c.mlp_bias)
        self.up_proj = dense(c.intermediate_size, c.mlp_bias)
        self.down_proj = dense(c.hidden_size, c.mlp_bias)

    def qkv(self, x, positions):
        """x: [B, T, hidden], positions: i32[B, T] -> q [B,T,H,D], k [B,T,H_kv,D], v [B,T,H_kv,D]."""
        c = self.cfg
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(B, T, c.num_heads, c.head_dim)
        k = self.k_proj(h).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(h).reshape(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        inv_freq = jnp.asarray(llama3_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling), jnp.float32)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def input_norm(self, x):
        return self.input_layernorm(x)

    def attn_out_and_mlp(self, x, attn):
        """x: residual [B, T, hidden]; attn: [B, T, H*D] -> new residual [B, T, hidden]."""
        x = x + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))

    def __call__(self, x, positions):
        """Full layer over a causal batch (used for parameter init and as a plain reference)."""
        q, k, v = self.qkv(x, positions)
        T = x.shape[1]
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
        return self.attn_out_and_mlp(x, attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask))


def attention(q, K, V, mask):
    """Grouped-query attention.

    q: [B, T, H, D]; K, V: [B, H_kv, N, D]; mask: bool broadcastable to [B, H_kv, T, N]
    (True = attend). Returns [B, T, H*D]. Softmax in float32; fully masked rows give zeros.
    """
    B, T, H, D = q.shape
    H_kv = K.shape[1]
    G = H // H_kv
    qg = q.reshape(B, T, H_kv, G, D).transpose(0, 2, 3, 1, 4)  # [B, H_kv, G, T, D]
    s = jnp.einsum("bkgtd,bknd->bkgtn", qg, K, preferred_element_type=jnp.float32) * (D ** -0.5)
    m = mask[:, :, None] if mask.ndim == 4 else mask
    s = jnp.where(m, s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.any(m, axis=-1, keepdims=True), p, 0.0)
    o = jnp.einsum("bkgtn,bknd->bkgtd", p.astype(V.dtype), V, preferred_element_type=jnp.float32)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H * D).astype(q.dtype)


def blocked_causal_attention(q, K, V, positions, lengths, block: int):
    """Causal attention in blocks of `block` queries x `block` keys with an online softmax
    (flash-attention's recurrence), for a prompt prefilled from position 0.

    q: [B, T, H, D]; K, V: [B, H_kv, T, D]; positions: i32[B, T] with positions[b, t] <= t (query
    block i reads key blocks 0..i only); lengths: i32[B]; T a multiple of `block`. Returns
    [B, T, H*D]. Whole-matrix attention on XLA:CPU writes the [T, T] scores and streams them through
    memory for the mask, the softmax and the value product; per block they stay in cache: 2.5x
    less CPU at 1K and 2K tokens (docs/performance.md). Softmax statistics in float32.
    """
    B, T, H, D = q.shape
    H_kv = K.shape[1]
    qg = q.reshape(B, T, H_kv, H // H_kv, D).transpose(0, 2, 3, 1, 4)  # [B, H_kv, G, T, D]
    out = []
    for start in range(0, T, block):
        q_blk = qg[:, :, :, start:start + block]
        q_pos = positions[:, start:start + block]  # [B, C]

        def key_block(j, carry, q_blk=q_blk, q_pos=q_pos):
            m, l, acc = carry  # running max, sum of exp [B, H_kv, G, C]; acc [B, H_kv, G, C, D]
            k_blk = jax.lax.dynamic_slice_in_dim(K, j * block, block, axis=2)
            v_blk = jax.lax.dynamic_slice_in_dim(V, j * block, block, axis=2)
            s = jnp.einsum("bkgtd,bknd->bkgtn", q_blk, k_blk, preferred_element_type=jnp.float32) * (D ** -0.5)
            key_pos = j * block + jnp.arange(block)
            ok = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lengths[:, None, None])
            s = jnp.where(ok[:, None, None], s, _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            scale = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgtn,bknd->bkgtd", p.astype(V.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv

        stats = q_blk.shape[:-1]
        init = (jnp.full(stats, _MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
                jnp.zeros(q_blk.shape, jnp.float32))
        # Key 0 is valid for every query (lengths >= 1), so l > 0 after block 0.
        _, l, acc = jax.lax.fori_loop(0, start // block + 1, key_block, init)
        out.append(acc / l[..., None])
    o = jnp.concatenate(out, axis=3)  # [B, H_kv, G, T, D]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H * D).astype(q.dtype)


def prefill_attention(q, K, V, positions, lengths, native: bool = False):
    """Causal attention over a right-padded batch of prompts prefilled from position 0: blocked
    (`blocked_causal_attention`) when T is a multiple of PREFILL_BLOCK above it, else whole or in
    query chunks of PREFILL_QUERY_CHUNK. native: where the program is lowered for CPU, the native
    kernel instead (`dispatch.causal_prefill_attention`; ~2x faster at 2K tokens, equal to ~1e-6).

    q: [B, T, H, D]; K, V: [B, H_kv, T, D]; positions: i32[B, T] (positions[b, t] <= t); lengths: i32[B].
    """
    if native:
        return dispatch.causal_prefill_attention(q, K, V, positions, lengths, reference=prefill_attention)
    B, T, H, D = q.shape
    if T > PREFILL_BLOCK and T % PREFILL_BLOCK == 0:
        return blocked_causal_attention(q, K, V, positions, lengths, PREFILL_BLOCK)
    key_pos = jnp.arange(T)
    key_ok = key_pos[None, :] < lengths[:, None]  # [B, T]

    def chunk_attention(q_c, pos_c):  # q_c: [B, C, H, D], pos_c: [B, C]
        mask = (key_pos[None, None, :] <= pos_c[:, :, None]) & key_ok[:, None, :]  # [B, C, T]
        return attention(q_c, K, V, mask[:, None])

    if T <= PREFILL_QUERY_CHUNK or T % PREFILL_QUERY_CHUNK:
        return chunk_attention(q, positions)
    n = T // PREFILL_QUERY_CHUNK
    q_chunks = q.reshape(B, n, PREFILL_QUERY_CHUNK, H, D).swapaxes(0, 1)
    p_chunks = positions.reshape(B, n, PREFILL_QUERY_CHUNK).swapaxes(0, 1)
    out = jax.lax.map(lambda a: chunk_attention(*a), (q_chunks, p_chunks))  # [n, B, C, H*D]
    return out.swapaxes(0, 1).reshape(B, T, H * D)


def prefill_layer(cfg: ModelConfig, layer_params, x, positions, lengths, native_attention: bool = False):
    """One layer of batched prefill. x: [B, T, hidden] -> (x, K [B,H_kv,T,D], V [B,H_kv,T,D]).
    native_attention: `prefill_attention(native=True)` (a model whose arrays are not sharded)."""
    layer = DecoderLayer(cfg)
    q, k, v = layer.apply({"params": layer_params}, x, positions, method=DecoderLayer.qkv)
    K = k.transpose(0, 2, 1, 3)
    V = v.transpose(0, 2, 1, 3)
    attn = prefill_attention(q, K, V, positions, lengths, native=native_attention)
    x = layer.apply({"params": layer_params}, x, attn, method=DecoderLayer.attn_out_and_mlp)
    return x, K, V


def embed(params, tokens):
    """tokens: i32[...] -> [..., hidden]."""
    return jnp.take(params["embed_tokens"]["embedding"], tokens, axis=0)


def final_logits(cfg: ModelConfig, params, x):
    """x: [..., hidden] -> float32 logits [..., V]."""
    h = RMSNorm(cfg.rms_norm_eps, compute_dtype(cfg)).apply({"params": params["norm"]}, x)
    w = params["embed_tokens"]["embedding"].T if cfg.tie_word_embeddings else params["lm_head"]["kernel"]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def layer_qkv(cfg: ModelConfig, layer_params, x, positions):
    """Decode projection. x: [B, hidden], positions: i32[B] -> q [B,H,D], k [B,H_kv,D], v [B,H_kv,D]."""
    q, k, v = DecoderLayer(cfg).apply(
        {"params": layer_params}, x[:, None], positions[:, None], method=DecoderLayer.qkv
    )
    return q[:, 0], k[:, 0], v[:, 0]


def layer_input_norm(cfg: ModelConfig, layer_params, x):
    """The normalized attention input of a layer. x: [B, hidden] -> [B, hidden]."""
    return DecoderLayer(cfg).apply({"params": layer_params}, x, method=DecoderLayer.input_norm)


def dense_attention_valid(q, K_sel, V_sel, valid_count):
    """Decode attention over the first valid_count slots of each (request, KV head) row.

    q: [B, H, D]; K_sel, V_sel: [B, H_kv, k, D]; valid_count: i32[B, H_kv] -> [B, H, D].
    """
    mask = jnp.arange(K_sel.shape[2])[None, None, :] < valid_count[:, :, None]  # [B, H_kv, k]
    out = attention(q[:, None], K_sel, V_sel, mask[:, :, None, :])
    return out.reshape(q.shape)


def layer_attend_and_mlp(cfg: ModelConfig, layer_params, x, q, K_sel, V_sel, valid_count,
                         attention_fn: Callable | None = None):
    """Second half of a decode layer.

    x: [B, hidden] residual; q: [B, H, D]; K_sel, V_sel: [B, H_kv, k, D]; valid_count: i32[B, H_kv].
    `attention_fn(q, K_sel, V_sel, valid_count) -> [B, H, D]` defaults to the dense jnp reference;
    the engine passes the dispatched sparse-attention kernel.
    """
    fn = attention_fn or dense_attention_valid
    attn = fn(q, K_sel, V_sel, valid_count).reshape(q.shape[0], 1, -1).astype(x.dtype)
    out = DecoderLayer(cfg).apply({"params": layer_params}, x[:, None], attn, method=DecoderLayer.attn_out_and_mlp)
    return out[:, 0]


def decode_attention(q, K, V, k_new, v_new, positions):
    """Decode attention over cache entries < positions[b] plus the new token itself.

    q: [B, H, D]; K, V: [B, H_kv, N, D] (the cache *before* this step's write); k_new, v_new:
    [B, H_kv, D]; positions: i32[B] -> [B, H, D]. The new token is merged with one shared softmax
    (flash-style), so the program never reads the cache it updates: XLA CPU copies a donated
    buffer that is both read and updated in place in one program (~120 full cache copies per step).
    """
    B, H, D = q.shape
    H_kv = K.shape[1]
    qg = q.reshape(B, H_kv, H // H_kv, D)
    scale = D ** -0.5
    s_old = jnp.einsum("bkgd,bknd->bkgn", qg, K, preferred_element_type=jnp.float32) * scale
    old_ok = (jnp.arange(K.shape[2])[None, :] < positions[:, None])[:, None, None, :]
    s_old = jnp.where(old_ok, s_old, _MASK_VALUE)
    s_new = jnp.einsum("bkgd,bkd->bkg", qg, k_new, preferred_element_type=jnp.float32)[..., None] * scale
    m = jnp.maximum(s_old.max(-1, keepdims=True), s_new)
    p_old = jnp.where(old_ok, jnp.exp(s_old - m), 0.0)
    p_new = jnp.exp(s_new - m)
    o = jnp.einsum("bkgn,bknd->bkgd", p_old.astype(V.dtype), V, preferred_element_type=jnp.float32)
    o = (o + p_new * v_new[:, :, None, :].astype(jnp.float32)) / (p_old.sum(-1, keepdims=True) + p_new)
    return o.reshape(B, H, D).astype(q.dtype)


def decode_step_compute(cfg: ModelConfig, params, cache, tokens, positions):
    """The read-only half of a dense decode step.

    cache: tuple over layers of (K, V), each [B, H_kv, N_max, D]; tokens, positions: i32[B].
    Returns (logits f32[B, V], new_k [L, B, H_kv, D], new_v [L, B, H_kv, D]); the new entries go
    into the cache with `write_decode_kv`.
    """
    x = embed(params, tokens)
    layer = DecoderLayer(cfg)
    new_k, new_v = [], []
    for layer_params, (K, V) in zip(params["layers"], cache):
        q, k, v = layer_qkv(cfg, layer_params, x, positions)
        attn = decode_attention(q, K, V, k, v, positions).reshape(x.shape[0], 1, -1)
        x = layer.apply({"params": layer_params}, x[:, None], attn, method=DecoderLayer.attn_out_and_mlp)[:, 0]
        new_k.append(k)
        new_v.append(v)
    return final_logits(cfg, params, x), jnp.stack(new_k), jnp.stack(new_v)


def write_decode_kv(cache, new_k, new_v, positions):
    """Write each layer's new k/v ([L, B, H_kv, D]) at positions[b]; in place when the cache is donated."""
    def put(c, new):  # c: [B, H_kv, N, D], new: [B, H_kv, D]
        for b in range(c.shape[0]):
            c = jax.lax.dynamic_update_slice(c, new[b][None, :, None, :].astype(c.dtype), (b, 0, positions[b], 0))
        return c

    return tuple((put(K, new_k[l]), put(V, new_v[l])) for l, (K, V) in enumerate(cache))


def decode_step(cfg: ModelConfig, params, cache, tokens, positions):
    """Fully jitted dense decode step (compute, then cache write).

    cache: tuple over layers of (K, V), each [B, H_kv, N_max, D]; tokens, positions: i32[B].
    Returns (logits f32[B, V], new cache). Entries at index < positions[b] plus the new token are
    attended; the new token's k/v land at index positions[b].
    """
    logits, new_k, new_v = decode_step_compute(cfg, params, cache, tokens, positions)
    return logits, write_decode_kv(cache, new_k, new_v, positions)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random parameters (for tests and tiny models); same tree as loaded weights."""
    dt = compute_dtype(cfg)
    key = jax.random.PRNGKey(seed)
    k_embed, k_head, k_norm, *k_layers = jax.random.split(key, 3 + cfg.num_layers)
    x = jnp.zeros((1, 2, cfg.hidden_size), dt)
    pos = jnp.zeros((1, 2), jnp.int32)
    layer = DecoderLayer(cfg)

    def init_layer(k):
        p = layer.init(k, x, pos)["params"]
        leaves, treedef = jax.tree_util.tree_flatten_with_path(p)
        # Non-trivial norm scales make the norms' parameters observable in tests.
        leaves = [
            (1.0 + 0.1 * jax.random.normal(jax.random.fold_in(k, i), a.shape)).astype(dt)
            if "norm" in jax.tree_util.keystr(path) else a
            for i, (path, a) in enumerate(leaves)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    params = {
        "embed_tokens": {"embedding": (0.5 * jax.random.normal(k_embed, (cfg.vocab_size, cfg.hidden_size))).astype(dt)},
        "layers": [init_layer(k) for k in k_layers],
        "norm": {"scale": (1.0 + 0.1 * jax.random.normal(k_norm, (cfg.hidden_size,))).astype(dt)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": (jax.random.normal(k_head, (cfg.hidden_size, cfg.vocab_size)) / cfg.hidden_size ** 0.5).astype(dt)}
    return params


def param_shapes(cfg: ModelConfig):
    """The tree of `init_params(cfg)` as jax.ShapeDtypeStruct leaves (the loaded weights' tree),
    without computing anything. Traced for one layer and repeated: every layer has the same shapes,
    and tracing flax's init of all 30 SmolLM2 layers cost ~1.4 CPU-s on every `load_model`."""
    one = jax.eval_shape(lambda: init_params(cfg.replace(num_layers=1), 0))
    return {**one, "layers": one["layers"] * cfg.num_layers}
