"""The SmartGen decode worker's fused per-layer program (jkv/disagg/decode_program.py: the
layer's q, k, v and the new token's page write → select on the device → split_reorder against
the paged KV mask → gather of the selected rows from the pages → attention → MLP) lowers for
CUDA on this CPU-only machine (`jax.export`, platforms=["cuda"]), with the selector inside it,
not only the kernels; so do the programs of a layer with remote rows (`landed`: the arrived and
prefetched rows scattered into their pages first; `attend_landed`: a true miss's second program).

Under dispatch backend "mosaic" (what "auto" picks on Hopper) a bf16 model with head dim 64 takes
the Mosaic GPU sparse attention kernel and the Triton top-k, split and paged-gather kernels: the
test counts their custom calls, so a silent fall back to XLA fails it. Under "xla" (CPU) the module has no
custom call. Parameters, pages and metadata travel as abstract values (no weights baked in).
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from jkv.disagg import decode_pages, decode_program
from jkv.kvcache import sparse
from jkv.selection import get_selector
from jkv.selection.simple import Oracle, OracleConfig
from models import paged, tiny_config
from models.transformer import init_params
from pallas_kernels import dispatch, mosaic_attention
from pallas_kernels._common import gpu_lowering_context

B, NUM_PAGES, P, CAPACITY = 4, 64, 16, 256
MOSAIC_CALL = "@mosaic_gpu_v2("
TRITON_CALL = "__gpu$xla.gpu.triton"
GATHER_KERNEL = 'name = "paged_gather"'  # the Triton call's backend config names its kernel


def _export(fn, *args):
    """jax.export for CUDA of fn(*args) (pytrees of abstract values); only Triton's custom-call
    safety check is disabled (Mosaic's kernels pass theirs), as in pallas_kernels.export_for_cuda."""
    with gpu_lowering_context():
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)


def _aval(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _layer_args(cfg, selector):
    """Abstract arguments of the fused program for one sparse layer of `cfg`."""
    params = jax.eval_shape(lambda: init_params(cfg))["layers"][2]
    H, G, D = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    meta = jax.eval_shape(functools.partial(selector.prepare, 2), _aval((B, H, CAPACITY, D), "float32"),
                          _aval((B,), "int32"))
    K, _ = jax.eval_shape(lambda: paged.init_pages(cfg, NUM_PAGES, P))[2]
    mask = jax.eval_shape(lambda: sparse.init_mask(cfg.num_layers, NUM_PAGES, H, P))
    i32 = lambda *shape: _aval(shape, "int32")
    x = _aval((B, cfg.hidden_size), cfg.dtype)
    return (params, meta, x, x, i32(B), i32(B), K, K, mask, i32(), i32(B, CAPACITY // P), _aval((B,), "bool"))


def _pin(K, V, mask):
    return K, V, mask


def _fused(cfg, selector):
    """`decode_program.fused` of a selected layer whose query is projected from the previous layer's
    input (x_query), as the worker runs it for InfiniGen."""
    def layer(params, meta, x, x_query, pos, now_cached, K, V, mask, layer_i, table, fetchable):
        return decode_program.fused(cfg, selector, _pin, CAPACITY, False, params, None, meta, x, x_query, pos,
                                    now_cached, K, V, mask, layer_i, table, fetchable)
    return layer


@pytest.mark.parametrize("dtype,backend", [("bfloat16", "mosaic"), ("float32", "xla")])
def test_fused_sparse_paged_layer_exports_for_cuda(dtype, backend):
    if backend == "mosaic" and not mosaic_attention.MOSAIC_AVAILABLE:
        pytest.skip(f"jax {jax.__version__} has no Mosaic GPU Pallas")
    cfg = tiny_config("llama", head_dim=64, dtype=dtype)
    selector = get_selector("oracle")
    args = _layer_args(cfg, selector)
    with dispatch.backend(backend):  # read at trace time: _export jits afresh
        exported = _export(_fused(cfg, selector), *args)
    assert exported.platforms == ("cuda",)
    kv_index, selected, remote, x, K, V, mask = exported.out_avals[-7:]  # after the metadata's leaves
    assert x.shape == (B, cfg.hidden_size) and remote.shape == selected.shape == (B * cfg.num_kv_heads,)
    assert kv_index.shape[0] == B * cfg.num_kv_heads
    assert (K.shape, V.shape, mask.shape) == (args[6].shape, args[7].shape, args[8].shape)  # the new token written
    module = exported.mlir_module()
    if backend == "mosaic":  # one sparse attention launch; top-k, split_reorder, gather by Triton
        assert module.count(MOSAIC_CALL) == 1 and module.count(TRITON_CALL) >= 3
        assert module.count(GATHER_KERNEL) == 1  # the rows come from the pages by the gather kernel
    else:
        assert MOSAIC_CALL not in module and TRITON_CALL not in module


def _landing(cfg):
    """Abstract landing pieces of the decode worker's layer programs (DecodePages.landing)."""
    i32 = lambda n: _aval((n,), "int32")
    rows = lambda n: _aval((n, cfg.head_dim), cfg.dtype)
    return tuple((i32(1 << b), i32(1 << b), i32(1 << b), rows(1 << b), rows(1 << b))
                 for b in range(decode_pages.LANDING_BITS))


@pytest.mark.parametrize("dtype,backend", [("bfloat16", "mosaic"), ("float32", "xla")])
def test_landing_layer_programs_export_for_cuda(dtype, backend):
    """`landed` (land the arrived and prefetched rows into the pages, select, split, gather,
    attention, MLP: the one program of a layer with remote rows) and `attend_landed` (a true miss's
    second program) lower for CUDA with the same kernels as `fused`, and hand back the pages and
    mask they wrote."""
    if backend == "mosaic" and not mosaic_attention.MOSAIC_AVAILABLE:
        pytest.skip(f"jax {jax.__version__} has no Mosaic GPU Pallas")
    cfg = tiny_config("llama", head_dim=64, dtype=dtype)
    selector = get_selector("oracle")
    args = _layer_args(cfg, selector)
    K, mask, table = args[6], args[8], args[10]

    def layer(params, meta, x, x_query, pos, now_cached, K, V, mask, layer_i, table, fetchable, landing):
        return decode_program.landed(cfg, selector, _pin, CAPACITY, False, params, None, meta, x, x_query, pos,
                                     now_cached, K, V, mask, layer_i, table, fetchable, landing)

    def miss(params, x, q, K, V, mask, layer_i, table, kv_index, landing):
        return decode_program.attend_landed(cfg, _pin, params, x, q, K, V, mask, layer_i, table, kv_index, landing)

    with dispatch.backend(backend):
        exported = _export(layer, *args, _landing(cfg))
        kv_index, q = exported.out_avals[-9], exported.out_avals[-4]  # after the metadata's leaves
        second = _export(miss, args[0], args[2], q, K, K, mask, args[9], table, kv_index, _landing(cfg))
    selected, reordered, remote, x, q, K_out, V_out, mask_out = exported.out_avals[-8:]
    assert kv_index.shape == reordered.shape and kv_index.shape[0] == B * cfg.num_kv_heads
    assert remote.shape == selected.shape == (B * cfg.num_kv_heads,) and x.shape == (B, cfg.hidden_size)
    assert q.shape == (B, cfg.num_heads, cfg.head_dim)
    assert (K_out.shape, V_out.shape, mask_out.shape) == (K.shape, K.shape, mask.shape)
    x2, K2, _, mask2 = second.out_avals
    assert x2.shape == x.shape and K2.shape == K.shape and mask2.shape == mask.shape
    for program, launches in ((exported, 3), (second, 0)):
        module = program.mlir_module()
        assert program.platforms == ("cuda",)
        if backend == "mosaic":  # the sparse attention; the selection's top-k and split_reorder only in `landed`
            assert module.count(MOSAIC_CALL) == 1 and module.count(GATHER_KERNEL) == 1
            assert module.count(TRITON_CALL) >= launches + 1
        else:
            assert MOSAIC_CALL not in module and TRITON_CALL not in module


SCORES_KERNEL = 'name = "topk_partial_scores"'  # the fused top-k's score launch


@pytest.mark.parametrize("group_score", ["sum", "mass"])
def test_the_fused_topk_kernel_is_in_the_exported_layer_where_it_applies(group_score):
    """Oracle ranking by the group's summed q·k selects with `topk_select_fused` inside the
    decode worker's fused layer program (scores and top-k by Triton kernels); the softmax-mass
    ranking cannot take it (the kernel computes only the summed scores) and keeps the jnp scores."""
    cfg = tiny_config("llama", head_dim=64, dtype="bfloat16")
    selector = Oracle(OracleConfig(group_score=group_score))
    with dispatch.backend("pallas"):
        module = _export(_fused(cfg, selector), *_layer_args(cfg, selector)).mlir_module()
    assert module.count(SCORES_KERNEL) == (1 if group_score == "sum" else 0)
    assert module.count('name = "topk_select"') == 1 and module.count(GATHER_KERNEL) == 1
