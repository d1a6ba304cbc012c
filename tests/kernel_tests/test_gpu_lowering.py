"""Every kernel lowers for CUDA (Pallas -> Triton) on this CPU-only machine, via jax.export.

Only the Triton custom-call safety check is disabled; an op the Triton lowering does not support
(sort, top_k, jnp gather, ...) raises during export, so these tests keep the GPU path honest where
no GPU exists. Shapes include the benchmark sizes and a 128K-token row.
"""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import paged_gather as pg
from pallas_kernels import sparse_attention as sa
from pallas_kernels import split_reorder as sr
from pallas_kernels import topk
from pallas_kernels._common import compiler_params, export_for_cuda, plgpu

TRITON_CALL = "__gpu$xla.gpu.triton"
I32 = jnp.int32


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _assert_lowers(fn, *args, launches: int):
    exported = export_for_cuda(fn, *args)
    assert exported.platforms == ("cuda",)
    module = exported.mlir_module()
    # The kernels really went through Triton (not silently through some XLA fallback).
    assert module.count(TRITON_CALL) == launches


@pytest.mark.parametrize(
    "rows,n,k,dtype",
    [(64, 32_768, 6_554, jnp.bfloat16), (8, 131_072, 26_215, jnp.float32), (3, 1000, 77, jnp.float32)],
)
def test_topk_lowers(rows, n, k, dtype):
    passes = 4 if dtype == jnp.bfloat16 else 8
    _assert_lowers(
        lambda s, v: topk.topk_select_pallas(s, v, k),
        _spec((rows, n), dtype),
        _spec((rows,), I32),
        launches=1 + passes,
    )


@pytest.mark.parametrize("group,d_p", [(1, 19), (7, 38)])
def test_topk_fused_lowers(group, d_p):
    rows, n, k = 16, 32_768, 6_554
    _assert_lowers(
        lambda q, kp, v: topk.topk_select_fused_pallas(q, kp, v, k),
        _spec((rows, group, d_p), jnp.bfloat16),
        _spec((rows, n, d_p), jnp.bfloat16),
        _spec((rows,), I32),
        launches=2 + 8,  # scores are f32: 8 radix passes
    )


@pytest.mark.parametrize("heads_per_batch", [1, 8])
def test_split_reorder_lowers(heads_per_batch):
    batch, n, k = 8, 131_072, 26_215
    _assert_lowers(
        lambda i, m: sr.split_reorder_pallas(i, m, heads_per_batch),
        _spec((batch * heads_per_batch, k), I32),
        _spec((batch, n), jnp.int8),
        launches=1,
    )


@pytest.mark.parametrize(
    "group,dtype,head_dim", [(1, jnp.bfloat16, 128), (7, jnp.float32, 64), (4, jnp.bfloat16, 128)]
)
def test_sparse_attention_lowers(group, dtype, head_dim):
    batch, kv_heads, k = 8, 8, 6_554
    rows = batch * kv_heads
    _assert_lowers(
        lambda q, ks, vs, c: sa.sparse_decode_attention_partials_pallas(q, ks, vs, c),
        _spec((batch, kv_heads * group, head_dim), dtype),
        _spec((rows, k, head_dim), dtype),
        _spec((rows, k, head_dim), dtype),
        _spec((rows,), I32),
        launches=1,
    )


@pytest.mark.parametrize(
    "page_size,head_dim,dtype,k", [(16, 128, jnp.bfloat16, 2_048), (16, 64, jnp.float32, 6_554), (64, 96, jnp.float16, 100)]
)
def test_paged_gather_lowers(page_size, head_dim, dtype, k):
    batch, kv_heads, num_pages, max_pages = 8, 8, 4096, 512
    cache = _spec((num_pages, kv_heads, page_size, head_dim), dtype)
    _assert_lowers(
        lambda kp, vp, t, i: pg.paged_gather_pallas(kp, vp, t, i),
        cache,
        cache,
        _spec((batch, max_pages), I32),
        _spec((batch * kv_heads, k), I32),
        launches=1,  # K and V in one launch
    )


def test_unsupported_op_fails_to_lower():
    """The check can fail: a kernel that sorts (no Triton lowering) must not export."""

    def sorting_kernel(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...])

    def call(x):
        return pl.pallas_call(
            sorting_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=compiler_params(),
        )(x)

    assert plgpu is not None
    with pytest.raises(NotImplementedError, match="Triton lowering: sort"):
        export_for_cuda(call, _spec((128,), jnp.float32))
