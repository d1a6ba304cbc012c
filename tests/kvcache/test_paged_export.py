"""The whole dense paged decode step lowers for CUDA on this CPU-only machine (`jax.export`,
platforms=["cuda"]): the real programs `Model.paged_decode_step` runs (compute: embed, every
layer's projections, paged attention through `pallas_kernels.dispatch`, MLP, logits; write: the
page scatter) — not only the attention kernel.

Under dispatch backend "mosaic" (what "auto" picks on Hopper) a bf16 model with head dim 64
(128-byte rows) and page size 16 takes the Mosaic GPU paged attention kernel, which jax 0.10.2
exports on CPU; the test checks its custom call is in the module, so a silent fall back to the
XLA gather would fail it. The f32 model exports with the XLA paths ("xla": no custom call at all).
Chunked prefill (XLA only) exports too. Parameters and cache travel as abstract values, so the
module is the step program itself, with no weights baked in.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from models import paged, tiny_config
from models.transformer import init_params
from pallas_kernels import dispatch, mosaic_attention
from pallas_kernels._common import gpu_lowering_context

B, MAX_PAGES, NUM_PAGES, P = 4, 8, 40, 16
MOSAIC_CALL = "@mosaic_gpu_v2("  # the custom call of a Mosaic GPU kernel launch


def _avals(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _export(fn, *args):
    with gpu_lowering_context():
        return jax.export.export(fn, platforms=["cuda"])(*args)


def _step_args(cfg):
    params = _avals(jax.eval_shape(lambda: init_params(cfg)))
    kv = _avals(jax.eval_shape(lambda: paged.init_pages(cfg, NUM_PAGES, P)))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return params, kv, i32(B, MAX_PAGES), i32(B), i32(B)


@pytest.mark.parametrize("dtype,backend", [("bfloat16", "mosaic"), ("float32", "xla")])
def test_dense_paged_decode_step_exports_for_cuda(dtype, backend):
    if backend == "mosaic" and not mosaic_attention.MOSAIC_AVAILABLE:
        pytest.skip(f"jax {jax.__version__} has no Mosaic GPU Pallas")
    cfg = tiny_config("llama", head_dim=64, dtype=dtype)
    params, kv, table, tokens, positions = _step_args(cfg)
    with dispatch.backend(backend):  # read at trace time: fresh jits below
        compute = _export(jax.jit(functools.partial(paged.paged_decode_step_compute, cfg)),
                          params, kv, table, tokens, positions)
    new_kv = jax.ShapeDtypeStruct((cfg.num_layers, B, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(dtype))
    write = _export(jax.jit(paged.paged_write, donate_argnums=(0,)), kv, table, positions, new_kv, new_kv)
    assert compute.platforms == write.platforms == ("cuda",)
    assert compute.out_avals[0].shape == (B, cfg.vocab_size)
    assert [a.shape for a in write.out_avals] == [(NUM_PAGES, cfg.num_kv_heads, P, cfg.head_dim)] * 2 * cfg.num_layers
    module = compute.mlir_module()
    # One paged attention kernel launch a layer under Mosaic; none when the XLA reference runs.
    assert module.count(MOSAIC_CALL) == (cfg.num_layers if backend == "mosaic" else 0)


def test_chunked_prefill_exports_for_cuda():
    cfg = tiny_config("qwen3", head_dim=64, dtype="bfloat16")
    params, kv, table, start, lengths = _step_args(cfg)
    tokens = jax.ShapeDtypeStruct((B, 32), jnp.int32)
    exported = _export(jax.jit(functools.partial(paged.prefill_chunk_compute, cfg)),
                       params, kv, table, tokens, start, lengths)
    assert exported.out_avals[1].shape == (cfg.num_layers, B, cfg.num_kv_heads, 32, cfg.head_dim)
