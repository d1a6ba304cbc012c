"""Helpers shared by the Pallas kernels: Triton compiler params, pow-2 padding, GPU lowering check.

The kernels target the Pallas *Triton* backend (`jax.experimental.pallas.triton`): its masked and
indexed `load`/`store` are what a data-dependent select/scatter needs, and it lowers on a CPU jaxlib
(`export_for_cuda`), which keeps the GPU path checked on machines without a GPU. JAX 0.11 deprecates
the Triton backend in favour of Mosaic GPU (Hopper+); 0.12 still ships it, and `TRITON_AVAILABLE` is
False where a future JAX drops it (the dispatcher then says so once and uses the XLA references).
"""
from __future__ import annotations

import contextlib
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
    """Triton compiler params (warps per program, software-pipelining stages).

    They are passed explicitly so the backend never depends on a global flag: on JAX 0.10 a
    `pallas_call` without them lowers to Triton unless `jax_pallas_use_mosaic_gpu` is set (then
    Mosaic GPU); from 0.11 `pallas_call` on GPU is Triton only, and Mosaic GPU kernels are written
    with `plgpu.kernel`)."""
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


# What a CPU-only lowering targets: one H100/H200-class device (sm_90, 132 SMs).
TARGET_DEVICE_KIND = "NVIDIA H200"
TARGET_NUM_CORES = 132


def abstract_gpu_mesh() -> Any:
    """A one-device abstract mesh whose device is an H200, for lowering GPU kernels without a GPU.

    From JAX 0.11 the Pallas GPU lowerings read the target (compute capability, SM count) from the
    device and, with no GPU attached, from the abstract mesh's `AbstractDevice`; without one they
    raise "No supported GPU devices found". JAX 0.10 ignores it (it assumes a default GPU).
    """
    device = jax.sharding.AbstractDevice(
        device_kind=TARGET_DEVICE_KIND, num_cores=TARGET_NUM_CORES, platform="gpu"
    )
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def gpu_lowering_context() -> contextlib.AbstractContextManager:
    """Context in which `jax.export` / `.lower()` for CUDA works on a machine without a GPU.

    A real GPU backend needs nothing; otherwise the abstract H200 mesh above where this JAX has
    `AbstractDevice` (0.10.2 already does; 0.11+ requires it), else nothing.
    """
    if jax.default_backend() == "gpu" or not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(abstract_gpu_mesh())


def export_for_cuda(
    fn: Callable, *args: Any, custom_calls: tuple[str, ...] = ("__gpu$xla.gpu.triton",)
) -> jax.export.Exported:
    """Lower `fn(*args)` (args: arrays or ShapeDtypeStructs) for CUDA on any machine.

    Only the kernels' custom-call safety checks are disabled (Triton by default; Mosaic GPU's
    kernels pass theirs); any op a Pallas GPU lowering does not support raises here, so a
    CPU-only test catches kernels that would fail on the GPU.
    """
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with gpu_lowering_context():
        return jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in custom_calls],
        )(*avals)


def clamp_len(length: jax.Array, upper: int) -> jax.Array:
    """Clamp a per-row length to [0, upper] (lengths come from callers; never trust them for bounds)."""
    return jnp.clip(length.astype(jnp.int32), 0, upper)
