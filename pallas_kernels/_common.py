"""Helpers shared by the Pallas kernels: Triton compiler params, pow-2 padding, GPU lowering check.

The kernels target the Pallas *Triton* backend (`jax.experimental.pallas.triton`): its masked and
indexed `load`/`store` are what a data-dependent select/scatter needs, and it lowers on a CPU jaxlib
(`export_for_cuda`), which keeps the GPU path checked on machines without a GPU. JAX 0.11 deprecates
the Triton backend in favour of Mosaic GPU; it still ships it, and `TRITON_AVAILABLE` is False where
a future JAX drops it (the dispatcher then says so once and uses the XLA references).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

try:  # The Triton backend is deprecated since JAX 0.11 (still present there).
    from jax.experimental.pallas import triton as plgpu

    TRITON_AVAILABLE = True
except ImportError as exc:  # pragma: no cover - depends on the installed JAX
    plgpu = None
    TRITON_AVAILABLE = False
    log.warning("Pallas Triton backend unavailable (%s); only XLA references can run", exc)

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton tensors must have power-of-two sizes)."""
    return 1 << max(0, int(n) - 1).bit_length()


def compiler_params(num_warps: int = 4, num_stages: int = 1) -> Any:
    """Triton compiler params; passing them explicitly also selects the Triton backend
    (JAX 0.10+ defaults `pallas_call` on GPU to Mosaic GPU when none are given)."""
    if plgpu is None:  # pragma: no cover
        raise RuntimeError("jax.experimental.pallas.triton is not available in this JAX")
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def masked_scatter_index(index: jax.Array, mask: jax.Array, size: int) -> jax.Array:
    """Index for `plgpu.store(ref.at[index], v, mask=mask)` with masked-off lanes sent out of bounds.

    On the GPU the mask alone protects those lanes. In interpret mode a masked store is a
    read-modify-write scatter (`ref.at[idx].set`), so a masked lane that aliases a live lane's slot
    could write the old value back over it; out-of-bounds updates are dropped instead.
    """
    return jnp.where(mask, index, size)


def export_for_cuda(fn: Callable, *args: Any) -> jax.export.Exported:
    """Lower `fn(*args)` (args: arrays or ShapeDtypeStructs) for CUDA on any machine.

    Only the Triton custom-call safety check is disabled; any op the Pallas Triton lowering does
    not support raises here, so a CPU-only test catches kernels that would fail on the GPU.
    """
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*avals)


def clamp_len(length: jax.Array, upper: int) -> jax.Array:
    """Clamp a per-row length to [0, upper] (lengths come from callers; never trust them for bounds)."""
    return jnp.clip(length.astype(jnp.int32), 0, upper)
