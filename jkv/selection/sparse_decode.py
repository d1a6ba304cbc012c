"""Host-offloaded sparse decode: KV in a numpy host pool, selected rows copied per step.

    host = prefill_to_host(model, prompts, capacity)        # device prefill -> host pool
    result = decode(model, host, selector, max_tokens)       # greedy (or teacher-forced) decode

After prefill every layer's K and V live in host memory, `f32[B, H_kv, N_cap, D]` per layer
(DESIGN.md "KV geometry"); the device keeps only the selector's small metadata. Each decode
step and layer: q, k, v = qkv(x) on device → the new k, v are written to the host pool and
the metadata → `selector.select` on device → `kv_index` to host → numpy gathers the selected
rows → device → `attend_and_mlp` over exactly those rows (SmartGen §2.3, Fig. 1). Layers below
`dense_layers` and the Dense selector take every token. Dense decode through the same pieces
is the reference for every sparse path, and `model.decode_step` is the fully jitted one.

Single-threaded: the pool is owned by the caller's thread; a `HostKV` must not be shared by
two concurrent decodes (decode writes the generated tokens' K/V into it).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jkv.selection.base import Selector, dense_layer_count

PREFILL_BUCKET = 64
CAPACITY_BUCKET = 256


@dataclasses.dataclass
class HostKV:
    """The request batch's KV in host memory after prefill.

    keys, values: per layer f32[B, H_kv, N_cap, D]; prompt_lengths: i32[B];
    last_logits: f32[B, V] (the prefill's prediction of the first new token).
    """

    keys: list[np.ndarray]
    values: list[np.ndarray]
    prompt_lengths: np.ndarray
    last_logits: np.ndarray

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


@dataclasses.dataclass
class StepStats:
    """One decode step. kv_fraction: selected entries / cached entries over all layers and
    KV heads; sparse_kv_fraction: the same over the layers the selector decides."""

    select_s: float
    gather_s: float
    attend_s: float
    total_s: float
    kv_fraction: float
    sparse_kv_fraction: float


@dataclasses.dataclass
class DecodeResult:
    """tokens: i32[B, S] (tokens[:, 0] comes from the prefill logits); logits: f32[B, S, V] when
    kept (logits[:, i] predicts tokens[:, i]); steps: one StepStats per decode step (S - 1)."""

    tokens: np.ndarray
    logits: np.ndarray | None
    steps: list[StepStats]

    def mean(self, field: str) -> float:
        values = [getattr(s, field) for s in self.steps]
        return float(np.mean(values)) if values else float("nan")


def prefill_to_host(model, prompts: list[list[int]], capacity: int) -> HostKV:
    """Prefill a batch of token lists on device and move every layer's K/V to a host pool of
    `capacity` slots (>= longest prompt + tokens to generate)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if capacity < lengths.max():
        raise ValueError(f"{capacity=} must be >= the longest prompt ({lengths.max()} tokens)")
    # Pad the prompt axis to a multiple of PREFILL_BUCKET so nearby lengths share one compile.
    padded = min(capacity, -(-int(lengths.max()) // PREFILL_BUCKET) * PREFILL_BUCKET)
    tokens = np.zeros((len(prompts), padded), np.int32)
    for b, prompt in enumerate(prompts):
        tokens[b, :len(prompt)] = prompt
    cfg = model.cfg
    shape = (len(prompts), cfg.num_kv_heads, capacity, cfg.head_dim)
    keys = [np.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
    values = [np.zeros(shape, np.float32) for _ in range(cfg.num_layers)]

    def to_host(layer, K, V):  # called as each layer finishes (DESIGN.md: emit per layer)
        keys[layer][:, :, :K.shape[2]] = np.asarray(K, np.float32)
        values[layer][:, :, :V.shape[2]] = np.asarray(V, np.float32)

    last_logits, _ = model.prefill(jnp.asarray(tokens), jnp.asarray(lengths), on_layer=to_host)
    return HostKV(keys, values, lengths, np.asarray(last_logits, np.float32))


def pool_capacity(prompts: list[list[int]], max_tokens: int) -> int:
    """Slots for the longest prompt plus max_tokens, rounded up to CAPACITY_BUCKET so requests of
    similar length reuse the selectors' compiled shapes."""
    needed = max(len(p) for p in prompts) + max_tokens
    return -(-needed // CAPACITY_BUCKET) * CAPACITY_BUCKET


def gather_rows(pool: np.ndarray, kv_index: np.ndarray) -> np.ndarray:
    """pool: f32[B, H_kv, N_cap, D], kv_index: i32[B*H_kv, k] (-1 = unused) -> f32[B, H_kv, k, D].
    Unused slots read row 0 (attention ignores them: they sit past valid_count)."""
    batch, num_kv_heads = pool.shape[:2]
    index = np.maximum(kv_index, 0).reshape(batch, num_kv_heads, -1)
    return pool[np.arange(batch)[:, None, None], np.arange(num_kv_heads)[None, :, None], index]


def decode(model, host: HostKV, selector: Selector, max_tokens: int, *,
           forced_tokens: np.ndarray | None = None, keep_logits: bool = False,
           on_query: Callable[[int, jax.Array, np.ndarray], None] | None = None) -> DecodeResult:
    """Greedy decode of `max_tokens` tokens per request from a host pool.

    forced_tokens: optional i32[B, >= max_tokens - 1]; step i feeds forced_tokens[:, i] instead
    of the argmax (teacher forcing), so logits[:, i+1] score forced_tokens[:, i+1].
    on_query(layer, q [B, H, D], positions i32[B]) sees every layer's true query (calibration).
    """
    if max_tokens < 1:
        raise ValueError(f"{max_tokens=} must be >= 1")
    batch = host.prompt_lengths.shape[0]
    if int(host.prompt_lengths.max()) + max_tokens - 1 > host.capacity:
        raise ValueError(f"host pool capacity {host.capacity} < prompt {int(host.prompt_lengths.max())} + "
                         f"{max_tokens - 1} decode steps; prefill_to_host with a larger capacity")
    if forced_tokens is not None:
        forced_tokens = np.asarray(forced_tokens, np.int32)
        if forced_tokens.shape[0] != batch or forced_tokens.shape[1] < max_tokens - 1:
            raise ValueError(f"forced_tokens shape {forced_tokens.shape} must be [B={batch}, >= {max_tokens - 1}]")
    num_layers = model.cfg.num_layers
    dense_below = dense_layer_count(selector, num_layers)
    lengths = jnp.asarray(host.prompt_lengths)
    metadata = [None if layer < dense_below else selector.prepare(layer, jnp.asarray(host.keys[layer]), lengths)
                for layer in range(num_layers)]
    logits = host.last_logits
    current = forced_tokens[:, 0] if forced_tokens is not None else logits.argmax(-1).astype(np.int32)
    tokens, kept_logits, steps = [current], [logits] if keep_logits else None, []
    positions = host.prompt_lengths.copy()
    batch_rows = np.arange(batch)
    for step in range(max_tokens - 1):
        t_start = time.perf_counter()
        select_s = gather_s = attend_s = 0.0
        selected = cached = sparse_selected = sparse_cached = 0
        pos = jnp.asarray(positions)
        now_cached = positions + 1
        x = model.embed(jnp.asarray(current))
        x_prev = x
        for layer in range(num_layers):
            q, k, v = model.qkv(layer, x, pos)
            if on_query is not None:
                on_query(layer, q, positions)
            host.keys[layer][batch_rows, :, positions] = np.asarray(k, np.float32)
            host.values[layer][batch_rows, :, positions] = np.asarray(v, np.float32)
            t0 = time.perf_counter()
            if layer < dense_below:
                k_sel, v_sel = host.keys[layer], host.values[layer]
                valid = np.broadcast_to(now_cached[:, None], (batch, k.shape[1])).astype(np.int32)
                t1 = t0
            else:
                metadata[layer] = selector.append(layer, metadata[layer], k, pos)
                x_in_prev = x_prev
                query = selector.decode_query(layer, q, lambda: model.qkv(layer, x_in_prev, pos)[0])
                kv_index = np.asarray(selector.select(layer, query, metadata[layer], jnp.asarray(now_cached)))
                t1 = time.perf_counter()
                k_sel = gather_rows(host.keys[layer], kv_index)
                v_sel = gather_rows(host.values[layer], kv_index)
                valid = (kv_index >= 0).sum(axis=1).reshape(batch, -1).astype(np.int32)
                sparse_selected += int(valid.sum())
                sparse_cached += int(now_cached.sum()) * valid.shape[1]
            k_dev, v_dev, valid_dev = jnp.asarray(k_sel), jnp.asarray(v_sel), jnp.asarray(valid)
            t2 = time.perf_counter()
            x_prev = x
            x = model.attend_and_mlp(layer, x, q, k_dev, v_dev, valid_dev)
            x.block_until_ready()
            t3 = time.perf_counter()
            select_s, gather_s, attend_s = select_s + (t1 - t0), gather_s + (t2 - t1), attend_s + (t3 - t2)
            selected += int(valid.sum())
            cached += int(now_cached.sum()) * valid.shape[1]
        logits = np.asarray(model.logits(x), np.float32)
        current = (forced_tokens[:, step + 1] if forced_tokens is not None and step + 1 < forced_tokens.shape[1]
                   else logits.argmax(-1).astype(np.int32))
        positions = positions + 1
        tokens.append(current)
        if keep_logits:
            kept_logits.append(logits)
        steps.append(StepStats(select_s, gather_s, attend_s, time.perf_counter() - t_start, selected / cached,
                               sparse_selected / sparse_cached if sparse_cached else 1.0))
    return DecodeResult(np.stack(tokens, axis=1),
                        np.stack(kept_logits, axis=1) if keep_logits else None, steps)


def generate_sparse(model, prompts: list[list[int]], selector: Selector, max_tokens: int,
                    *, keep_logits: bool = False) -> DecodeResult:
    """Greedy generation of `max_tokens` tokens per prompt with `selector` choosing the KV."""
    host = prefill_to_host(model, prompts, pool_capacity(prompts, max_tokens))
    return decode(model, host, selector, max_tokens, keep_logits=keep_logits)
