"""split_reorder kernel (SmartGen Algorithm 1) vs its reference: exact equality of all outputs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import split_reorder as sr

from .helpers import HYPOTHESIS_SETTINGS, INTERPRET


@functools.partial(jax.jit, static_argnames="heads_per_batch")
def _kernel(kv_index, kv_mask, heads_per_batch):
    return sr.split_reorder_pallas(kv_index, kv_mask, heads_per_batch, interpret=INTERPRET)


_reference = jax.jit(sr.split_reorder_reference, static_argnames="heads_per_batch")


def _assert_matches(kv_index, kv_mask, heads_per_batch):
    kv_index, kv_mask = jnp.asarray(kv_index, jnp.int32), jnp.asarray(kv_mask, jnp.int8)
    got = [np.asarray(x) for x in _kernel(kv_index, kv_mask, heads_per_batch)]
    want = [np.asarray(x) for x in _reference(kv_index, kv_mask, heads_per_batch)]
    for name, g, w in zip(("reordered", "remote_count", "local_count"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    return got


def _check_invariants(kv_index, kv_mask, heads_per_batch, reordered, remote, local):
    """Independent of the reference: a stable partition remote | local | padding (-1)."""
    for row in range(kv_index.shape[0]):
        values = kv_mask[row // heads_per_batch]
        entries = [i for i in kv_index[row] if 0 <= i < values.shape[0]]
        want_remote = [i for i in entries if values[i] == 2]
        want_local = [i for i in entries if values[i] == 1]
        pad = kv_index.shape[1] - len(want_remote) - len(want_local)
        assert remote[row] == len(want_remote) and local[row] == len(want_local)
        np.testing.assert_array_equal(reordered[row], want_remote + want_local + [-1] * pad)


@pytest.mark.parametrize("heads_per_batch", [1, 3, 7])
def test_adversarial_rows(heads_per_batch):
    rng = np.random.default_rng(heads_per_batch)
    batch, n, k = 4, 1000, 700  # k: two 512-chunks, not a multiple
    kv_mask = np.stack(
        [
            rng.integers(0, 3, n),  # mixed
            np.full(n, 1),  # all local
            np.full(n, 2),  # all remote
            np.zeros(n),  # all padding
        ]
    ).astype(np.int8)
    kv_index = rng.integers(0, n, (batch * heads_per_batch, k)).astype(np.int32)
    kv_index[:, -50:] = -1  # selection sentinel
    kv_index[0, :4] = [n, n + 7, -5, 2**31 - 1]  # out-of-range indices count as padding
    got = _assert_matches(kv_index, kv_mask, heads_per_batch)
    _check_invariants(kv_index, kv_mask, heads_per_batch, *got)
    reordered, remote, local = got
    per_request = np.repeat(np.arange(batch), heads_per_batch)
    assert (remote[per_request == 1] == 0).all() and (local[per_request == 2] == 0).all()
    assert (reordered[per_request == 3] == -1).all()


def test_unknown_mask_values_are_padding():
    kv_mask = np.array([[0, 1, 2, 3, -1, 5, 2, 1]], np.int8)
    kv_index = np.array([[7, 6, 5, 4, 3, 2, 1, 0, -1]], np.int32)
    reordered, remote, local = _assert_matches(kv_index, kv_mask, 1)
    np.testing.assert_array_equal(reordered[0], [6, 2, 7, 1, -1, -1, -1, -1, -1])
    assert remote[0] == 2 and local[0] == 2


@settings(**HYPOTHESIS_SETTINGS)
@given(data=st.data())
def test_random_shapes(data):
    batch = data.draw(st.integers(1, 3), label="batch")
    heads_per_batch = data.draw(st.sampled_from([1, 3, 7]), label="H_kv")
    n = data.draw(st.integers(1, 400), label="n")
    k = data.draw(st.integers(1, 600), label="k")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    kv_mask = rng.integers(0, 3, (batch, n)).astype(np.int8)
    kv_index = rng.integers(-1, n, (batch * heads_per_batch, k)).astype(np.int32)
    got = _assert_matches(kv_index, kv_mask, heads_per_batch)
    _check_invariants(kv_index, kv_mask, heads_per_batch, *got)


def test_128k_token_rows():
    rng = np.random.default_rng(5)
    n, k = 131_072, 26_215
    kv_mask = rng.integers(0, 3, (1, n)).astype(np.int8)
    kv_index = rng.permutation(n)[: 2 * k].reshape(2, k).astype(np.int32)  # 2 KV heads
    kv_index[1, -1000:] = -1
    _assert_matches(kv_index, kv_mask, 2)
