"""The Mosaic GPU sparse decode attention kernel against the f32 reference, and its dispatch.

Interpret-mode checks run the kernel on CPU under `plgpu.InterpretGPUParams()`, which exists from
jax 0.11 (the second CI stage, Python 3.12); on jax 0.10 they skip and only export / validation
run. With JKV_KERNEL_MODE=compiled on an sm_90+ GPU the same cases run the compiled kernel.
Slots past valid_count are NaN, so a read of one shows in the output.

Tolerances: bf16 / f16 inputs are compared at their own precision; f32 runs as 3xbf16 (see
`mosaic_attention`'s docstring), whose products keep ~16 mantissa bits: <= 1e-5 error on these
unit-normal inputs, checked at 5e-5, which neither bf16 (~1e-3) nor TF32 (~1.4e-4) products
would meet. The interpreter runs the same split products, so the f32 tolerance holds for the
compiled kernel up to summation order and the GPU's exp.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch, mosaic_attention as ma
from pallas_kernels.sparse_attention import sparse_decode_attention_partials_reference

from .helpers import INTERPRET, poison_beyond

needs_mosaic_interpreter = pytest.mark.skipif(
    INTERPRET and not ma.INTERPRET_AVAILABLE,
    reason=f"jax {jax.__version__} has no Mosaic GPU interpreter (plgpu.InterpretGPUParams is "
    "jax >= 0.11, Python >= 3.12): run in the second CI stage (.ci/gpu_stage.sh)",
)
needs_hopper = pytest.mark.skipif(
    not INTERPRET
    and dispatch.choose_auto(jax.default_backend(), dispatch._compute_capability(jax.devices()[0]))[0]
    != "mosaic",
    reason="compiled Mosaic GPU kernels need an sm_90+ GPU",
)
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-5}


def _case(batch, kv_heads, group, k, head_dim, valid, dtype, seed=0):
    rng = np.random.default_rng(seed)
    rows = batch * kv_heads
    valid = np.asarray(valid, np.int32)
    assert valid.shape == (rows,)
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(np.float32)
    keys = poison_beyond(rng.standard_normal((rows, k, head_dim)).astype(np.float32), valid)
    values = poison_beyond(rng.standard_normal((rows, k, head_dim)).astype(np.float32), valid)
    return (jnp.asarray(q, dtype), jnp.asarray(keys, dtype), jnp.asarray(values, dtype),
            jnp.asarray(valid))


def _check(args, dtype, **kwargs):
    got_o, got_lse = ma.sparse_decode_attention_partials_mosaic(*args, interpret=INTERPRET, **kwargs)
    want_o, want_lse = sparse_decode_attention_partials_reference(*args)
    got_o, got_lse = np.asarray(got_o), np.asarray(got_lse)
    assert np.isfinite(got_o).all(), "a slot past valid_count (NaN) reached the output"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got_o, np.asarray(want_o), rtol=tol, atol=tol)
    empty = np.isneginf(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isneginf(got_lse), empty)
    np.testing.assert_allclose(got_lse[~empty], np.asarray(want_lse)[~empty], rtol=tol, atol=tol)
    assert (got_o[empty] == 0).all()


@needs_mosaic_interpreter
@needs_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_valid_counts_0_1_k_and_mixed(dtype):
    """k = 200 (not a multiple of 8 or 64: padded, last tile clamped), rows with 0, 1, k and
    mixed valid counts, G = 3 query heads per KV head padded to 64."""
    k = 200
    args = _case(2, 3, 3, k, 64, [0, 1, k, 63, 64, 130], dtype)
    _check(args, dtype)


@needs_mosaic_interpreter
@needs_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_splits_and_clamped_last_tile(dtype):
    """Three splits of 128 entries over k = 328 (a multiple of 8): the last split's only tile
    starts at 264 = k - 64, overlapping the previous split, whose entries it must not count
    twice; valid counts end inside each split and exactly on a tile boundary. D = 128 (f32:
    the largest head dim it takes, o staged in K's slot)."""
    k = 328
    args = _case(1, 4, 4, k, 128, [k, 300, 129, 128], dtype, seed=1)
    _check(args, dtype, num_splits=3)


@needs_mosaic_interpreter
@needs_hopper
def test_short_rows_and_out_of_range_counts():
    """k = 5 < one tile (padded to 64), G = 1; counts beyond k or negative are clamped."""
    args = _case(2, 2, 1, 5, 64, [5, 9, -3, 2], jnp.bfloat16, seed=2)
    _check(args, jnp.bfloat16)


@pytest.mark.parametrize(
    "head_dim,dtype,match",
    [(64, jnp.int8, "bf16, f16 or f32"), (32, jnp.bfloat16, "128 bytes"),
     (48, jnp.bfloat16, "128 bytes"), (32, jnp.float32, "64 or 128"),
     (256, jnp.float32, "64 or 128")],
)
def test_unsupported_inputs_are_refused_by_name(head_dim, dtype, match):
    args = _case(1, 2, 2, 64, head_dim, [64, 1], jnp.float32)
    args = tuple(a.astype(dtype) for a in args[:3]) + args[3:]
    with pytest.raises(ValueError, match=match):
        ma.sparse_decode_attention_partials_mosaic(*args)


def _custom_calls(backend, *args):
    from pallas_kernels._common import export_for_cuda

    with dispatch.backend(backend):
        module = export_for_cuda(
            lambda *a: dispatch.sparse_decode_attention_partials(*a), *args
        ).mlir_module()
    return {name for name in ("mosaic_gpu_v2", "__gpu$xla.gpu.triton") if name in module}


@pytest.mark.skipif(not ma.MOSAIC_AVAILABLE, reason="no Mosaic GPU Pallas in this jax")
def test_dispatch_mosaic_exports_for_cuda_and_falls_back_to_triton():
    """bf16 D=128 and f32 D=64 (3xbf16) go to the Mosaic kernel; D=32 (64-byte bf16 rows, no
    128-byte swizzle; f32 needs 128-byte bf16 split rows) goes to Triton, in the same "mosaic"
    backend."""
    spec = jax.ShapeDtypeStruct
    rows, k = 16, 2048

    def shapes(dtype, head_dim):
        return (spec((8, 8, head_dim), dtype), spec((rows, k, head_dim), dtype),
                spec((rows, k, head_dim), dtype), spec((rows,), jnp.int32))

    assert _custom_calls("mosaic", *shapes(jnp.bfloat16, 128)) == {"mosaic_gpu_v2"}
    assert _custom_calls("mosaic", *shapes(jnp.float32, 64)) == {"mosaic_gpu_v2"}
    assert _custom_calls("mosaic", *shapes(jnp.float32, 32)) == {"__gpu$xla.gpu.triton"}
    assert _custom_calls("mosaic", *shapes(jnp.bfloat16, 32)) == {"__gpu$xla.gpu.triton"}
    assert _custom_calls("pallas", *shapes(jnp.bfloat16, 128)) == {"__gpu$xla.gpu.triton"}


@pytest.mark.parametrize(
    "platform,capability,want",
    [("cpu", (0, 0), "xla"), ("gpu", (8, 0), "pallas"), ("gpu", (9, 0), "mosaic"),
     ("gpu", (10, 0), "mosaic")],
)
def test_auto_prefers_mosaic_on_sm90_then_triton_then_xla(platform, capability, want):
    if want == "mosaic" and not ma.MOSAIC_AVAILABLE:
        want = "pallas"
    chosen, why = dispatch.choose_auto(platform, capability)
    assert chosen == want, why
    assert why  # the start-up log line says why


def _paged_case(page_size, head_dim, lengths, max_pages, seed=0, dtype=jnp.bfloat16):
    """A paged cache [num_pages, H_kv, P, D] with a NaN page that only table slots past each
    request's length point to, a -1 sentinel, and shuffled page ids."""
    rng = np.random.default_rng(seed)
    batch, kv_heads, group = len(lengths), 2, 3
    num_pages = batch * max_pages + 1
    shape = (num_pages, kv_heads, page_size, head_dim)
    keys = rng.standard_normal(shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    keys[-1] = values[-1] = np.nan
    table = rng.permutation(num_pages - 1)[: batch * max_pages].reshape(batch, max_pages)
    for b, length in enumerate(lengths):
        used = -(-max(int(length), 0) // page_size)
        table[b, used:] = num_pages - 1 if b % 2 else -1
        # Slots inside the last used page but past the length are garbage too.
        if used and length % page_size:
            keys[table[b, used - 1], :, length % page_size:] = np.nan
            values[table[b, used - 1], :, length % page_size:] = np.nan
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(keys, dtype), jnp.asarray(values, dtype),
            jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32))


@needs_mosaic_interpreter
@needs_hopper
@pytest.mark.parametrize(
    "page_size,num_splits,dtype",
    [(16, None, jnp.bfloat16), (64, 2, jnp.bfloat16), (16, None, jnp.float32),
     (64, 2, jnp.float32)],
)
def test_paged_matches_reference(page_size, num_splits, dtype):
    """Lengths 0, 1, a page boundary, mid-page and the full table; NaN past every length."""
    max_pages = 160 // page_size + 1
    lengths = [0, 1, 2 * page_size, 77, max_pages * page_size]
    args = _paged_case(page_size, 64, lengths, max_pages, dtype=dtype)
    got_o, got_lse = ma.paged_decode_attention_partials_mosaic(
        *args, interpret=INTERPRET, num_splits=num_splits)
    want_o, want_lse = ma.paged_decode_attention_partials_reference(*args)
    got_o = np.asarray(got_o)
    assert np.isfinite(got_o).all(), "a slot past a request's length (NaN) reached the output"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got_o, np.asarray(want_o), rtol=tol, atol=tol)
    empty = np.isneginf(np.asarray(want_lse))
    assert empty[0].all() and not empty[1:].any()
    np.testing.assert_array_equal(np.isneginf(np.asarray(got_lse)), empty)
    np.testing.assert_allclose(np.asarray(got_lse)[~empty], np.asarray(want_lse)[~empty],
                               rtol=tol, atol=tol)


def test_paged_refuses_page_sizes_that_do_not_tile():
    args = _paged_case(16, 64, [5], 2)
    q, k, v, table, lengths = args
    k24 = jnp.zeros((k.shape[0], k.shape[1], 24, 64), k.dtype)
    with pytest.raises(ValueError, match="page size P=24"):
        ma.paged_decode_attention_partials_mosaic(q, k24, k24, table, lengths)


@pytest.mark.skipif(not ma.MOSAIC_AVAILABLE, reason="no Mosaic GPU Pallas in this jax")
def test_dispatch_paged_uses_mosaic_only_under_mosaic():
    from pallas_kernels._common import export_for_cuda

    args = _paged_case(16, 64, [5, 40], 3)
    for backend, want in (("mosaic", True), ("pallas", False)):
        with dispatch.backend(backend):
            module = export_for_cuda(
                lambda *a: dispatch.paged_decode_attention_partials(*a), *args, custom_calls=()
            ).mlir_module()
        assert ("mosaic_gpu_v2" in module) == want
    with dispatch.backend("xla"), dispatch.cpu_kernels(False):  # the CPU kernel: test_cpu_paged_attention.py
        got = dispatch.paged_decode_attention_partials(*args)
    want = ma.paged_decode_attention_partials_reference(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.skipif(not ma.MOSAIC_AVAILABLE, reason="no Mosaic GPU Pallas in this jax")
def test_dispatch_logs_each_fallback_once_naming_what_it_uses(caplog):
    """f32 at D=64 is the Mosaic kernel's (no log line); f32 at D=32 falls back to Triton for
    selected rows and to the XLA reference for pages, each said once, by name."""
    from pallas_kernels._common import export_for_cuda

    spec = jax.ShapeDtypeStruct
    dispatch._log_mosaic_fallback.cache_clear()

    def rows_shapes(head_dim):
        return (spec((2, 4, head_dim), jnp.float32), spec((4, 128, head_dim), jnp.float32),
                spec((4, 128, head_dim), jnp.float32), spec((4,), jnp.int32))

    def paged_shapes(head_dim):
        return (spec((2, 4, head_dim), jnp.float32), spec((9, 2, 16, head_dim), jnp.float32),
                spec((9, 2, 16, head_dim), jnp.float32), spec((2, 4), jnp.int32),
                spec((2,), jnp.int32))

    with caplog.at_level("INFO", logger=dispatch.__name__), dispatch.backend("mosaic"):
        for _ in range(2):
            for head_dim in (64, 32):
                export_for_cuda(lambda *a: dispatch.sparse_decode_attention_partials(*a),
                                *rows_shapes(head_dim))
                export_for_cuda(lambda *a: dispatch.paged_decode_attention_partials(*a),
                                *paged_shapes(head_dim), custom_calls=())
    lines = [r.getMessage() for r in caplog.records if "Mosaic kernel does not take" in r.message]
    assert len(lines) == 2, lines
    assert lines[0].startswith("sparse attention:") and "head_dim=32" in lines[0]
    assert lines[0].endswith("using the Triton kernel")
    assert lines[1].startswith("paged attention:") and lines[1].endswith("using the XLA reference")
