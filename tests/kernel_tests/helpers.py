"""Shared settings and input builders for the kernel tests."""
import os

import numpy as np

KERNEL_MODE = os.environ.get("JKV_KERNEL_MODE", "interpret")
if KERNEL_MODE not in ("interpret", "compiled"):
    raise ValueError(f"JKV_KERNEL_MODE={KERNEL_MODE!r} must be 'interpret' or 'compiled'")
INTERPRET = KERNEL_MODE == "interpret"

# Hypothesis: every new shape recompiles the interpreted kernels (~1-2 s), so few examples.
HYPOTHESIS_SETTINGS = dict(max_examples=4, deadline=None, derandomize=True)


def poison_beyond(array: np.ndarray, lengths: np.ndarray, value: float = np.nan) -> np.ndarray:
    """Copy of array [R, L, ...] with slots >= lengths[r] set to value, so OOB reads show."""
    out = np.array(array, copy=True)
    for row, length in enumerate(lengths):
        out[row, max(int(length), 0):] = value
    return out
