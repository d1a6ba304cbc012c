"""paged_gather kernel vs its XLA reference and an independent numpy gather: bit-exact outputs.

Adversarial inputs: k = 0, rows with 0 / 1 / every token selected, positions on page boundaries
and in a request's last partial page, -1 sentinels anywhere, positions past the page table,
table entries outside the cache, NaN rows in the cache, k not a multiple of the kernel's block,
head dims that are not powers of two; bf16, f16 and f32.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import dispatch, paged_gather as pg

from .helpers import HYPOTHESIS_SETTINGS, INTERPRET

KERNEL_BACKEND = "interpret" if INTERPRET else "pallas"


@jax.jit
def _kernel(k_pages, v_pages, table, kv_index):
    return pg.paged_gather_pallas(k_pages, v_pages, table, kv_index, interpret=INTERPRET)


_reference = jax.jit(pg.paged_gather_reference)


def _bits(x) -> np.ndarray:
    """The raw bits of x, so NaN payloads and -0.0 must match too."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _numpy_gather(cache, table, kv_index):
    """Independent of both: the module docstring's rules, one entry at a time."""
    num_pages, kv_heads, page_size, head_dim = cache.shape
    batch, max_pages = table.shape
    out = np.zeros((batch * kv_heads, kv_index.shape[1], head_dim), cache.dtype)
    for r, row in enumerate(kv_index):
        for j, t in enumerate(row):
            if t < 0:
                page, slot = 0, 0
            else:
                page = int(table[r // kv_heads, min(t // page_size, max_pages - 1)])
                page = min(max(page + num_pages if page < 0 else page, 0), num_pages - 1)
                slot = t % page_size
            out[r, j] = cache[page, r % kv_heads, slot]
    return out.reshape(batch, kv_heads, -1, head_dim)


def _cache(rng, num_pages, kv_heads, page_size, head_dim, dtype):
    cache = rng.standard_normal((num_pages, kv_heads, page_size, head_dim)).astype(np.float32)
    cache[num_pages // 2, 0, min(1, page_size - 1)] = np.nan  # a NaN row is copied as it is
    cache[1, 0, 0, :2] = [-0.0, np.inf]
    return np.asarray(jnp.asarray(cache, dtype))


def _assert_matches(k_pages, v_pages, table, kv_index):
    args = (jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table, jnp.int32),
            jnp.asarray(kv_index, jnp.int32))
    got = _kernel(*args)
    want = _reference(*args)
    for name, g, w, cache in zip(("k_sel", "v_sel"), got, want, (k_pages, v_pages)):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{name} kernel vs reference")
        independent = _numpy_gather(np.asarray(cache), np.asarray(table), np.asarray(kv_index))
        np.testing.assert_array_equal(_bits(w), _bits(independent), err_msg=f"{name} reference vs numpy")
    return got


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_adversarial_rows(dtype):
    rng = np.random.default_rng(0)
    num_pages, kv_heads, page_size, head_dim, max_pages = 24, 3, 16, 64, 6
    k_pages = _cache(rng, num_pages, kv_heads, page_size, head_dim, dtype)
    v_pages = _cache(rng, num_pages, kv_heads, page_size, head_dim, dtype)
    lengths = [0, 1, 37, max_pages * page_size]  # empty, one token, last page partial, full table
    table = np.stack([rng.permutation(np.arange(1, num_pages))[:max_pages] for _ in lengths])
    table[0] = 0  # an idle request: every entry the null page
    table[2, 0] = 1  # request 2's token 0 (head 0) is the row holding -0.0 and inf
    table[3, 0] = num_pages // 2  # request 3's token 1 (head 0) is the NaN row
    k = max_pages * page_size  # 96: one full block and a partial one
    kv_index = np.full((len(lengths) * kv_heads, k), -1, np.int32)
    for b, length in enumerate(lengths):
        for h in range(kv_heads):
            r = b * kv_heads + h
            chosen = rng.permutation(length)  # every token, in a random order
            kv_index[r, : len(chosen)] = chosen
    # page boundaries and the last slot of the last partial page, for request 2 head 0
    kv_index[6, :6] = [0, 15, 16, 31, 32, 36]
    kv_index[7, :3] = [36, 0, 36]  # repeats are allowed (two slots, one row)
    got = _assert_matches(k_pages, v_pages, table, kv_index)
    assert np.isnan(np.asarray(got[0], np.float32)[3, 0]).any()  # the NaN row was copied as is


def test_positions_past_the_table_and_pages_outside_the_cache():
    rng = np.random.default_rng(1)
    num_pages, kv_heads, page_size, head_dim, max_pages = 10, 2, 8, 32, 3
    k_pages = _cache(rng, num_pages, kv_heads, page_size, head_dim, jnp.float32)
    v_pages = _cache(rng, num_pages, kv_heads, page_size, head_dim, jnp.float32)
    table = np.array([[-1, num_pages + 5, -num_pages - 7], [3, 4, 5]], np.int32)
    kv_index = np.array([[0, 8, 16, 23], [7, 9, 17, -1], [24, 100, 2**31 - 1, 5], [-1, -1, -5, 0]],
                        np.int32)
    _assert_matches(k_pages, v_pages, table, kv_index)


@pytest.mark.parametrize("head_dim,dtype,k", [(48, jnp.float16, 1), (128, jnp.bfloat16, 130), (96, jnp.float32, 64)])
def test_head_dims_and_block_edges(head_dim, dtype, k):
    """D not a power of two (column masks), k = 1, k = one block, k past two blocks."""
    rng = np.random.default_rng(head_dim)
    num_pages, kv_heads, page_size, max_pages, batch = 40, 2, 16, 12, 2
    k_pages = _cache(rng, num_pages, kv_heads, page_size, head_dim, dtype)
    v_pages = _cache(rng, num_pages, kv_heads, page_size, head_dim, dtype)
    table = rng.integers(1, num_pages, (batch, max_pages)).astype(np.int32)
    kv_index = rng.integers(-1, max_pages * page_size, (batch * kv_heads, k)).astype(np.int32)
    _assert_matches(k_pages, v_pages, table, kv_index)


def test_k_zero_gives_empty_buffers():
    k_pages = jnp.ones((4, 2, 8, 16), jnp.bfloat16)
    k_sel, v_sel = pg.paged_gather_pallas(k_pages, k_pages, jnp.zeros((3, 2), jnp.int32),
                                          jnp.zeros((6, 0), jnp.int32), interpret=INTERPRET)
    assert k_sel.shape == v_sel.shape == (3, 2, 0, 16) and k_sel.dtype == jnp.bfloat16


@settings(**HYPOTHESIS_SETTINGS)
@given(data=st.data())
def test_random_shapes(data):
    kv_heads = data.draw(st.sampled_from([1, 3]), label="H_kv")
    page_size = data.draw(st.sampled_from([1, 16, 64]), label="P")
    max_pages = data.draw(st.integers(1, 5), label="max_pages")
    k = data.draw(st.integers(1, 200), label="k")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    num_pages, batch = 2 + 2 * max_pages, 2
    k_pages = _cache(rng, num_pages, kv_heads, page_size, 16, jnp.bfloat16)
    v_pages = _cache(rng, num_pages, kv_heads, page_size, 16, jnp.bfloat16)
    table = rng.integers(0, num_pages, (batch, max_pages)).astype(np.int32)
    kv_index = rng.integers(-1, max_pages * page_size + 3, (batch * kv_heads, k)).astype(np.int32)
    _assert_matches(k_pages, v_pages, table, kv_index)


@pytest.mark.parametrize("backend", ["xla", KERNEL_BACKEND])
def test_dispatch_gathers_by_backend(backend, monkeypatch):
    """The kernel on a kernel backend, the XLA gather under "xla"; the same rows either way."""
    kernel_calls = []
    kernel = pg.paged_gather_pallas
    monkeypatch.setattr(pg, "paged_gather_pallas", lambda *a, **kw: kernel_calls.append(kw) or kernel(*a, **kw))
    rng = np.random.default_rng(3)
    k_pages = jnp.asarray(_cache(rng, 8, 2, 16, 64, jnp.bfloat16))
    table = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    kv_index = jnp.asarray(rng.integers(-1, 32, (4, 20)), jnp.int32)
    with dispatch.backend(backend):  # read at trace time: a fresh jit
        got = jax.jit(lambda *a: dispatch.paged_gather(*a))(k_pages, k_pages, table, kv_index)
    assert kernel_calls == ([] if backend == "xla" else [{"interpret": INTERPRET}])
    want = _numpy_gather(np.asarray(k_pages), np.asarray(table), np.asarray(kv_index))
    for g in got:
        np.testing.assert_array_equal(_bits(g), _bits(want))


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((4, 2, 8, 16), (4, 2, 8, 32), (1, 2), (2, 5)), "one shape"),
        (((4, 2, 8, 16), (4, 2, 8, 16), (2,), (2, 5)), "page_table"),
        (((4, 2, 8, 16), (4, 2, 8, 16), (1, 2), (3, 5)), r"B\*H_kv = 2"),
    ],
)
def test_dispatch_rejects_bad_shapes_by_name(shapes, match):
    k_shape, v_shape, table_shape, index_shape = shapes
    with pytest.raises(ValueError, match=match):
        dispatch.paged_gather(jnp.zeros(k_shape), jnp.zeros(v_shape), jnp.zeros(table_shape, jnp.int32),
                              jnp.zeros(index_shape, jnp.int32))


def test_a_cache_too_large_for_32_bit_offsets_is_refused():
    huge = jax.ShapeDtypeStruct((2**17, 8, 16, 128), jnp.bfloat16)  # 2^31 elements
    with pytest.raises(ValueError, match="32-bit offsets"):
        jax.eval_shape(pg.paged_gather_pallas, huge, huge, jax.ShapeDtypeStruct((1, 4), jnp.int32),
                       jax.ShapeDtypeStruct((8, 16), jnp.int32))


def test_dispatch_sends_a_cache_too_large_for_the_kernel_to_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(pg, "paged_gather_pallas", lambda *a, **kw: pytest.fail("the kernel took a 2^31 cache"))
    dispatch._log_fallback.cache_clear()  # logged once per process: make this test see it
    huge = jax.ShapeDtypeStruct((2**17, 8, 16, 128), jnp.bfloat16)
    with dispatch.backend(KERNEL_BACKEND), caplog.at_level("INFO", logger="pallas_kernels.dispatch"):
        k_sel, _ = jax.eval_shape(dispatch.paged_gather, huge, huge, jax.ShapeDtypeStruct((1, 4), jnp.int32),
                                  jax.ShapeDtypeStruct((8, 16), jnp.int32))
    assert k_sel.shape == (1, 8, 16, 128)
    assert "32-bit offsets" in caplog.text and "XLA reference" in caplog.text
