"""topk_select / topk_select_fused kernels vs their pure-jnp references (exact index equality)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import topk

from .helpers import HYPOTHESIS_SETTINGS, INTERPRET, poison_beyond


@functools.partial(jax.jit, static_argnames="k")
def _kernel(scores, valid_len, k):
    return topk.topk_select_pallas(scores, valid_len, k, interpret=INTERPRET)


@functools.partial(jax.jit, static_argnames="k")
def _fused_kernel(q_partial, k_partial, valid_len, k):
    return topk.topk_select_fused_pallas(q_partial, k_partial, valid_len, k, interpret=INTERPRET)


_reference = jax.jit(topk.topk_select_reference, static_argnames="k")
_fused_reference = jax.jit(topk.topk_select_fused_reference, static_argnames="k")


def _assert_topk(scores, valid_len, k):
    scores, valid_len = jnp.asarray(scores), jnp.asarray(valid_len, jnp.int32)
    got = np.asarray(_kernel(scores, valid_len, k))
    want = np.asarray(_reference(scores, valid_len, k))
    np.testing.assert_array_equal(got, want)
    return got


def _adversarial_rows(n: int, k: int, rng: np.random.Generator):
    """Rows: random floats, integer ties, k > valid length, empty, constant, special values."""
    specials = np.array([np.inf, -np.inf, 0.0, -0.0, np.nan, 1.0, -1.0], np.float32)
    rows = [
        (rng.standard_normal(n), n),
        (rng.integers(-3, 4, n), n - 357),  # heavy ties; length not a chunk multiple
        (rng.standard_normal(n), k // 2),  # k > valid length: the rest is -1
        (rng.standard_normal(n), 0),  # nothing valid: all -1
        (np.full(n, 2.5), n),  # all equal: the first k positions in order
        (rng.choice(specials, n), n - 1),  # +-inf, +-0, NaN inside the valid range
        (rng.standard_normal(n), n + 1000),  # valid_len > N is clamped to N
    ]
    scores = np.stack([r[0] for r in rows]).astype(np.float32)
    valid_len = np.array([r[1] for r in rows], np.int32)
    return poison_beyond(scores, valid_len), valid_len  # NaN past the valid length


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_adversarial_rows_match_reference(dtype):
    n, k = 1500, 600  # N: two 1024-chunks, not a multiple; k: two 512-chunks, not a multiple
    scores, valid_len = _adversarial_rows(n, k, np.random.default_rng(0))
    got = _assert_topk(jnp.asarray(scores, dtype), valid_len, k)
    assert (got[3] == -1).all()
    np.testing.assert_array_equal(got[2, : k // 2] >= 0, True)
    np.testing.assert_array_equal(got[2, k // 2 :], -1)
    np.testing.assert_array_equal(got[4], np.arange(k))


def test_order_is_score_descending_ties_by_position():
    scores = np.array([[1.0, 3.0, 3.0, -np.inf, 2.0, 3.0, np.nan, 0.0, -0.0, 7.0]], np.float32)
    got = _assert_topk(scores, np.array([9]), 12)
    # 7 is past valid_len 9; NaN (valid) ranks below -inf; -0.0 ties +0.0 by position.
    np.testing.assert_array_equal(got[0], [1, 2, 5, 4, 0, 7, 8, 3, 6, -1, -1, -1])


def test_moderately_sized_row_spans_many_chunks():
    rng = np.random.default_rng(1)
    n, k = 20_000, 4_000  # 20 score chunks, 8 selection chunks
    scores = rng.standard_normal((2, n)).astype(np.float32)
    scores[1] = np.round(scores[1] * 4)  # many ties at the threshold
    _assert_topk(scores, np.array([n, 13_337]), k)


@settings(**HYPOTHESIS_SETTINGS)
@given(data=st.data())
def test_random_shapes_match_reference(data):
    rows = data.draw(st.integers(1, 3), label="rows")
    n = data.draw(st.integers(1, 300), label="n")
    k = data.draw(st.integers(1, 80), label="k")
    dtype = data.draw(st.sampled_from([jnp.float32, jnp.bfloat16]), label="dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    valid_len = rng.integers(0, n + 1, rows).astype(np.int32)
    if data.draw(st.booleans(), label="ties"):
        scores = rng.integers(-2, 3, (rows, n)).astype(np.float32)
    else:
        scores = rng.standard_normal((rows, n)).astype(np.float32)
    _assert_topk(jnp.asarray(poison_beyond(scores, valid_len), dtype), valid_len, k)


@pytest.mark.parametrize("group,k_dtype", [(1, jnp.bfloat16), (7, jnp.float32)])
def test_fused_matches_reference(group, k_dtype):
    rng = np.random.default_rng(group)
    rows, n, d_p, k = 3, 700, 19, 100  # d_p = 0.3 * 64 rounded: not a power of two
    # Small integers keep every dot exact in f32, so kernel and reference agree bit for bit
    # (any summation order) and the index comparison can be exact; ties are plentiful.
    q_partial = rng.integers(-2, 3, (rows, group, d_p)).astype(np.float32)
    k_partial = rng.integers(-2, 3, (rows, n, d_p)).astype(np.float32)
    valid_len = np.array([n, 333, 50], np.int32)  # row 2: k > valid length
    k_partial = jnp.asarray(poison_beyond(k_partial, valid_len), k_dtype)
    got = _fused_kernel(jnp.asarray(q_partial), k_partial, jnp.asarray(valid_len), k)
    want = _fused_reference(jnp.asarray(q_partial), k_partial, valid_len, k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_partial_scores_match_reference_on_floats():
    rng = np.random.default_rng(3)
    q_partial = jnp.asarray(rng.standard_normal((2, 7, 38)), jnp.float32)
    k_partial = jnp.asarray(rng.standard_normal((2, 300, 38)), jnp.float32)
    got = topk.partial_scores_pallas(q_partial, k_partial, interpret=INTERPRET)
    want = topk.partial_scores_reference(q_partial, k_partial)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_128k_token_row():
    rng = np.random.default_rng(4)
    n, k = 131_072, 26_215  # the longest rows the engine serves; k = 20%
    scores = poison_beyond(rng.standard_normal((1, n)).astype(np.float32), [n - 5])
    _assert_topk(jnp.asarray(scores, jnp.bfloat16), np.array([n - 5]), k)


_xla = jax.jit(topk.topk_select_xla, static_argnames="k")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_nan", [False, True])
def test_xla_backend_select_matches_reference(dtype, with_nan):
    """The "xla" backend's `lax.top_k` select against the sort: ties, +-inf, +-0, k > valid length,
    nothing valid, valid_len > N; a NaN inside the valid range takes the sort's branch."""
    n, k = 1500, 600
    scores, valid_len = _adversarial_rows(n, k, np.random.default_rng(5))
    if not with_nan:  # NaN only past the valid length (poisoned), where it must not matter
        scores = np.where(np.isnan(scores) & (np.arange(n)[None, :] < valid_len[:, None]), -np.inf, scores)
    scores = jnp.asarray(scores, dtype)
    for kk in (1, 77, k, n, n + 40):
        got = np.asarray(_xla(scores, jnp.asarray(valid_len), kk))
        np.testing.assert_array_equal(got, np.asarray(_reference(scores, jnp.asarray(valid_len), kk)))


@settings(**HYPOTHESIS_SETTINGS)
@given(data=st.data())
def test_xla_backend_select_matches_reference_on_random_rows(data):
    rows, n, k = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 300)), data.draw(st.integers(1, 320))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    valid_len = rng.integers(0, n + 2, rows).astype(np.int32)
    scores = rng.choice(np.array([np.inf, -np.inf, 0.0, -0.0, 1.0, -2.5, 3.0], np.float32), (rows, n))
    if data.draw(st.booleans(), label="nan"):
        scores[rng.random((rows, n)) < 0.05] = np.nan
    scores = jnp.asarray(scores, data.draw(st.sampled_from([jnp.float32, jnp.bfloat16]), label="dtype"))
    np.testing.assert_array_equal(np.asarray(_xla(scores, jnp.asarray(valid_len), k)),
                                  np.asarray(_reference(scores, jnp.asarray(valid_len), k)))


def test_dispatch_xla_backend_runs_the_top_k_select(monkeypatch):
    """Under "xla" without the native CPU kernels the dispatched select, plain and fused, is
    `topk_select_xla` (not the full sort); with them, the kernel (test_cpu_paged_attention.py)."""
    from pallas_kernels import dispatch
    calls, real = [], topk.topk_select_xla
    monkeypatch.setattr(topk, "topk_select_xla", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(6)
    scores = jnp.asarray(rng.standard_normal((3, 50)), jnp.float32)
    lengths = jnp.asarray([50, 20, 0], jnp.int32)
    with dispatch.backend("xla"), dispatch.cpu_kernels(False):
        got = dispatch.topk_select(scores, lengths, 10)
        fused = dispatch.topk_select_fused(scores[:, None, :1], scores[:, :, None], lengths, 10)
    assert len(calls) == 2
    want = np.argsort(-np.asarray(scores), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_reference(scores, lengths, 10)))
    np.testing.assert_array_equal(np.asarray(got)[0], want[0])
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(got))
    assert (np.asarray(got)[2] == -1).all()
