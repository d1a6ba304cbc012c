"""Quest's int8 page bounds: outward-rounded codes on a per-channel grid must still bound every
key's score (property test over random q and K), cost what float16 bounds of twice the page do,
and keep bounding after decode appends keys beyond the prompt's grid."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jkv.selection import get_selector
from jkv.selection.quest import INT8_LEVELS, dequantize_bounds, page_upper_bound, quantize_outward

H, H_KV, D = 4, 2, 8
LAYER = 5


def exact_page_max(q, K, length, page_size):
    """q: [B, H_kv, G, D], K: [B, H_kv, N, D] -> max over each page's real keys of q·k, f64[B, H_kv, G, P]."""
    scores = np.einsum("bhgd,bhnd->bhgn", q.astype(np.float64), K.astype(np.float64))[..., :length]
    pages = -(-length // page_size)
    return np.stack([scores[..., p * page_size:(p + 1) * page_size].max(-1) for p in range(pages)], -1)


@functools.cache
def int8_quest(page_size: int):
    """One selector per page size for the property test: each selector jits its own `prepare`, so a
    fresh one per example traced and compiled it again (~60 compiles for 15 examples)."""
    return get_selector("quest", metadata_dtype="int8", page_size=page_size)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31 - 1), length=st.integers(1, 41), page_size=st.integers(1, 4),
       log_scale=st.integers(-4, 4), outlier=st.booleans())
def test_int8_page_bound_dominates_every_key(seed, length, page_size, log_scale, outlier):
    rng = np.random.default_rng(seed)
    K = (rng.normal(size=(1, H_KV, 48, D)) * 10.0 ** log_scale).astype(np.float32)
    if outlier:  # one huge channel value: the rest of that channel sits on a coarse grid
        K[0, 0, rng.integers(length), rng.integers(D)] *= 1e3
    sel = int8_quest(page_size)
    meta = sel.prepare(LAYER, jnp.asarray(K), jnp.asarray([length]))
    assert meta["kmin"].dtype == meta["kmax"].dtype == jnp.int8
    q = rng.normal(size=(1, H_KV, H // H_KV, D)).astype(np.float32)
    q[..., rng.integers(D)] = 0.0  # zero channels must not produce NaN
    bound = np.asarray(page_upper_bound(jnp.asarray(q), *sel.bounds(meta)), np.float64)
    pages = -(-length // page_size)
    true_max = exact_page_max(q, K, length, page_size)
    assert np.isfinite(bound[..., :pages]).all()  # prompt keys always lie on the grid
    # The box holds every key exactly; only the float32 sum of D products may round (relative 1e-5).
    slack = 1e-5 * np.abs(q).sum(-1, keepdims=True) * np.abs(K).max()
    assert np.all(bound[..., :pages] >= true_max - slack)
    assert np.all(np.isneginf(bound[..., pages:]))  # empty pages


def test_int8_codes_are_outward_and_sentinels_saturate():
    scale = jnp.full((4,), 0.1, jnp.float32)
    x = jnp.asarray([0.3, -0.3, 100.0, -jnp.inf], jnp.float32)
    down, up = quantize_outward(x, scale, "down"), quantize_outward(x, scale, "up")
    step, values = np.float32(0.1), np.asarray(x)[:3]
    assert np.all(np.asarray(down, np.float32)[:3] * step <= values)
    assert np.all(np.asarray(up, np.float32)[:2] * step >= values[:2])
    assert int(down[2]) == INT8_LEVELS and int(up[2]) == INT8_LEVELS + 1  # beyond the grid: +inf up
    assert int(down[3]) == -INT8_LEVELS - 1 and int(up[3]) == -INT8_LEVELS - 1  # -inf / empty
    lo, hi = dequantize_bounds(down[None], up[None], scale[None])
    assert np.all(np.asarray(lo)[0, :3] <= np.asarray(x)[:3]) and np.all(np.asarray(hi)[0, :3] >= np.asarray(x)[:3])
    assert np.asarray(hi)[0, 2] == np.inf and np.asarray(lo)[0, 3] == -np.inf


def test_int8_append_keeps_bounding_keys_beyond_the_prompt_grid():
    rng = np.random.default_rng(7)
    K = rng.normal(size=(2, H_KV, 40, D)).astype(np.float32)
    K[:, :, 30:] *= 50.0  # decoded keys far beyond every prompt key: the sentinels take over
    sel = get_selector("quest", metadata_dtype="int8", page_size=2, max_ratio=0.3)
    lengths = np.asarray([24, 30])
    meta = sel.prepare(LAYER, jnp.asarray(K), jnp.asarray(lengths))
    for _ in range(8):
        meta = sel.append(LAYER, meta, jnp.asarray(K[np.arange(2), :, lengths]), jnp.asarray(lengths))
        lengths = lengths + 1
    lo, hi = (np.asarray(x, np.float64) for x in sel.bounds(meta))
    for b, n in enumerate(lengths):
        for p in range(-(-n // 2)):
            keys = K[b, :, 2 * p:min(n, 2 * p + 2)]
            assert np.all(lo[b, :, p] <= keys.min(1)) and np.all(hi[b, :, p] >= keys.max(1))
    assert np.isinf(hi).any()  # some appended channel did leave the grid
    # Pages with an unbounded score rank first; the selection stays a valid prefix.
    q = jnp.asarray(rng.normal(size=(2, H, D)).astype(np.float32))
    index = np.asarray(sel.select(LAYER, q, meta, jnp.asarray(lengths)))
    for row, n in zip(index, np.repeat(lengths, H_KV)):
        valid = row[row >= 0]
        assert len(valid) and valid.max() < n and np.all(row[len(valid):] == -1)


def test_int8_two_token_pages_cost_no_more_than_float16_four_token_pages():
    def nbytes(meta):
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(meta))

    K = jnp.asarray(np.random.default_rng(1).normal(size=(1, H_KV, 1024, 64)).astype(np.float32))
    lengths = jnp.asarray([1024])
    f16 = nbytes(get_selector("quest", metadata_dtype="float16", page_size=4).prepare(LAYER, K, lengths))
    i8 = nbytes(get_selector("quest", metadata_dtype="int8", page_size=2).prepare(LAYER, K, lengths))
    # kmin + kmax: 2·64 B per page and KV head either way; int8 adds the f32 grid (4·64 B per KV head).
    assert i8 - f16 == H_KV * 64 * 4
    assert i8 <= f16 * 1.01
