"""Paged decode attention on XLA:CPU as a native kernel (an XLA FFI custom call), no page gather.

    paged_decode_attention_partials_cpu(q: [B, H, D], k_pages, v_pages: [num_pages, H_kv, P, D],
                                        page_table: i32[B, max_pages], lengths: i32[B])
                                        -> (out f32[B, H, D], lse f32[B, H])

Same contract as `mosaic_attention.paged_decode_attention_partials_reference`. Why: that reference
gathers each request's pages into a contiguous copy (XLA:CPU's gather runs at about half a memcpy's
speed and cannot fuse into the products that read it), ~5 of the ~8 CPU-ms a layer of SmolLM2's
paged step at b=8 and 1K tokens (docs/performance.md, "Where decode time goes"). The kernel
(`cpu_paged_attention.cc`) walks each row's pages where they lie in the pool: K once for the
logits, V once for the weighted sum, nothing copied. It follows the reference's two-pass softmax,
so it differs from it only by float summation order and its own vectorized exp (measured
<= 1e-6; tests/kernel_tests/test_cpu_paged_attention.py).

The same source holds the causal prefill attentions (`prefill_attention_cpu`, `chunk_attention_cpu`)
and the top-k select of the "xla" backend (`topk_select_cpu`: XLA's own TopK is a partial sort
whose comparator converts both floats on every comparison; this one keys each candidate once and
runs nth_element, the same indices; docs/kernels.md, "CPU top-k").

Build: the C++ source is compiled once per (source, compiler flags, jaxlib, CPU) with the system's
C++ compiler (`$CXX`, default `c++`; `-O3 -march=native`) against jaxlib's XLA FFI headers, into
`$JKV_CACHE_DIR` (default `~/.cache/jkv`), and registered as an FFI target for the "cpu" platform.
`available()` says whether that worked; when it did not (no compiler, no headers, not Linux /
macOS), it logs the reason once and `pallas_kernels.dispatch` keeps the XLA reference.
Concurrent first builds (pytest-xdist workers) each compile to a private file and rename it into
place, so a reader never sees a half-written library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "jkv_paged_decode_attention"
SYMBOL = "JkvPagedDecodeAttention"
PREFILL_TARGET = "jkv_prefill_attention"
PREFILL_SYMBOL = "JkvPrefillAttention"
CHUNK_TARGET = "jkv_chunk_attention"
CHUNK_SYMBOL = "JkvChunkAttention"
TOPK_TARGET = "jkv_topk_select"
TOPK_SYMBOL = "JkvTopkSelect"
# -fopenmp-simd: the `#pragma omp simd reduction` dot products vectorize without -ffast-math
# (which would let the compiler reorder every float sum, not only the ones marked).
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
DTYPES = (jnp.float32, jnp.bfloat16)


def cache_dir() -> Path:
    """Where built libraries go: `$JKV_CACHE_DIR/cpu_kernels` (default `~/.cache/jkv/cpu_kernels`),
    the directory `models.loader` keeps converted params in."""
    return Path(os.environ.get("JKV_CACHE_DIR", Path.home() / ".cache" / "jkv")) / "cpu_kernels"


def _cpu_signature() -> str:
    # -march=native code runs only where it was built: a shared cache dir (NFS home) must not hand
    # one CPU's library to another, so the CPU's feature flags are part of the key.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor() + platform.machine()


def _build(compiler: str) -> Path:
    include = Path(jax.ffi.include_dir())
    if not (include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise FileNotFoundError(f"jaxlib has no XLA FFI headers under {include}")
    import jaxlib

    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join((compiler, *FLAGS)).encode(),
                                     jaxlib.__version__.encode(), _cpu_signature().encode()])).hexdigest()[:16]
    out = cache_dir() / f"cpu_paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-I", str(include), str(SOURCE), "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def available() -> bool:
    """Build (first call in a cache dir), load and register the kernel; False, with one warning
    naming the reason, when any step fails."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    try:
        if compiler is None:
            raise FileNotFoundError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not on PATH)")
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, SYMBOL)), platform="cpu")
        for target, symbol in ((PREFILL_TARGET, PREFILL_SYMBOL), (CHUNK_TARGET, CHUNK_SYMBOL),
                               (TOPK_TARGET, TOPK_SYMBOL)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, AttributeError, subprocess.SubprocessError, ValueError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("CPU kernels unavailable (%s); paged decode uses the XLA gather reference, prefill "
                    "attention XLA's blocked loop, the top-k XLA's TopK",
                    str(detail).strip()[-2000:])
        return False
    log.info("CPU paged attention kernel loaded (%s)", TARGET)
    return True


def supports(q: jax.Array, k_pages: jax.Array) -> bool:
    """Whether the kernel takes these operands (pages f32 or bf16, H a multiple of H_kv)."""
    return (k_pages.ndim == 4 and q.ndim == 3 and any(k_pages.dtype == d for d in DTYPES)
            and q.shape[2] == k_pages.shape[3] and q.shape[1] % max(1, k_pages.shape[1]) == 0)


def paged_decode_attention_partials_cpu(q, k_pages, v_pages, page_table, lengths, *, scale: float | None = None,
                                        max_threads: int = 0):
    """(out f32[B, H, D], lse f32[B, H]); see the module docstring. Call only when `available()`
    and `supports(q, k_pages)`; lowers for the "cpu" platform only. The B x H_kv rows are split
    over at most `max_threads` threads of XLA's intra-op pool (0: all of them) when there are
    enough tokens to pay for a task (~16K key-heads each); results do not depend on it."""
    batch, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out_types = (jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads), jnp.float32))
    return jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")(
        q.astype(jnp.float32), k_pages, v_pages.astype(k_pages.dtype), page_table.astype(jnp.int32),
        lengths.astype(jnp.int32), scale=np.float32(scale), max_threads=np.int64(max_threads))


def prefill_supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether the prefill kernels take these operands: float32 q [B, T, H, D] and float32 keys
    with KV heads on axis 1 and D last (`prefill_attention_cpu`'s K [B, H_kv, N, D],
    `chunk_attention_cpu`'s pages [num_pages, H_kv, P, D]), H a multiple of H_kv, D a multiple of 16
    up to 256."""
    return (q.ndim == 4 and k.ndim == 4 and q.dtype == jnp.float32 and k.dtype == jnp.float32
            and q.shape[3] == k.shape[3] and q.shape[3] % 16 == 0 and q.shape[3] <= 256
            and q.shape[2] % max(1, k.shape[1]) == 0)


def prefill_attention_cpu(q, k, v, positions, lengths, *, scale: float | None = None, max_threads: int = 0):
    """Causal prefill attention, the contract of `models.transformer.prefill_attention`: q
    f32[B, T, H, D], k, v f32[B, H_kv, N, D] (N = T there), positions i32[B, T] (query t of row b sees keys
    j <= positions[b, t] and j < lengths[b]), lengths i32[B] -> f32[B, T, H*D] (zeros for a query
    that sees no key). Call only when `available()` and `prefill_supports(q, k)`; lowers for the
    "cpu" platform only. Query tiles are split over at most `max_threads` threads of XLA's intra-op
    pool (0: all); results do not depend on it."""
    batch, tokens, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")(
        q, k, v.astype(k.dtype), positions.astype(jnp.int32), lengths.astype(jnp.int32),
        scale=np.float32(scale), max_threads=np.int64(max_threads))
    return out.reshape(batch, tokens, heads * head_dim)


def chunk_attention_cpu(q, k, v, k_pages, v_pages, page_table, start, lengths, *, scale: float | None = None,
                        max_threads: int = 0):
    """A prefill chunk's causal attention over its paged context, the contract of
    `models.paged.chunk_attention`: q f32[B, C, H, D]; k, v f32[B, C, H_kv, D] (the chunk);
    k_pages, v_pages f32[num_pages, H_kv, P, D]; page_table i32[B, max_pages] (position
    t < start[b] is page page_table[b, t // P], clipped into the pool, slot t % P); start, lengths
    i32[B] (chunk token j is at position start[b] + j, valid for j < lengths[b]) -> f32[B, C, H*D].
    The context is read from the pages up to start[b] only (the kernel copies those keys into a
    scratch once per call, K in panels, V as rows). Call only when `available()` and
    `prefill_supports(q, k_pages)`; lowers for "cpu" only."""
    batch, tokens, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = jax.ffi.ffi_call(CHUNK_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")(
        q, k.astype(jnp.float32), v.astype(jnp.float32), k_pages, v_pages.astype(k_pages.dtype),
        page_table.astype(jnp.int32), start.astype(jnp.int32), lengths.astype(jnp.int32),
        scale=np.float32(scale), max_threads=np.int64(max_threads))
    return out.reshape(batch, tokens, heads * head_dim)


def topk_select_cpu(scores, valid_len, k: int):
    """`pallas_kernels.topk.topk_select_reference`'s contract (scores f32|bf16[R, N], valid_len
    i32[R] -> i32[R, k]: by descending score, -0 tying +0, ties and NaNs by lower index, NaNs after
    every number, -1 past min(k, valid_len[r])), the same indices bit for bit, in linear time a row
    (nth_element, then a sort of the k). Call only when `available()`; lowers for "cpu" only."""
    rows = scores.shape[0]
    return jax.ffi.ffi_call(TOPK_TARGET, jax.ShapeDtypeStruct((rows, k), jnp.int32), vmap_method="sequential")(
        scores.astype(jnp.float32), valid_len.astype(jnp.int32), k=np.int64(k))
