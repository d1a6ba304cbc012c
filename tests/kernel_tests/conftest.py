"""Kernel tests run in Pallas interpret mode on CPU unless JKV_KERNEL_MODE=compiled (GPU)."""
import jax
import pytest

from .helpers import INTERPRET


@pytest.fixture(scope="session", autouse=True)
def _kernel_mode_matches_device():
    # experiments/gpu_check.sh sets JKV_KERNEL_MODE=compiled; without a GPU that would test nothing.
    if not INTERPRET and jax.default_backend() != "gpu":
        pytest.fail(f"JKV_KERNEL_MODE=compiled needs a GPU; jax sees {jax.default_backend()!r}")
