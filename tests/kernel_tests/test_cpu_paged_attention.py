"""The native CPU paged attention kernel (`pallas_kernels.cpu_paged_attention`) against the XLA
reference it replaces on CPU, and its wiring: `dispatch` lowers it for CPU only (never into a
program exported for CUDA), `cpu_kernels(False)` restores the reference, and a failed build falls
back with a warning.

Tolerance: the kernel computes the reference's formula (logits, max, log-sum-exp, exp(l - lse) V,
all in f32) in another summation order, with its own polynomial exp (one a logit: exp(l - max) / sum)
and libm's log instead of XLA's, so the two agree
to ~1e-7 relative, not bit for bit; 1e-6 is asserted."""
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged, tiny_config, tiny_model
from models.transformer import init_params
from pallas_kernels import cpu_paged_attention as cpa, dispatch
from pallas_kernels._common import gpu_lowering_context
from pallas_kernels.mosaic_attention import paged_decode_attention_partials_reference as reference

pytestmark = pytest.mark.skipif(not cpa.available(), reason="the CPU kernel could not be built (see the log)")
TOL = 1e-6


def _case(lengths, page_size, kv_heads, group, head_dim=64, max_pages=6, dtype=jnp.float32, seed=0):
    """Pages [num_pages, H_kv, P, D] whose every slot past a request's length is NaN (its last
    page's tail, a NaN page the unused table slots point to), table entries -1 and past the pool
    (clipped, as the reference does), shuffled page ids."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    num_pages = batch * max_pages + 1
    shape = (num_pages, kv_heads, page_size, head_dim)
    keys, values = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    keys[-1] = values[-1] = np.nan
    table = rng.permutation(num_pages - 1)[: batch * max_pages].reshape(batch, max_pages)
    for b, length in enumerate(lengths):
        used = min(-(-max(length, 0) // page_size), max_pages)
        table[b, used:] = (num_pages - 1, -1, num_pages + 5)[b % 3]  # NaN page, clipped to 0, clipped to the NaN page
        if 0 < used and length % page_size and length < max_pages * page_size:
            keys[table[b, used - 1], :, length % page_size:] = np.nan
            values[table[b, used - 1], :, length % page_size:] = np.nan
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(keys, dtype), jnp.asarray(values, dtype),
            jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("page_size,kv_heads,group,head_dim,dtype", [
    (16, 3, 3, 64, jnp.float32),    # SmolLM2's geometry
    (4, 2, 1, 32, jnp.float32),     # no GQA, small pages
    (8, 1, 7, 128, jnp.float32),    # GQA ratio 7
    (16, 3, 3, 64, jnp.bfloat16),   # a bf16 pool
])
def test_matches_the_reference(page_size, kv_heads, group, head_dim, dtype):
    """Lengths 0, 1, a page boundary, mid-page, the full table and past it, negative."""
    max_pages = 6
    full = max_pages * page_size
    lengths = [0, 1, 2 * page_size, 2 * page_size + 3, full, full + 9, -4]
    args = _case(lengths, page_size, kv_heads, group, head_dim, max_pages, dtype)
    got_o, got_lse = (np.asarray(a) for a in jax.jit(cpa.paged_decode_attention_partials_cpu)(*args))
    want_o, want_lse = (np.asarray(a) for a in jax.jit(reference)(*args))
    assert np.isfinite(got_o).all(), "a slot past a request's length (NaN) reached the output"
    empty = np.isneginf(want_lse)
    assert empty[[0, 6]].all() and not empty[1:6].any()
    np.testing.assert_array_equal(np.isneginf(got_lse), empty)
    np.testing.assert_array_equal(got_o[[0, 6]], 0.0)
    np.testing.assert_allclose(got_o, want_o, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got_lse[~empty], want_lse[~empty], rtol=TOL, atol=TOL)


def test_a_scale_other_than_the_default():
    args = _case([5, 40], 16, 2, 2)
    got = jax.jit(functools.partial(cpa.paged_decode_attention_partials_cpu, scale=0.3))(*args)
    want = reference(*args, scale=0.3)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=TOL, atol=TOL)


def test_rows_split_over_threads_give_the_same_bits():
    """Enough tokens (2 x 2 x 4,000 key-heads > 16K) for the rows to go to several of XLA's pool
    threads: each row is still computed by one thread in one order, so the bits do not change."""
    args = _case([4000, 3990], 16, 2, 3, max_pages=250)
    runs = [jax.jit(functools.partial(cpa.paged_decode_attention_partials_cpu, max_threads=t))(*args)
            for t in (0, 1)]
    for split, single in zip(*runs):
        np.testing.assert_array_equal(np.asarray(split), np.asarray(single))
    np.testing.assert_allclose(np.asarray(runs[0][0]), np.asarray(reference(*args)[0]), rtol=TOL, atol=TOL)


def _step(cfg, enabled: bool):
    with dispatch.cpu_kernels(enabled):  # read at trace time: lower inside
        return jax.jit(functools.partial(paged.paged_decode_step_compute, cfg))


def test_dispatch_lowers_the_kernel_for_cpu_only():
    """One kernel call a layer in the CPU program; none with `cpu_kernels(False)`, none in the
    same step exported for CUDA (the reference is lowered there, so the export still works)."""
    cfg = tiny_config("llama", head_dim=64, num_layers=2)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    step_args = (jax.eval_shape(lambda: init_params(cfg)), jax.eval_shape(lambda: paged.init_pages(cfg, 9, 4)),
                 i32(2, 4), i32(2), i32(2))
    target = f"@{cpa.TARGET}"
    for enabled, calls in ((True, cfg.num_layers), (False, 0)):
        with dispatch.cpu_kernels(enabled):
            text = jax.jit(functools.partial(paged.paged_decode_step_compute, cfg)).lower(*step_args).as_text()
        assert text.count(target) == calls, enabled
    with dispatch.backend("xla"), gpu_lowering_context():
        exported = jax.export.export(jax.jit(functools.partial(paged.paged_decode_step_compute, cfg)),
                                     platforms=["cuda"])(*step_args)
    assert cpa.TARGET not in exported.mlir_module()


@pytest.fixture(scope="module")
def smol_like():
    """A tiny model with SmolLM2's head geometry (H=9, H_kv=3, D=64) and its paged cache filled
    by a prefill of mixed lengths."""
    model = tiny_model("llama", num_heads=9, num_kv_heads=3, head_dim=64, seed=4)
    lengths = np.asarray([3, 40, 17, 64], np.int32)
    tokens = np.random.default_rng(1).integers(3, model.cfg.vocab_size, (4, 64)).astype(np.int32)
    _, kv = model.prefill(tokens, lengths)
    table = jnp.asarray(1 + np.arange(4 * 20).reshape(4, 20), jnp.int32)
    pages = model.write_prefill_pages(model.init_paged_kv(1 + 4 * 20, 4), table, kv, lengths)
    return model, pages, table, lengths


def test_the_decode_step_with_the_kernel_equals_the_reference_step(smol_like):
    model, pages, table, lengths = smol_like
    tok = jnp.asarray([5, 6, 7, 8], jnp.int32)
    outs = [_step(model.cfg, enabled)(model.params, pages, table, tok, jnp.asarray(lengths)) for enabled in (True, False)]
    (logits, k, v), (want_logits, want_k, want_v) = outs
    np.testing.assert_array_equal(np.asarray(k), np.asarray(want_k))  # computed before any attention of layer 0
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    assert (np.argmax(np.asarray(logits), -1) == np.argmax(np.asarray(want_logits), -1)).all()


def test_jkv_cpu_kernels_0_in_the_environment_turns_the_kernel_off():
    assert dispatch.cpu_kernels_from_env({}) and dispatch.cpu_kernels_from_env({"JKV_CPU_KERNELS": "1"})
    assert not dispatch.cpu_kernels_from_env({"JKV_CPU_KERNELS": "0"})


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "jkv-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=cpa.__name__):
        assert cpa.available.__wrapped__() is False
    assert "no C++ compiler" in caplog.text and "XLA gather reference" in caplog.text


def test_the_built_library_is_reused(monkeypatch):
    """A second build in the same cache dir finds the library and runs no compiler."""
    import shutil
    import subprocess

    compiler = shutil.which("c++") or shutil.which("g++")
    first = cpa._build(compiler)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert cpa._build(compiler) == first and first.exists()


# ------------------------------------------------------------------ causal prefill attention
def _prefill_case(batch, tokens, kv_heads, group, head_dim, lengths, seed=0):
    """q [B, T, H, D], K, V [B, H_kv, T, D] NaN past each row's length (a padded prompt's keys must
    not leak into the valid ones), positions = t."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, tokens, kv_heads * group, head_dim)).astype(np.float32)
    K, V = (rng.standard_normal((batch, kv_heads, tokens, head_dim)).astype(np.float32) for _ in range(2))
    for b, n in enumerate(lengths):
        K[b, :, max(n, 0):] = V[b, :, max(n, 0):] = np.nan
    positions = np.broadcast_to(np.arange(tokens, dtype=np.int32), (batch, tokens))
    return tuple(map(jnp.asarray, (q, K, V, positions, np.asarray(lengths, np.int32))))


def _whole_causal(q, K, V, positions, lengths):
    """The definition: one masked softmax over every key (fully masked queries give zeros)."""
    from models import transformer as tfm

    key = jnp.arange(K.shape[2])
    mask = (key[None, None, :] <= positions[:, :, None]) & (key[None, None, :] < lengths[:, None, None])
    return tfm.attention(q, jnp.nan_to_num(K), jnp.nan_to_num(V), mask[:, None])


@pytest.mark.parametrize("tokens,kv_heads,group,head_dim,lengths", [
    (300, 3, 3, 64, [300, 77]),     # SmolLM2's geometry; a padded row (queries past 77 see 0..76)
    (37, 2, 1, 32, [37, 1]),        # no GQA, T not a multiple of the 8-key panels or 12-row tiles
    (64, 1, 7, 128, [50, 64]),      # GQA ratio 7, head dim 128
    (24, 2, 3, 16, [0, 24]),        # an empty row: every query sees no key -> zeros
])
def test_prefill_kernel_matches_whole_causal_attention(tokens, kv_heads, group, head_dim, lengths):
    args = _prefill_case(len(lengths), tokens, kv_heads, group, head_dim, lengths)
    got = np.asarray(jax.jit(cpa.prefill_attention_cpu)(*args))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(_whole_causal(*args)), rtol=TOL, atol=TOL)
    if lengths[0] == 0:
        assert not got[0].any()


def test_prefill_kernel_tiles_split_over_threads_give_the_same_bits():
    args = _prefill_case(2, 512, 3, 3, 64, [512, 300], seed=2)
    split, single = (np.asarray(jax.jit(functools.partial(cpa.prefill_attention_cpu, max_threads=t))(*args))
                     for t in (0, 1))
    np.testing.assert_array_equal(split, single)


def test_prefill_dispatch_lowers_the_kernel_for_cpu_only_and_model_prefill_agrees():
    """Model.prefill lowers one kernel call a layer for CPU, none with `cpu_kernels(False)` or for
    CUDA; its logits and KV equal the XLA formulation's (KV bit for bit: written before attention)."""
    from models import transformer as tfm

    cfg = tiny_config("llama", num_heads=9, num_kv_heads=3, head_dim=64, num_layers=2)
    f32, i32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    layer_args = (jax.eval_shape(lambda: init_params(cfg))["layers"][0], f32(1, 256, cfg.hidden_size),
                  i32(1, 256), i32(1))
    layer = lambda: jax.jit(functools.partial(tfm.prefill_layer, cfg, native_attention=True))
    for enabled, calls in ((True, 1), (False, 0)):
        with dispatch.cpu_kernels(enabled):
            assert layer().lower(*layer_args).as_text().count(f"@{cpa.PREFILL_TARGET}") == calls
    with gpu_lowering_context():
        exported = jax.export.export(layer(), platforms=["cuda"])(*layer_args)
    assert cpa.PREFILL_TARGET not in exported.mlir_module()

    tokens = np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 200)).astype(np.int32)
    lengths = np.array([200, 61], np.int32)
    runs = []
    for enabled in (True, False):
        with dispatch.cpu_kernels(enabled):
            model = tiny_model("llama", num_heads=9, num_kv_heads=3, head_dim=64, num_layers=2, seed=7)
            runs.append(model.prefill(tokens, lengths))
    (logits, kv), (want_logits, want_kv) = runs
    np.testing.assert_array_equal(np.asarray(kv[0][0]), np.asarray(want_kv[0][0]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,H_kv,D,P,max_pages", [(9, 3, 64, 16, 5), (4, 2, 16, 4, 7), (7, 1, 32, 8, 3)])
def test_chunk_kernel_matches_the_xla_chunk_attention(H, H_kv, D, P, max_pages):
    """Starts 13 (mid-page), 0, a page edge, the table's last slot, 0 with nothing to attend
    (zeros); every page outside a row's context is NaN (must not be read) and table entries past
    the context are -1 / past the pool (clipped, as the reference)."""
    rng = np.random.default_rng(5)
    B, C = 5, 6
    num_pages = B * max_pages + 2
    q = jnp.asarray(rng.standard_normal((B, C, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, C, H_kv, D)), jnp.float32) for _ in range(2))
    start = np.array([13, 0, P, max_pages * P - 1, 0], np.int32)
    lengths = np.array([6, 3, 1, 6, 0], np.int32)
    K_pages, V_pages = (np.full((num_pages, H_kv, P, D), np.nan, np.float32) for _ in range(2))
    table = rng.permutation(np.arange(1, num_pages))[: B * max_pages].reshape(B, max_pages).astype(np.int32)
    for b in range(B):
        used = -(-start[b] // P)
        for page in table[b, :used]:
            K_pages[page], V_pages[page] = rng.standard_normal((2, H_kv, P, D))
        if start[b] % P:  # the last context page's tail: not context
            K_pages[table[b, used - 1], :, start[b] % P:] = np.nan
        table[b, used:] = (-1, num_pages + 3)[b % 2]
    args = (q, k, v, jnp.asarray(K_pages), jnp.asarray(V_pages), jnp.asarray(table), jnp.asarray(start),
            jnp.asarray(lengths))
    got = np.asarray(jax.jit(cpa.chunk_attention_cpu)(*args))
    assert np.isfinite(got).all() and not got[4].any()
    K_ref, V_ref = (jnp.asarray(np.nan_to_num(a)) for a in (K_pages, V_pages))
    want = paged.chunk_attention(q, k, v, K_ref, V_ref, jnp.asarray(table), jnp.asarray(start), jnp.asarray(lengths))
    np.testing.assert_allclose(got, np.asarray(want), rtol=TOL, atol=TOL)
    with dispatch.cpu_kernels(True):
        native = jax.jit(functools.partial(paged.chunk_attention, native=True))
        assert f"@{cpa.CHUNK_TARGET}" in native.lower(*args).as_text()
        np.testing.assert_array_equal(np.asarray(native(*args)), got)


def _topk_rows(rng, rows, n, kind):
    """Scores with many ties (small integers); with NaN, +-inf and -0.0 sprinkled in; or normal."""
    if kind == "normal":
        return rng.standard_normal((rows, n)).astype(np.float32)
    x = rng.integers(-4, 5, (rows, n)).astype(np.float32)
    if kind == "specials":
        u = rng.random((rows, n))
        x[u < 0.1], x[(u >= 0.1) & (u < 0.2)], x[(u >= 0.2) & (u < 0.3)] = np.nan, np.inf, -np.inf
        x[(u >= 0.3) & (u < 0.4)] = -0.0
    return x


@pytest.mark.parametrize("kind", ["ties", "specials", "normal"])
def test_topk_kernel_returns_the_reference_indices(kind):
    """Same indices and order as `topk_select_reference` (score descending, -0 tying +0, ties and
    NaNs by lower index, NaNs after -inf, -1 past min(k, valid_len)) for lengths below 0, 0, inside
    and past N, and k below, at and past N; bf16 scores are widened first."""
    from pallas_kernels import topk

    rng = np.random.default_rng({"ties": 0, "specials": 1, "normal": 2}[kind])
    rows, n = 5, 64
    for k in (1, 17, 64, 70):  # one compile each of the kernel and the reference
        kernel = jax.jit(functools.partial(cpa.topk_select_cpu, k=k))
        reference = jax.jit(functools.partial(topk.topk_select_reference, k=k))
        for _ in range(8):
            x = jnp.asarray(_topk_rows(rng, rows, n, kind))
            valid = jnp.asarray(rng.integers(-2, n + 3, rows), jnp.int32)
            np.testing.assert_array_equal(np.asarray(kernel(x, valid)), np.asarray(reference(x, valid)))
    x16 = jnp.asarray(rng.standard_normal((3, 50)), jnp.bfloat16)  # bf16 rounding makes ties
    valid = jnp.asarray([50, 7, 0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(cpa.topk_select_cpu(x16, valid, 20)),
                                  np.asarray(topk.topk_select_reference(x16, valid, 20)))


def test_topk_kernel_at_the_decode_worker_shape_equals_xlas_partial_sort():
    """12 rows (4 requests x 3 KV heads) of 2,176 scores, k = 544, the decode step's shape at 4 x 2K."""
    from pallas_kernels import topk

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((12, 2176)), jnp.float32)
    valid = jnp.asarray(rng.integers(1500, 2177, 12), jnp.int32)
    np.testing.assert_array_equal(np.asarray(cpa.topk_select_cpu(x, valid, 544)),
                                  np.asarray(topk.topk_select_xla(x, valid, 544)))


def test_topk_dispatch_lowers_the_kernel_for_cpu_only():
    """On the "xla" backend `topk_select_fused` (InfiniGen's selection) lowers the kernel for CPU
    and agrees with XLA's selection; not with `cpu_kernels(False)`, nor in a CUDA export."""
    from pallas_kernels import topk

    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((6, 3, 8)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((6, 40, 8)), jnp.float32)
    valid = jnp.asarray([40, 39, 12, 1, 0, 33], jnp.int32)
    select = jax.jit(functools.partial(dispatch.topk_select_fused, k=16))
    with dispatch.backend("xla"):
        for enabled in (True, False):
            with dispatch.cpu_kernels(enabled):
                lowered = jax.jit(functools.partial(dispatch.topk_select_fused, k=16)).lower(q, keys, valid)
                assert (f"@{cpa.TOPK_TARGET}" in lowered.as_text()) == enabled
                np.testing.assert_array_equal(np.asarray(lowered.compile()(q, keys, valid)),
                                              np.asarray(topk.topk_select_fused_xla(q, keys, valid, 16)))
        with gpu_lowering_context():
            exported = jax.export.export(select, platforms=["cuda"])(q, keys, valid)
    assert cpa.TOPK_TARGET not in exported.mlir_module()
