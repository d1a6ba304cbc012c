"""sparse_decode_attention kernel vs the dense masked-softmax reference; exact two-lane merges."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import sparse_attention as sa

from .helpers import HYPOTHESIS_SETTINGS, INTERPRET, poison_beyond

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@functools.partial(jax.jit, static_argnames=("num_splits", "scale"))
def _kernel(q, k_sel, v_sel, valid_count, num_splits=None, scale=None):
    return sa.sparse_decode_attention_partials_pallas(
        q, k_sel, v_sel, valid_count, num_splits=num_splits, scale=scale, interpret=INTERPRET
    )


_reference = jax.jit(sa.sparse_decode_attention_partials_reference, static_argnames="scale")


def _inputs(rng, batch, kv_heads, group, k, head_dim, valid_count, dtype, q_scale=1.0):
    rows = batch * kv_heads
    q = rng.standard_normal((batch, kv_heads * group, head_dim)) * q_scale
    k_sel = poison_beyond(rng.standard_normal((rows, k, head_dim)), valid_count)
    v_sel = poison_beyond(rng.standard_normal((rows, k, head_dim)), valid_count)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k_sel, dtype),
        jnp.asarray(v_sel, dtype),
        jnp.asarray(valid_count, jnp.int32),
    )


def _assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    (o, lse), (o_ref, lse_ref) = got, want
    assert not np.isnan(np.asarray(o)).any(), "NaN leaked from slots past valid_count"
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "group,dtype",
    [(1, jnp.float32), (3, jnp.float32), (7, jnp.float32), (7, jnp.bfloat16)],
)
def test_gqa_groups_match_reference(group, dtype):
    rng = np.random.default_rng(group)
    valid_count = np.array([200, 0, 65, 1])  # full, empty, one past a block, a single entry
    args = _inputs(rng, 2, 2, group, 200, 32, valid_count, dtype)  # k=200: not a block multiple
    got = _kernel(*args)
    _assert_close(got, _reference(*args), dtype)
    row_1 = np.asarray(got[0]).reshape(4, group, 32)[1]  # B=2, H_kv=2: row 1 = request 0, head 1
    np.testing.assert_array_equal(row_1, 0.0)
    assert np.isneginf(np.asarray(got[1]).reshape(4, group)[1]).all()


@pytest.mark.parametrize("num_splits", [1, 5])
def test_split_count_does_not_change_result(num_splits):
    rng = np.random.default_rng(10)
    valid_count = np.array([3000, 2049])  # moderately sized rows, several splits
    args = _inputs(rng, 1, 2, 4, 3000, 64, valid_count, jnp.float32)
    _assert_close(_kernel(*args, num_splits=num_splits), _reference(*args), jnp.float32)


def test_large_logits_are_stable():
    rng = np.random.default_rng(11)
    args = _inputs(rng, 1, 2, 3, 200, 32, np.array([200, 130]), jnp.float32, q_scale=300.0)
    got = _kernel(*args, scale=1.0)  # logits ~ 1e4: exp without the running max overflows
    assert np.isfinite(np.asarray(got[0])).all() and np.isfinite(np.asarray(got[1])).all()
    _assert_close(got, _reference(*args, scale=1.0), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_lanes_merge_exactly(dtype):
    """Remote entries attended in one call, local in another, merged == all entries at once."""
    rng = np.random.default_rng(12)
    batch, kv_heads, group, k, head_dim = 2, 2, 3, 200, 32
    rows = batch * kv_heads
    q, k_all, v_all, _ = _inputs(rng, batch, kv_heads, group, k, head_dim, [k] * rows, dtype)
    remote_count = np.array([0, 70, 200, 13])  # row 0: nothing remote; row 2: nothing local
    total = np.array([150, 200, 200, 0])  # row 3: nothing at all
    remote_k, remote_v, local_k, local_v = (np.full((rows, k, head_dim), np.nan) for _ in range(4))
    for r in range(rows):
        remote_k[r, : remote_count[r]] = k_all[r, : remote_count[r]]
        remote_v[r, : remote_count[r]] = v_all[r, : remote_count[r]]
        n_local = total[r] - min(remote_count[r], total[r])
        local_k[r, :n_local] = k_all[r, remote_count[r] : remote_count[r] + n_local]
        local_v[r, :n_local] = v_all[r, remote_count[r] : remote_count[r] + n_local]
    local_count = np.maximum(total - remote_count, 0)
    remote_count = np.minimum(remote_count, total)
    lanes = [
        _kernel(q, jnp.asarray(kk, dtype), jnp.asarray(vv, dtype), jnp.asarray(c, jnp.int32))
        for kk, vv, c in ((remote_k, remote_v, remote_count), (local_k, local_v, local_count))
    ]
    merged = sa.merge_partials(*lanes)
    whole = _reference(q, k_all, v_all, jnp.asarray(total, jnp.int32))
    _assert_close(merged, whole, dtype)


def test_merge_with_empty_lane_is_identity():
    o = jnp.asarray(np.random.default_rng(13).standard_normal((2, 3, 16)), jnp.float32)
    lse = jnp.asarray([[0.5, -2.0, -jnp.inf], [3.0, 1.0, 0.0]], jnp.float32)
    empty = (jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf))
    for merged_o, merged_lse in (sa.merge_partials((o, lse), empty), sa.merge_partials(empty, (o, lse))):
        np.testing.assert_array_equal(np.asarray(merged_lse), np.asarray(lse))
        want = np.where(np.isneginf(np.asarray(lse))[..., None], 0.0, np.asarray(o))
        np.testing.assert_allclose(np.asarray(merged_o), want, rtol=1e-6)


@settings(**HYPOTHESIS_SETTINGS)
@given(data=st.data())
def test_random_shapes(data):
    batch = data.draw(st.integers(1, 2), label="batch")
    kv_heads = data.draw(st.integers(1, 2), label="H_kv")
    group = data.draw(st.sampled_from([1, 3, 7]), label="group")
    k = data.draw(st.integers(1, 150), label="k")
    head_dim = data.draw(st.sampled_from([16, 32]), label="D")
    dtype = data.draw(st.sampled_from([jnp.float32, jnp.bfloat16]), label="dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    valid_count = rng.integers(0, k + 1, batch * kv_heads)
    args = _inputs(rng, batch, kv_heads, group, k, head_dim, valid_count, dtype)
    _assert_close(_kernel(*args), _reference(*args), dtype)


def test_128k_token_row():
    rng = np.random.default_rng(14)
    k = 26_215  # 20% of a 128K-token row
    args = _inputs(rng, 1, 1, 1, k, 16, np.array([k - 100]), jnp.float32)
    _assert_close(_kernel(*args), _reference(*args), jnp.float32)
