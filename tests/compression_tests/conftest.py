"""Fixtures for compression tests: small KV-like blocks with channel outliers (as real keys have)."""
import numpy as np
import pytest

H_KV, NB, D = 3, 40, 64  # NB not a multiple of the group sizes used: exercises padding


def kv_like(seed: int = 0, shape=(H_KV, NB, D), dtype=np.float16) -> np.ndarray:
    """Random block [H_kv, Nb, D] with per-channel scales spanning 25x and a smooth token trend."""
    rng = np.random.default_rng(seed)
    h, n, d = shape
    channel_scale = np.linspace(0.2, 5.0, d)[rng.permutation(d)]
    trend = np.cumsum(rng.standard_normal((h, n, d)) * 0.1, axis=1)
    return ((rng.standard_normal((h, n, d)) + trend) * channel_scale).astype(dtype)


def random_prompts(model, lengths, seed: int) -> list[list[int]]:
    """One prompt of token ids in [3, vocab) (above the special ids) per length, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in lengths]


@pytest.fixture
def block() -> np.ndarray:
    return kv_like()
