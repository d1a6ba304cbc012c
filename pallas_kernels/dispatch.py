"""Public entry points for the decode-path ops: one function per op, backend chosen once.

    topk_select(scores: f32|bf16[R, N], valid_len: i32[R], k) -> i32[R, k]
    topk_select_fused(q_partial: [R, G, d_p], k_partial: [R, N, d_p], valid_len: i32[R], k)
        -> i32[R, k]
    split_reorder(kv_index: i32[R, k], kv_mask: i8[B, N], heads_per_batch)
        -> (reordered i32[R, k], remote_count i32[R], local_count i32[R])
    sparse_decode_attention(q: [B, H, D], k_sel, v_sel: [B*H_kv, k, D], valid_count: i32[B*H_kv])
        -> [B, H, D]
    sparse_decode_attention_partials(...) -> (out f32[B, H, D], lse f32[B, H])
    merge_partials((o1, lse1), (o2, lse2)) -> (o, lse)
    paged_decode_attention_partials(q: [B, H, D], k_pages, v_pages: [num_pages, H_kv, P, D],
        page_table: i32[B, max_pages], lengths: i32[B]) -> (out f32[B, H, D], lse f32[B, H])
    paged_gather(k_pages, v_pages: [num_pages, H_kv, P, D], page_table: i32[B, max_pages],
        kv_index: i32[B*H_kv, k]) -> (k_sel, v_sel: [B, H_kv, k, D])

Backends: "mosaic" (Hopper+: sparse attention by the Mosaic GPU kernel of `mosaic_attention`,
bf16 / f16 and f32 (the latter as 3xbf16 products, ~16 mantissa bits: see that module), the
other ops (top-k, split/reorder, the paged gather) by the Triton kernels; shapes the Mosaic kernel does not take (a head dim whose rows
are not a multiple of 128 bytes, f32 at a head dim other than 64 or 128, a query group over 64)
fall back to Triton, paged attention to the XLA reference, with one log line per reason),
"pallas" (compiled
Pallas Triton kernels; GPU only), "interpret" (the Triton kernels in Pallas interpret mode; for
tests on CPU, slow), "xla" (the pure-jnp references, which XLA compiles well on CPU), "auto" (the
default: on a GPU of compute capability >= 9.0 "mosaic", on another GPU "pallas", without the
Triton backend or without a GPU "xla"; it logs its choice once, when first resolved). The
choice is read when an op is traced, and `jax.jit` caches traces per function, so a caller jitted
before a switch keeps its old backend: choose once at startup with `set_backend(name)`; tests use
`with backend(name): ...` (restores the previous choice) around freshly jitted functions.

Native CPU kernels: where a program is lowered for XLA:CPU, `paged_decode_attention_partials` runs
an XLA FFI kernel built from C++ at first use (`cpu_paged_attention`), whatever the backend
(none of the Pallas ones runs compiled on CPU), and so do the causal prefill attentions and, on
the "xla" backend, `topk_select` / `topk_select_fused`'s selection (the same indices as XLA's
partial sort, in linear time a row); `set_cpu_kernels(False)` / `with cpu_kernels(False)` keep the
XLA references there.

Shapes are validated here, once, with errors that name the value; the kernel modules assume them.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Iterator

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_paged_attention, mosaic_attention, paged_gather as paged_gather_mod, sparse_attention
from pallas_kernels import split_reorder as split_reorder_mod, topk
from pallas_kernels._common import TRITON_AVAILABLE
from pallas_kernels.sparse_attention import merge_partials

log = logging.getLogger(__name__)

BACKENDS = ("auto", "mosaic", "pallas", "xla", "interpret")
_backend = "auto"


def cpu_kernels_from_env(environ=os.environ) -> bool:
    """JKV_CPU_KERNELS=0 starts a process with the XLA references on CPU (`set_cpu_kernels`)."""
    return environ.get("JKV_CPU_KERNELS", "1").strip() != "0"


_cpu_kernels = cpu_kernels_from_env()

__all__ = [
    "BACKENDS",
    "backend",
    "cpu_kernels",
    "get_backend",
    "kernels_in_use",
    "merge_partials",
    "paged_decode_attention_partials",
    "paged_gather",
    "resolved_backend",
    "set_backend",
    "causal_prefill_attention",
    "chunk_prefill_attention",
    "set_cpu_kernels",
    "sparse_decode_attention",
    "sparse_decode_attention_partials",
    "split_reorder",
    "topk_select",
    "topk_select_fused",
]


def set_backend(name: str) -> None:
    """Choose the implementation for every op: "auto" | "mosaic" | "pallas" | "xla" | "interpret"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend {name=} is not one of {BACKENDS}")
    if name == "mosaic" and not mosaic_attention.MOSAIC_AVAILABLE:
        raise RuntimeError(
            f"backend {name=} needs jax.experimental.pallas.mosaic_gpu.kernel, absent from this "
            f"JAX {jax.__version__}; use 'pallas' or 'xla'"
        )
    if name in ("mosaic", "pallas", "interpret") and not TRITON_AVAILABLE:
        raise RuntimeError(
            f"backend {name=} needs jax.experimental.pallas.triton, absent from this JAX "
            f"{jax.__version__}; use 'xla'"
        )
    _backend = name


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Temporarily use another backend (tests, benchmarks)."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def set_cpu_kernels(enabled: bool) -> None:
    """Whether ops lowered for XLA:CPU may use the native CPU kernels (`cpu_paged_attention`) where
    one exists (default True, or False when the environment sets JKV_CPU_KERNELS=0); False keeps
    the XLA references there. Read at trace time, like the backend."""
    global _cpu_kernels
    _cpu_kernels = bool(enabled)


@contextlib.contextmanager
def cpu_kernels(enabled: bool) -> Iterator[None]:
    """Temporarily allow or forbid the native CPU kernels (tests, A/B benchmarks)."""
    previous = _cpu_kernels
    set_cpu_kernels(enabled)
    try:
        yield
    finally:
        set_cpu_kernels(previous)


def _compute_capability(device: jax.Device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; (0, 0) when the device does not say."""
    try:
        major, minor = str(getattr(device, "compute_capability", "0.0")).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0


def choose_auto(platform: str, capability: tuple[int, int]) -> tuple[str, str]:
    """The backend "auto" means on `platform` with a GPU of `capability`, and why."""
    if platform != "gpu":
        return "xla", f"no GPU (jax default backend {platform!r}): XLA references"
    if not TRITON_AVAILABLE:
        return "xla", "GPU present but the Pallas Triton backend is missing: XLA references"
    if capability >= (9, 0) and mosaic_attention.MOSAIC_AVAILABLE:
        return "mosaic", (f"sm_{capability[0]}{capability[1]}: Mosaic GPU attention, Triton for "
                          "the other ops (Triton attention where Mosaic does not fit)")
    if capability >= (9, 0):
        return "pallas", f"sm_{capability[0]}{capability[1]} but no Mosaic GPU Pallas: Triton"
    return "pallas", f"sm_{capability[0]}{capability[1]} (< sm_90, no wgmma): Triton kernels"


@functools.cache
def _auto_backend() -> str:
    platform = jax.default_backend()
    capability = _compute_capability(jax.devices()[0]) if platform == "gpu" else (0, 0)
    chosen, why = choose_auto(platform, capability)
    # Once per process (cached): which kernels this run uses is worth one line at start-up.
    log.info("pallas_kernels.dispatch: backend 'auto' -> %r (%s)", chosen, why)
    return chosen


def resolved_backend() -> str:
    """The backend ops use now: "mosaic", "pallas", "xla" or "interpret" ("auto" resolved)."""
    return _auto_backend() if _backend == "auto" else _backend


def kernels_in_use() -> bool:
    """Whether the ops run Pallas kernels now (any backend but "xla"). A caller with two equivalent
    formulations picks by it: the selectors' fused top-k (`topk_select_fused`) replaces their jnp
    scores + `topk_select` only on a kernel backend, where it saves a pass (see docs/kernels.md);
    under "xla" the fused reference is the same einsum + sort as their own path, so they keep it."""
    return resolved_backend() != "xla"


def _kernel_mode() -> bool | None:
    """None -> use the reference; otherwise the `interpret` flag for the Pallas wrapper."""
    chosen = resolved_backend()
    return None if chosen == "xla" else chosen == "interpret"


@functools.cache
def _log_mosaic_fallback(op: str, reason: str, fallback: str) -> None:
    # Once per (op, reason): a fallback is a per-shape fact, not a per-call event.
    log.info("%s: Mosaic kernel does not take this call (%s); using %s", op, reason, fallback)


def _mosaic_takes(op: str, fallback: str, head_dim: int, dtype, group: int, page_size: int | None = None) -> bool:
    """Whether the "mosaic" backend is chosen and its kernel takes these shapes (`page_size`: the
    paged kernel's, whole pages a 64-entry tile); when it is chosen but does not, log once that
    `op` uses `fallback`."""
    if resolved_backend() != "mosaic":
        return False
    try:
        mosaic_attention.check_supported(head_dim, dtype, group)
        if page_size is not None and page_size not in (8, 16, 32, 64):
            raise ValueError(f"page size {page_size} is not 8, 16, 32 or 64")
    except ValueError as exc:
        _log_mosaic_fallback(op, str(exc), fallback)
        return False
    return True


@functools.cache
def _log_fallback(op: str, reason: str, fallback: str) -> None:
    # Once per (op, reason), as above, for a Triton kernel that does not take a call.
    log.info("%s: the Triton kernel does not take this call (%s); using %s", op, reason, fallback)


def _check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{k=} must be a positive int (number of entries to select)")
    return k


def _check_lengths(name: str, lengths: jax.Array, rows: int) -> None:
    if lengths.shape != (rows,):
        raise ValueError(f"{name}.shape={lengths.shape} must be ({rows},), one length per row")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={lengths.dtype} must be an integer type (i32)")


def topk_select(scores: jax.Array, valid_len: jax.Array, k: int) -> jax.Array:
    """Indices i32[R, k] of the k largest scores[r, :valid_len[r]], score descending, ties by
    lower index; slots past min(k, valid_len[r]) are -1. scores: f32|bf16[R, N]."""
    _check_k(k)
    if scores.ndim != 2 or 0 in scores.shape:
        raise ValueError(f"{scores.shape=} must be [R, N] with R, N >= 1")
    _check_lengths("valid_len", valid_len, scores.shape[0])
    interpret = _kernel_mode()
    if interpret is None:
        return _topk_select_xla(scores, valid_len, k)
    return topk.topk_select_pallas(scores, valid_len, k, interpret=interpret)


def _topk_select_xla(scores: jax.Array, valid_len: jax.Array, k: int) -> jax.Array:
    """The "xla" backend's top-k: when lowered for CPU the native kernel
    (`cpu_paged_attention.topk_select_cpu`, the same indices, unless `set_cpu_kernels(False)` or it
    could not be built), otherwise XLA's partial selection (`topk.topk_select_xla`)."""
    reference = functools.partial(topk.topk_select_xla, k=k)
    if _cpu_kernels and cpu_paged_attention.available():
        native = functools.partial(cpu_paged_attention.topk_select_cpu, k=k)
        return jax.lax.platform_dependent(scores, valid_len, cpu=native, default=reference)
    return reference(scores, valid_len)


def topk_select_fused(
    q_partial: jax.Array, k_partial: jax.Array, valid_len: jax.Array, k: int
) -> jax.Array:
    """topk_select of InfiniGen scores sum_g q_partial[r, g] · k_partial[r, n].
    q_partial: [R, G, d_p], k_partial: [R, N, d_p] -> i32[R, k]."""
    _check_k(k)
    if q_partial.ndim != 3 or k_partial.ndim != 3 or 0 in k_partial.shape:
        raise ValueError(f"{q_partial.shape=} must be [R, G, d_p], {k_partial.shape=} [R, N, d_p]")
    if q_partial.shape[0] != k_partial.shape[0] or q_partial.shape[2] != k_partial.shape[2]:
        raise ValueError(f"{q_partial.shape=} and {k_partial.shape=} disagree on R or d_p")
    _check_lengths("valid_len", valid_len, k_partial.shape[0])
    interpret = _kernel_mode()
    if interpret is None:
        return _topk_select_xla(topk.partial_scores_reference(q_partial, k_partial), valid_len, k)
    return topk.topk_select_fused_pallas(q_partial, k_partial, valid_len, k, interpret=interpret)


def split_reorder(
    kv_index: jax.Array, kv_mask: jax.Array, heads_per_batch: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """SmartGen Algorithm 1: rows of kv_index i32[R, k] stably sorted by kv_mask i8[B, N] value
    descending (remote 2, local 1, padding 0 -> -1); returns (reordered, remote_count,
    local_count). Row r belongs to request r // heads_per_batch."""
    if kv_index.ndim != 2 or kv_mask.ndim != 2:
        raise ValueError(f"{kv_index.shape=} must be [R, k] and {kv_mask.shape=} [B, N]")
    if not isinstance(heads_per_batch, int) or heads_per_batch < 1:
        raise ValueError(f"{heads_per_batch=} must be a positive int (H_kv)")
    rows, batch = kv_index.shape[0], kv_mask.shape[0]
    if rows != batch * heads_per_batch:
        raise ValueError(
            f"kv_index has {rows=} but kv_mask batch {batch} * {heads_per_batch=} = "
            f"{batch * heads_per_batch}; rows must be B*H_kv"
        )
    if not jnp.issubdtype(kv_index.dtype, jnp.integer):
        raise ValueError(f"{kv_index.dtype=} must be an integer type (i32)")
    interpret = _kernel_mode()
    if interpret is None:
        return split_reorder_mod.split_reorder_reference(kv_index, kv_mask, heads_per_batch)
    return split_reorder_mod.split_reorder_pallas(
        kv_index, kv_mask, heads_per_batch, interpret=interpret
    )


def sparse_decode_attention_partials(
    q: jax.Array,
    k_sel: jax.Array,
    v_sel: jax.Array,
    valid_count: jax.Array,
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out f32[B, H, D], lse f32[B, H]) of attention over the first valid_count[r] entries of
    each row of k_sel / v_sel [B*H_kv, k, D]; merge two lanes with `merge_partials`."""
    interpret = _kernel_mode()
    if interpret is None:
        return sparse_attention.sparse_decode_attention_partials_reference(
            q, k_sel, v_sel, valid_count, scale=scale
        )
    *_, group = sparse_attention._check_shapes(q, k_sel, v_sel, valid_count)
    if _mosaic_takes("sparse attention", "the Triton kernel", q.shape[-1], k_sel.dtype, group):
        return mosaic_attention.sparse_decode_attention_partials_mosaic(q, k_sel, v_sel, valid_count, scale=scale)
    return sparse_attention.sparse_decode_attention_partials_pallas(
        q, k_sel, v_sel, valid_count, scale=scale, interpret=interpret
    )


def sparse_decode_attention(
    q: jax.Array,
    k_sel: jax.Array,
    v_sel: jax.Array,
    valid_count: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Decode attention [B, H, D] (q's dtype) over the selected entries; rows with no valid
    entry give zeros. scale defaults to 1/sqrt(D)."""
    out, _ = sparse_decode_attention_partials(q, k_sel, v_sel, valid_count, scale=scale)
    return out.astype(q.dtype)


def paged_decode_attention_partials(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out f32[B, H, D], lse f32[B, H]) of request b's query heads over its first lengths[b]
    tokens in the paged KV cache [num_pages, H_kv, P, D] (token t: page page_table[b, t // P],
    slot t % P). The Mosaic kernel under "mosaic" (when it takes the shapes); there is no Triton
    paged kernel, so every other backend uses, when lowered for CPU, the native CPU kernel
    (`cpu_paged_attention`: f32 / bf16 pages, unless `set_cpu_kernels(False)` or it could not
    be built) and otherwise the XLA reference (a gather of the pages)."""
    group = q.shape[1] // max(1, k_pages.shape[1])
    if _mosaic_takes("paged attention", "the XLA reference", q.shape[-1], k_pages.dtype, group, k_pages.shape[2]):
        return mosaic_attention.paged_decode_attention_partials_mosaic(
            q, k_pages, v_pages, page_table, lengths, scale=scale
        )
    args = (q, k_pages, v_pages, page_table, lengths)
    reference = functools.partial(mosaic_attention.paged_decode_attention_partials_reference, scale=scale)
    if _cpu_kernels and cpu_paged_attention.supports(q, k_pages) and cpu_paged_attention.available():
        # Chosen per lowering platform, not by jax.default_backend(): a program exported for
        # "cuda" from this CPU host lowers only the reference, never the CPU custom call.
        native = functools.partial(cpu_paged_attention.paged_decode_attention_partials_cpu, scale=scale)
        return jax.lax.platform_dependent(*args, cpu=native, default=reference)
    return reference(*args)


def causal_prefill_attention(q: jax.Array, K: jax.Array, V: jax.Array, positions: jax.Array, lengths: jax.Array,
                             reference) -> jax.Array:
    """Causal prefill attention, `models.transformer.prefill_attention`'s contract (q [B, T, H, D],
    K, V [B, H_kv, T, D], positions i32[B, T], lengths i32[B] -> [B, T, H*D]): when lowered for
    CPU, the native kernel (`cpu_paged_attention.prefill_attention_cpu`: float32, D a multiple of
    16, unless `set_cpu_kernels(False)` or it could not be built); otherwise `reference(q, K, V,
    positions, lengths)` (the XLA formulation every other platform lowers)."""
    args = (q, K, V, positions, lengths)
    if _cpu_kernels and cpu_paged_attention.prefill_supports(q, K) and cpu_paged_attention.available():
        # Per lowering platform, as paged decode attention: a program exported for "cuda" lowers
        # only the reference.
        return jax.lax.platform_dependent(*args, cpu=cpu_paged_attention.prefill_attention_cpu, default=reference)
    return reference(*args)


def chunk_prefill_attention(q, k, v, K_pages, V_pages, page_table, start, lengths, reference) -> jax.Array:
    """A prefill chunk's attention over its paged context (`models.paged.chunk_attention`'s
    contract): when lowered for CPU, the native kernel (`cpu_paged_attention.chunk_attention_cpu`:
    float32 pages, D a multiple of 16, unless `set_cpu_kernels(False)` or it could not be built);
    otherwise `reference(q, k, v, K_pages, V_pages, page_table, start, lengths)`."""
    args = (q, k, v, K_pages, V_pages, page_table, start, lengths)
    if _cpu_kernels and cpu_paged_attention.prefill_supports(q, K_pages) and cpu_paged_attention.available():
        return jax.lax.platform_dependent(*args, cpu=cpu_paged_attention.chunk_attention_cpu, default=reference)
    return reference(*args)


def paged_gather(
    k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, kv_index: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The selected rows of the paged KV cache in selection order: (k_sel, v_sel) [B, H_kv, k, D].
    Row r = b*H_kv + h of kv_index i32[B*H_kv, k] names token positions t of request b, read
    from page page_table[b, t // P], slot t % P, head h of k_pages / v_pages
    [num_pages, H_kv, P, D]; a -1 reads the null page 0 (see `paged_gather` module docstring).
    The Triton kernel on a GPU backend, the XLA reference under "xla"."""
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"{k_pages.shape=} / {v_pages.shape=} ({k_pages.dtype}, {v_pages.dtype}) "
                         "must be one shape [num_pages, H_kv, P, D] and one dtype")
    if page_table.ndim != 2 or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table {page_table.shape} {page_table.dtype} must be i32[B, max_pages]")
    rows = page_table.shape[0] * k_pages.shape[1]
    if kv_index.ndim != 2 or kv_index.shape[0] != rows or not jnp.issubdtype(kv_index.dtype, jnp.integer):
        raise ValueError(f"kv_index {kv_index.shape} {kv_index.dtype} must be i32[B*H_kv = {rows}, k]")
    interpret = _kernel_mode()
    if interpret is not None:
        try:
            paged_gather_mod.check_cache_size(k_pages)
        except ValueError as exc:
            _log_fallback("paged gather", str(exc), "the XLA reference")
        else:
            return paged_gather_mod.paged_gather_pallas(k_pages, v_pages, page_table, kv_index,
                                                        interpret=interpret)
    return paged_gather_mod.paged_gather_reference(k_pages, v_pages, page_table, kv_index)
