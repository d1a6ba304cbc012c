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
import hashlib
import logging
import os
import zipfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import paged
from . import transformer as tfm
from .config import ModelConfig
from .sharding import TensorSharding
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Model:
    """tensor_parallel=N shards params and caches over the first N devices (models/sharding.py);
    the same programs run at every degree, and N=1 places everything on the default device."""

    def __init__(self, cfg: ModelConfig, params: dict, tokenizer: Tokenizer | None = None, name: str = "",
                 tensor_parallel: int = 1, devices=None):
        self.cfg = cfg
        self.sharding = None if tensor_parallel == 1 else TensorSharding(cfg, tensor_parallel, devices)
        if self.sharding is None:
            self.params = jax.device_put(params)
        else:
            self.params = jax.device_put(params, self.sharding.param_shardings(params))
            log.info("%s: %s", name or cfg.family, self.sharding.layout.describe())
        self.tokenizer = tokenizer
        self.name = name or cfg.family
        p = functools.partial
        s = self.sharding
        # Under tensor parallelism each program pins the layout of what it returns (KV sharded by
        # KV head, activations and logits replicated) so caches never drift to another layout.
        jit = self._jit
        # The native CPU prefill attention (whole prompts and chunks) is an opaque custom call the
        # SPMD partitioner cannot split: a tensor-parallel model keeps the XLA formulation.
        self._prefill_layer = jit(p(tfm.prefill_layer, cfg, native_attention=s is None),
                                  lambda s: (s.replicated, s.kv, s.kv))
        self._prefill_layer_after = jit(p(paged.prefill_layer_after, cfg), lambda s: (s.replicated, s.kv, s.kv))
        self._embed = jit(tfm.embed, lambda s: s.replicated)
        self._logits = jit(p(tfm.final_logits, cfg), lambda s: s.replicated)
        self._qkv = jit(p(tfm.layer_qkv, cfg), lambda s: (s.q_heads, s.kv, s.kv))
        self._input_norm = jit(p(tfm.layer_input_norm, cfg), lambda s: s.replicated)
        self._attend = jit(p(tfm.layer_attend_and_mlp, cfg), lambda s: s.replicated,
                           static_argnames=("attention_fn",))
        # Two programs per decode step: XLA CPU copies a donated cache that one program both reads and
        # updates in place, so attention reads it in one program and a second writes it in place.
        new_kv = lambda s: (s.replicated, s.kv_stacked, s.kv_stacked)
        self._decode_compute = jit(p(tfm.decode_step_compute, cfg), new_kv)
        self._write_kv = jit(tfm.write_decode_kv, lambda s: s.kv, donate_argnums=(0,))
        # The paged cache follows the same split (models/paged.py).
        # Under TP with query heads split, paged decode attention runs per shard (shard_map).
        head_mesh = s.mesh if s is not None and s.layout.attention else None
        self._paged_decode_compute = jit(p(paged.paged_decode_step_compute, cfg, head_mesh=head_mesh), new_kv)
        self._prefill_chunk_compute = jit(p(paged.prefill_chunk_compute, cfg, native_attention=s is None), new_kv)
        self._paged_write = jit(paged.paged_write, lambda s: s.kv, donate_argnums=(0,))
        self._paged_write_prefill = jit(paged.paged_write_prefill, lambda s: s.kv, donate_argnums=(0,))
        del s

    def _jit(self, fn, out_shardings: Callable, **kw):
        """jax.jit; under tensor parallelism with out_shardings(self.sharding) (a pytree prefix)."""
        if self.sharding is None:
            return jax.jit(fn, **kw)
        return jax.jit(fn, out_shardings=out_shardings(self.sharding), **kw)

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.sharding is None else self.sharding.layout.tensor_parallel

    @property
    def kv_sharding(self):
        """The NamedSharding of KV caches ([B | pages, H_kv, ..., D]), or None at tensor_parallel=1."""
        return None if self.sharding is None else self.sharding.kv

    def with_tensor_parallel(self, tensor_parallel: int, devices=None) -> "Model":
        """This model's weights laid out at another degree (a new Model; this one is unchanged)."""
        if tensor_parallel == self.tensor_parallel and devices is None:
            return self
        return Model(self.cfg, self.params, self.tokenizer, self.name, tensor_parallel=tensor_parallel,
                     devices=devices)

    def __repr__(self):
        c = self.cfg
        tp = f", tensor_parallel={self.tensor_parallel}" if self.sharding is not None else ""
        return (f"Model({self.name!r}, {c.family}, L={c.num_layers}, H={c.num_heads}, H_kv={c.num_kv_heads}, "
                f"D={c.head_dim}, dtype={c.dtype}{tp})")

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

    def prefill_after(self, tokens, start, lengths, context: Callable, on_layer: Callable | None = None):
        """Prefill of each row's tokens after its cached prefix, layer by layer.

        tokens: i32[B, C], row b's prompt tokens from position start[b] (i32[B]), lengths[b] >= 1
        of them valid. context(l) -> (K, V), each [B, H_kv, T, D]: layer l's cached KV of row b at
        positions < start[b] (zeros after; T >= start[b] + lengths[b]). on_layer(l, K, V) is called
        with the whole prompts' KV of layer l ([B, H_kv, T, D], as `prefill` gives it for positions
        < start[b] + lengths[b]). Returns logits f32[B, V] at each prompt's last token.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        start = jnp.asarray(start, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        B, C = tokens.shape
        positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
        x = self._embed(self.params, tokens)
        for l, lp in enumerate(self.params["layers"]):
            K_ctx, V_ctx = context(l)
            x, K, V = self._prefill_layer_after(lp, x, positions, K_ctx, V_ctx, start, lengths)
            if on_layer is not None:
                on_layer(l, K, V)
        return self._logits(self.params, x[jnp.arange(B), lengths - 1])

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
        return paged.zeros_kv(c.num_layers, shape, c.dtype, self.kv_sharding)

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


    # ------------------------------------------------------- paged decode path
    def init_paged_kv(self, num_pages: int, page_size: int, dtype=None):
        """Zeroed paged cache: tuple over layers of (K, V), each [num_pages, H_kv, P, D] in dtype
        (default: the model's), sharded like the model's KV. `jkv.kvcache.PagedKVCache` pairs it
        with page tables."""
        return paged.init_pages(self.cfg, num_pages, page_size, dtype, sharding=self.kv_sharding)

    def write_prefill_pages(self, kv_pages, page_table, prefill_kv, lengths, start=None):
        """Scatter prefill KV (`prefill`'s kv: per layer (K, V) [B, H_kv, T, D]) into pages.

        Token j of row b goes to position start[b] + j (start defaults to 0) for j < lengths[b].
        The cache passed in is donated; use the returned one.
        """
        lengths = jnp.asarray(lengths, jnp.int32)
        start = jnp.zeros_like(lengths) if start is None else jnp.asarray(start, jnp.int32)
        new_k = [K for K, _ in prefill_kv]
        new_v = [V for _, V in prefill_kv]
        return self._paged_write_prefill(kv_pages, jnp.asarray(page_table, jnp.int32), new_k, new_v, start, lengths)

    def paged_decode_step(self, kv_pages, page_table, tokens, positions):
        """Decode one token per row over the paged cache. Returns (logits f32[B, V], new cache).

        page_table: i32[B, max_pages] (must address position positions[b], where the new token's
        K/V is written); tokens, positions: i32[B], positions[b] = tokens row b has cached.
        The cache passed in is donated; use the returned one.
        """
        table = jnp.asarray(page_table, jnp.int32)
        positions = jnp.asarray(positions, jnp.int32)
        logits, new_k, new_v = self._paged_decode_compute(
            self.params, kv_pages, table, jnp.asarray(tokens, jnp.int32), positions)
        return logits, self._paged_write(kv_pages, table, positions, new_k, new_v)

    def prefill_chunk(self, kv_pages, page_table, tokens, start, lengths):
        """Prefill a chunk tokens: i32[B, C] at positions start[b] + j, attending causally to the
        row's earlier tokens in pages and to the chunk; its K/V is written into pages.

        lengths: i32[B] valid tokens of each row's chunk (0 for a row with nothing to prefill).
        Returns (logits f32[B, V] at each row's last valid chunk token, new cache); the cache passed
        in is donated.
        """
        table = jnp.asarray(page_table, jnp.int32)
        start = jnp.asarray(start, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        logits, new_k, new_v = self._prefill_chunk_compute(
            self.params, kv_pages, table, jnp.asarray(tokens, jnp.int32), start, lengths)
        return logits, self._paged_write_prefill(kv_pages, table, new_k, new_v, start, lengths)


def tiny_config(family: str = "llama", **overrides) -> ModelConfig:
    """A small config with awkward sizes (GQA ratio 3, odd vocab) for fast tests."""
    base = dict(family=family, vocab_size=301, hidden_size=96, intermediate_size=160, num_layers=3,
                num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=family == "llama", qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
                max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return ModelConfig(**base)


# A directory where `tiny_model` keeps the parameters it initialised (one .npz per config and seed),
# for the processes of one test run: flax's eager init costs ~6 CPU-s in each new process (one small
# program compiled per op and shape), loading the file ~0.2 s, and the test suite starts hundreds
# of processes (servers, prefill workers) that build the same tiny models. Unset: no files.
TINY_PARAMS_CACHE_ENV = "JKV_TINY_PARAMS_CACHE"


def tiny_model(family: str = "llama", seed: int = 0, tensor_parallel: int = 1, **overrides) -> Model:
    """Random-init tiny model (no tokenizer) for tests of everything above the model."""
    cfg = tiny_config(family, **overrides)
    return Model(cfg, _tiny_params(cfg, seed), tokenizer=None, name=f"tiny-{family}",
                 tensor_parallel=tensor_parallel)


def _tiny_params(cfg: ModelConfig, seed: int):
    """`tfm.init_params(cfg, seed)`, through the $JKV_TINY_PARAMS_CACHE directory when it is set:
    the same arrays bit for bit (saved from the init, restored into the init's tree structure)."""
    directory = os.environ.get(TINY_PARAMS_CACHE_ENV)
    if not directory:
        return tfm.init_params(cfg, seed)
    tag = hashlib.sha256(f"{cfg!r}|{seed}|{jax.__version__}".encode()).hexdigest()[:24]
    path = os.path.join(directory, f"tiny-{tag}.npz")
    try:
        with np.load(path) as stored:  # raw bytes, viewed as the init's dtype (bfloat16 too)
            leaves, treedef = jax.tree_util.tree_flatten(jax.eval_shape(lambda: tfm.init_params(cfg, seed)))
            arrays = [np.frombuffer(stored[f"a{i}"].tobytes(), l.dtype).reshape(l.shape)
                      for i, l in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in arrays])
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # not there yet (or half-written by a process that died): initialise and store
    params = tfm.init_params(cfg, seed)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **{f"a{i}": np.asarray(a).reshape(-1).view(np.uint8)
                     for i, a in enumerate(jax.tree_util.tree_leaves(params))})
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    return params


def params_to_numpy(params) -> dict:
    return jax.tree_util.tree_map(np.asarray, params)
