"""`Model`: a config, its params and tokenizer, with the jitted pieces the engine composes.

Usage:
    m = load_model("smollm2-135m-instruct")           # or a HF directory / .gguf file
    logits, kv = m.prefill(tokens, lengths)             # kv[l] = (K, V), each [B, H_kv, T, D]
    x = m.embed(tok); q, k, v = m.qkv(l, x, pos); x = m.attend_and_mlp(l, x, q, K_sel, V_sel, valid)

Nothing here knows about KV transfer: the engine (`jkv/`) wires selection and transport between
`qkv` and `attend_and_mlp`. All functions are pure; the decode cache is passed in and returned.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import transformer as tfm
from .config import ModelConfig
from .tokenizer import Tokenizer


class Model:
    def __init__(self, cfg: ModelConfig, params: dict, tokenizer: Tokenizer | None = None, name: str = ""):
        self.cfg = cfg
        self.params = jax.device_put(params)
        self.tokenizer = tokenizer
        self.name = name or cfg.family
        p = functools.partial
        self._prefill_layer = jax.jit(p(tfm.prefill_layer, cfg))
        self._embed = jax.jit(tfm.embed)
        self._logits = jax.jit(p(tfm.final_logits, cfg))
        self._qkv = jax.jit(p(tfm.layer_qkv, cfg))
        self._input_norm = jax.jit(p(tfm.layer_input_norm, cfg))
        self._attend = jax.jit(p(tfm.layer_attend_and_mlp, cfg), static_argnames=("attention_fn",))
        # Two programs per decode step: XLA CPU copies a donated cache that one program both reads and
        # updates in place, so attention reads it in one program and a second writes it in place.
        self._decode_compute = jax.jit(p(tfm.decode_step_compute, cfg))
        self._write_kv = jax.jit(tfm.write_decode_kv, donate_argnums=(0,))

    def __repr__(self):
        c = self.cfg
        return (f"Model({self.name!r}, {c.family}, L={c.num_layers}, H={c.num_heads}, H_kv={c.num_kv_heads}, "
                f"D={c.head_dim}, dtype={c.dtype})")

    # ----------------------------------------------------------------- prefill
    def prefill(self, tokens, lengths, on_layer: Callable | None = None, all_logits: bool = False):
        """Batched prefill of right-padded prompts.

        tokens: i32[B, T]; lengths: i32[B] (1 <= lengths[b] <= T).
        on_layer(l, K, V) is called as soon as layer l's KV exists (K, V: [B, H_kv, T, D]).
        Returns (logits, kv): logits f32[B, V] at each prompt's last token (or f32[B, T, V] with
        all_logits) and kv, a list over layers of (K, V).
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = self._embed(self.params, tokens)
        kv = []
        for l, lp in enumerate(self.params["layers"]):
            x, K, V = self._prefill_layer(lp, x, positions, lengths)
            if on_layer is not None:
                on_layer(l, K, V)
            kv.append((K, V))
        if all_logits:
            return self._logits(self.params, x), kv
        last = x[jnp.arange(B), lengths - 1]
        return self._logits(self.params, last), kv

    # ------------------------------------------------------- per-layer decode
    def embed(self, tokens):
        """tokens: i32[B] -> x [B, hidden]."""
        return self._embed(self.params, jnp.asarray(tokens, jnp.int32))

    def layer_params(self, layer: int) -> dict:
        return self.params["layers"][layer]

    def layer_input_norm(self, layer: int, x):
        """The normalized attention input of `layer` (what its q/k/v projections see). x: [B, hidden]."""
        return self._input_norm(self.params["layers"][layer], x)

    def qkv(self, layer: int, x, positions):
        """x: [B, hidden], positions: i32[B] -> q [B,H,D], k [B,H_kv,D], v [B,H_kv,D] (RoPE applied)."""
        return self._qkv(self.params["layers"][layer], x, jnp.asarray(positions, jnp.int32))

    def attend_and_mlp(self, layer: int, x, q, K_sel, V_sel, valid_count, attention_fn: Callable | None = None):
        """Attend to the first valid_count[b, h] slots of K_sel/V_sel [B, H_kv, k, D], then the MLP."""
        return self._attend(self.params["layers"][layer], x, q, K_sel, V_sel,
                            jnp.asarray(valid_count, jnp.int32), attention_fn=attention_fn)

    def logits(self, x):
        """x: [B, hidden] -> f32[B, V]."""
        return self._logits(self.params, x)

    # ------------------------------------------------------ dense decode path
    def init_cache(self, batch: int, n_max: int):
        """Zeroed decode cache: tuple over layers of (K, V), each [B, H_kv, n_max, D]."""
        c = self.cfg
        shape = (batch, c.num_kv_heads, n_max, c.head_dim)
        return tuple((jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype)) for _ in range(c.num_layers))

    def cache_from_prefill(self, kv, n_max: int):
        """Pad prefill KV ([B, H_kv, T, D] per layer) to a decode cache of n_max positions."""
        T = kv[0][0].shape[2]
        if n_max < T:
            raise ValueError(f"{n_max=} must be >= the prefill length {T}")
        pad = ((0, 0), (0, 0), (0, n_max - T), (0, 0))
        return tuple((jnp.pad(K, pad), jnp.pad(V, pad)) for K, V in kv)

    def decode_step(self, cache, tokens, positions):
        """Dense decode of one token per request. Returns (logits f32[B, V], new cache).

        The cache passed in is donated (invalid afterwards); use the returned one.
        """
        positions = jnp.asarray(positions, jnp.int32)
        logits, new_k, new_v = self._decode_compute(self.params, cache, jnp.asarray(tokens, jnp.int32), positions)
        return logits, self._write_kv(cache, new_k, new_v, positions)


def tiny_config(family: str = "llama", **overrides) -> ModelConfig:
    """A small config with awkward sizes (GQA ratio 3, odd vocab) for fast tests."""
    base = dict(family=family, vocab_size=301, hidden_size=96, intermediate_size=160, num_layers=3,
                num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=family == "llama", qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
                max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> Model:
    """Random-init tiny model (no tokenizer) for tests of everything above the model."""
    cfg = tiny_config(family, **overrides)
    return Model(cfg, tfm.init_params(cfg, seed), tokenizer=None, name=f"tiny-{family}")


def params_to_numpy(params) -> dict:
    return jax.tree_util.tree_map(np.asarray, params)
