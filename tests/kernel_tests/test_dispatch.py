"""dispatch: backend choice, input validation, and the SmartGen decode pipeline through both backends."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.topk import topk_select_reference

from .helpers import INTERPRET

KERNEL_BACKEND = "interpret" if INTERPRET else "pallas"


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = dispatch.get_backend()
    yield
    dispatch.set_backend(previous)


def test_auto_resolves_by_platform():
    dispatch.set_backend("auto")
    if jax.default_backend() != "gpu":
        want = "xla"
    else:  # Mosaic GPU attention on sm_90+, Triton kernels on older GPUs
        capability = dispatch._compute_capability(jax.devices()[0])
        want = "mosaic" if capability >= (9, 0) else "pallas"
    assert dispatch.resolved_backend() == want


def test_unknown_backend_is_rejected_with_the_name():
    with pytest.raises(ValueError, match="'triton'"):
        dispatch.set_backend("triton")


def test_context_manager_restores_even_on_error():
    dispatch.set_backend("xla")
    with pytest.raises(RuntimeError, match="boom"):
        with dispatch.backend("interpret"):
            assert dispatch.resolved_backend() == "interpret"
            raise RuntimeError("boom")
    assert dispatch.get_backend() == "xla"


def _sparse_attention(q_shape, valid_rows):
    rows = jnp.zeros((4, 8, 16))
    return dispatch.sparse_decode_attention(jnp.zeros(q_shape), rows, rows, jnp.zeros((valid_rows,), jnp.int32))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: dispatch.topk_select(jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32), 0), "k=0"),
        (lambda: dispatch.topk_select(jnp.zeros((2, 8)), jnp.zeros((3,), jnp.int32), 4), "valid_len"),
        (lambda: dispatch.topk_select(jnp.zeros((8,)), jnp.zeros((1,), jnp.int32), 4), "scores.shape"),
        (
            lambda: dispatch.topk_select_fused(
                jnp.zeros((2, 3, 5)), jnp.zeros((2, 8, 6)), jnp.zeros((2,), jnp.int32), 4
            ),
            "d_p",
        ),
        (
            lambda: dispatch.split_reorder(
                jnp.zeros((5, 4), jnp.int32), jnp.zeros((2, 8), jnp.int8), 3
            ),
            "B\\*H_kv",
        ),
        # q [B, H, D] and valid_count [rows] against k_sel, v_sel [4, 8, 16]
        (functools.partial(_sparse_attention, (2, 5, 16), 4), "multiple of H_kv"),
        (functools.partial(_sparse_attention, (2, 4, 16), 2), "valid_count"),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _decode_layer(q, k_partial, keys, values, valid_len, kv_mask, k):
    """One SmartGen decode layer (§4.2): select -> split/reorder -> two lanes -> merge.

    q: [B, H, D]; k_partial: [B*H_kv, N, d_p]; keys/values: [B*H_kv, N, D]; kv_mask: i8[B, N].
    """
    batch, heads, head_dim = q.shape
    rows = keys.shape[0]
    kv_heads, group = rows // batch, heads // (rows // batch)
    q_partial = q.reshape(rows, group, head_dim)[..., : k_partial.shape[-1]]
    kv_index = dispatch.topk_select_fused(q_partial, k_partial, valid_len, k)
    reordered, remote_count, local_count = dispatch.split_reorder(kv_index, kv_mask, kv_heads)
    # The remote lane receives the first remote_count entries of each row contiguously; the local
    # lane gathers the rest from the host pool. Here both gather from the same full cache.
    slot = jnp.arange(k)[None, :]
    remote_index = jnp.where(slot < remote_count[:, None], reordered, 0)
    local_index = jnp.take_along_axis(
        reordered, jnp.clip(slot + remote_count[:, None], 0, k - 1), axis=1
    )
    gather = jax.vmap(lambda cache, idx: cache[jnp.maximum(idx, 0)])
    remote = dispatch.sparse_decode_attention_partials(
        q, gather(keys, remote_index), gather(values, remote_index), remote_count
    )
    local = dispatch.sparse_decode_attention_partials(
        q, gather(keys, local_index), gather(values, local_index), local_count
    )
    merged, _ = dispatch.merge_partials(remote, local)
    # One lane over all loaded entries (remote then local are the first r+l slots) must agree.
    loaded = remote_count + local_count
    single = dispatch.sparse_decode_attention(
        q, gather(keys, reordered), gather(values, reordered), loaded
    )
    return kv_index, reordered, merged, single


def test_decode_pipeline_kernels_match_references():
    rng = np.random.default_rng(0)
    batch, kv_heads, group, n, head_dim, d_p, k = 2, 3, 3, 300, 32, 10, 60
    rows = batch * kv_heads
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim)), jnp.float32)
    # Integer partial keys/queries: exact scores, so both backends select identical entries.
    q = q.at[..., :d_p].set(jnp.round(q[..., :d_p] * 2))
    k_partial = jnp.asarray(rng.integers(-2, 3, (rows, n, d_p)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((rows, n, head_dim)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((rows, n, head_dim)), jnp.float32)
    valid_len = jnp.asarray([300, 41, 300, 200, 200, 200], jnp.int32)  # row 1: k > valid_len
    kv_mask = jnp.asarray(rng.integers(0, 3, (batch, n)), jnp.int8)
    kv_mask = kv_mask.at[1, 150:].set(0)  # request 1: padding tail

    results = {}
    for name in ("xla", KERNEL_BACKEND):
        with dispatch.backend(name):
            # A fresh function object per backend: jit caches traces per function, and the
            # backend is read at trace time.
            layer = jax.jit(functools.partial(_decode_layer), static_argnames="k")
            assert ("pallas_call" in str(layer.trace(q, k_partial, keys, values, valid_len,
                                                     kv_mask, k=k).jaxpr)) == (name != "xla")
            results[name] = layer(q, k_partial, keys, values, valid_len, kv_mask, k=k)
    want, got = results["xla"], results[KERNEL_BACKEND]
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # Two lanes merged == one lane over the same entries (merge is exact).
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(got[3]), rtol=1e-5, atol=1e-5)
    assert (np.asarray(got[0])[1, 41:] == -1).all()


def test_attention_output_keeps_query_dtype():
    args = (
        jnp.ones((1, 2, 16), jnp.bfloat16),
        jnp.ones((2, 8, 16), jnp.bfloat16),
        jnp.ones((2, 8, 16), jnp.bfloat16),
        jnp.asarray([8, 3], jnp.int32),
    )
    with dispatch.backend("xla"):
        assert dispatch.sparse_decode_attention(*args).dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU with a CUDA jax")
def test_auto_runs_compiled_kernels_on_gpu():
    dispatch.set_backend("auto")
    assert dispatch.resolved_backend() in ("mosaic", "pallas")
    scores = jnp.asarray(np.random.default_rng(0).standard_normal((4, 5000)), jnp.bfloat16)
    valid_len = jnp.asarray([5000, 17, 0, 4097], jnp.int32)
    select = jax.jit(functools.partial(dispatch.topk_select, k=1000))
    assert "pallas_call" in str(select.trace(scores, valid_len).jaxpr)
    got = select(scores, valid_len)
    assert got.devices().pop().platform == "gpu"
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(topk_select_reference(scores, valid_len, 1000))
    )
