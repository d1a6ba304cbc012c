"""Tensor parallelism: how a model's params and KV cache are laid out over a ("data", "tensor") mesh.

    layout = plan_layout(cfg, tensor_parallel=4, num_devices=len(jax.devices()))
    ts = TensorSharding(cfg, 4)          # the mesh of the first 4 devices, shape (data=1, tensor=4)
    params = jax.device_put(params, ts.param_shardings(params))

The model code is the same at every degree (GSPMD): params and caches carry `NamedSharding`s,
`Model`'s jitted programs pin the layout of what they return (the KV they produce, the caches
they write, replicated logits), and XLA's partitioner derives the collectives in between
(Megatron style: one all-reduce after o_proj and one after down_proj per layer). The paged decode
attention runs in a shard_map over "tensor" instead (models/paged.py `head_mesh`): its dispatch ops
merge batch and KV-head rows, which GSPMD cannot keep split by head.

What is sharded over "tensor" (N = tensor_parallel):

- attention, when num_heads % N == 0 and the KV heads split evenly too (num_kv_heads % N == 0)
  or each shard's query heads use one KV head (N % num_kv_heads == 0): q_proj columns (and bias)
  by query head, o_proj rows. K/V projections and the KV cache (dense `[B, H_kv, N, D]` and paged
  `[pages, H_kv, P, D]`) are sharded by KV head when num_kv_heads % N == 0; with fewer KV heads
  than N they are replicated: every shard holds all H_kv heads, a superset of the ones its query
  heads read (this costs H_kv x the ideal per-shard KV memory, not more compute).
  Otherwise (e.g. SmolLM2's 9 query heads at N = 2 or 4) attention is replicated: each shard
  computes all heads, and only the MLP and vocabulary are split.
- the MLP, when intermediate_size % N == 0: gate/up columns, down rows.
- the vocabulary (embedding rows, LM head columns), when vocab_size % N == 0 and the table is at
  least VOCAB_SHARD_MIN_BYTES; a smaller table is replicated (its all-reduce would cost more
  than the memory it saves).

A degree that would shard nothing (neither attention nor the MLP divides), or that exceeds the
devices, is refused with `TensorParallelError` naming the numbers and the degrees that work.
The "data" axis has size 1: data-parallel replicas are separate servers behind the router.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig

log = logging.getLogger(__name__)

AXES = ("data", "tensor")
VOCAB_SHARD_MIN_BYTES = 16 << 20


class TensorParallelError(ValueError):
    """A tensor-parallel degree this model or machine cannot run."""


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """What a tensor-parallel degree shards (see the module docstring)."""

    tensor_parallel: int
    attention: bool  # query heads (q_proj columns, o_proj rows) split over "tensor"
    kv_heads: bool  # K/V projections and the KV cache split by KV head (else replicated)
    mlp: bool  # gate/up columns and down rows split
    vocab: bool  # embedding rows and LM head columns split

    def describe(self) -> str:
        n = self.tensor_parallel
        if n == 1:
            return "tensor_parallel=1 (one device, nothing sharded)"
        split = [name for name, on in (("attention heads", self.attention), ("KV cache by KV head", self.kv_heads),
                                       ("MLP", self.mlp), ("vocabulary", self.vocab)) if on]
        kept = [name for name, on in (("attention", self.attention), ("KV cache", self.kv_heads),
                                      ("vocabulary", self.vocab)) if not on]
        return (f"tensor_parallel={n}: sharded {', '.join(split)}"
                + (f"; replicated {', '.join(kept)}" if kept else ""))


def _attention_splits(cfg: ModelConfig, n: int) -> bool:
    return cfg.num_heads % n == 0 and (cfg.num_kv_heads % n == 0 or n % cfg.num_kv_heads == 0)


def shardable_degrees(cfg: ModelConfig, num_devices: int) -> list[int]:
    """The tensor-parallel degrees <= num_devices this model can run (1 always)."""
    return [n for n in range(1, num_devices + 1)
            if n == 1 or _attention_splits(cfg, n) or cfg.intermediate_size % n == 0]


def check_degree(tensor_parallel: int, num_devices: int) -> int:
    """tensor_parallel as an int, or TensorParallelError when it is < 1 or above num_devices (a
    check that needs no model, so a loader can refuse before it reads any weights)."""
    n = tensor_parallel
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise TensorParallelError(f"tensor_parallel={n!r} must be an int >= 1 (1: one device, no sharding)")
    n = int(n)
    if n > num_devices:
        raise TensorParallelError(
            f"tensor_parallel={n} needs {n} devices but jax sees {num_devices} ({jax.default_backend()}); "
            f"use tensor_parallel <= {num_devices} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            "before jax is imported fakes more devices)")
    return n


def plan_layout(cfg: ModelConfig, tensor_parallel: int, num_devices: int) -> TensorLayout:
    """The layout of `cfg` at degree `tensor_parallel` on a machine with `num_devices` devices.

    Raises TensorParallelError for a degree < 1, above num_devices, or one that shards nothing.
    """
    n = check_degree(tensor_parallel, num_devices)
    if n == 1:
        return TensorLayout(1, attention=False, kv_heads=False, mlp=False, vocab=False)
    attention = _attention_splits(cfg, n)
    mlp = cfg.intermediate_size % n == 0
    if not attention and not mlp:
        raise TensorParallelError(
            f"tensor_parallel={n} cannot shard this model: num_heads={cfg.num_heads} (with "
            f"num_kv_heads={cfg.num_kv_heads}) and intermediate_size={cfg.intermediate_size} do not divide by {n}, "
            f"so every shard would hold and compute the whole model; use tensor_parallel in "
            f"{shardable_degrees(cfg, num_devices)}")
    table_bytes = cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize
    layout = TensorLayout(n, attention=attention, kv_heads=attention and cfg.num_kv_heads % n == 0, mlp=mlp,
                          vocab=cfg.vocab_size % n == 0 and table_bytes >= VOCAB_SHARD_MIN_BYTES)
    if not attention:
        log.warning("tensor_parallel=%d: num_heads=%d / num_kv_heads=%d do not split over %d shards, so attention "
                    "and the KV cache are replicated on every shard (only the MLP%s is sharded)", n, cfg.num_heads,
                    cfg.num_kv_heads, n, " and vocabulary" if layout.vocab else "")
    return layout


class TensorSharding:
    """A `TensorLayout` on a concrete mesh: the NamedShardings of params, caches and activations."""

    def __init__(self, cfg: ModelConfig, tensor_parallel: int, devices=None):
        devices = list(jax.devices() if devices is None else devices)
        self.cfg = cfg
        self.layout = plan_layout(cfg, tensor_parallel, len(devices))
        n = self.layout.tensor_parallel
        self.mesh = Mesh(np.array(devices[:n]).reshape(1, n), AXES)
        self.replicated = self._named(P())
        kv = "tensor" if self.layout.kv_heads else None
        # KV arrays put the KV-head axis second: caches [B | pages, H_kv, N | P, D], prefill K/V
        # [B, H_kv, T, D], decode k/v [B, H_kv, D]; stacked new KV [L, B, H_kv, ...] puts it third.
        self.kv = self._named(P(None, kv))
        self.kv_stacked = self._named(P(None, None, kv))
        self.q_heads = self._named(P(None, "tensor" if self.layout.attention else None))  # q [B, H, D]

    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def __repr__(self):
        return f"TensorSharding({self.layout.describe()}, mesh {dict(self.mesh.shape)})"

    def _spec(self, path: tuple[str, ...], ndim: int) -> P:
        lay = self.layout
        module, name = path[-2], path[-1]
        col, row = P(None, "tensor"), P("tensor", None)
        if path[0] == "embed_tokens":
            return row if lay.vocab else P()
        if path[0] == "lm_head":
            return col if lay.vocab else P()
        split = {"q_proj": lay.attention, "k_proj": lay.kv_heads, "v_proj": lay.kv_heads, "o_proj": lay.attention,
                 "gate_proj": lay.mlp, "up_proj": lay.mlp, "down_proj": lay.mlp}.get(module, False)
        if not split:
            return P()
        if module in ("o_proj", "down_proj"):  # row split; the bias is added after the all-reduce
            return row if name == "kernel" else P()
        return (col if name == "kernel" else P("tensor")) if ndim else P()

    def param_shardings(self, params):
        """A pytree like `params` (arrays or ShapeDtypeStructs, the tree of models/transformer.py)
        of NamedShardings."""
        def one(path, leaf):
            keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            return self._named(self._spec(keys, len(leaf.shape)))

        return jax.tree_util.tree_map_with_path(one, params)
