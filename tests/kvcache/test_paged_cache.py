"""`PagedKVCache` bookkeeping and the page programs of models/paged.py against the dense cache:
page writes read back equal to dense KV, a paged decode step gives the dense `decode_step`'s
logits for a mixed-length batch (llama, qwen2, qwen3, bf16), and chunked prefill equals whole
prefill (logits and KV)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kvcache import NULL_PAGE, OutOfPages, PageConfig, PagedKVCache, bucket_pages, kv_bytes_per_token
from models import paged, tiny_config, tiny_model
from pallas_kernels import dispatch


# ------------------------------------------------------------------ bookkeeping
def test_reserve_grows_idempotently_and_free_is_safe_twice():
    cache = PagedKVCache(tiny_config(), PageConfig(page_size=4, num_pages=8))
    assert cache.reserve("a", 5) == [1, 2]
    assert cache.reserve("a", 3) == [] and cache.reserve("a", 8) == []  # no shrink, still 2 pages
    assert cache.reserve("a", 9) == [3] and cache.length("a") == 9
    cache.reserve("b", 1)
    assert cache.pages_of("a") == [1, 2, 3] and cache.pages_of("b") == [4]
    assert cache.free("a") == 3
    assert cache.free("a") == 0 and cache.free("never") == 0
    assert "a" not in cache and cache.pages_in_use == 1


def test_out_of_pages_leaves_the_request_as_it_was():
    cache = PagedKVCache(tiny_config(), PageConfig(page_size=4, num_pages=4))
    cache.reserve("a", 4)
    with pytest.raises(OutOfPages, match="needs 3 free pages but only 2"):
        cache.reserve("a", 16)
    assert cache.pages_of("a") == [1] and cache.length("a") == 4 and cache.pages_free == 2


def test_grow_keeps_every_live_page_its_id_and_bytes_and_frees_the_new_ones():
    cache = PagedKVCache(tiny_config(), PageConfig(page_size=4, num_pages=4))
    cache.reserve("a", 12)  # pages 1, 2, 3: the pool is full
    K, V = cache.kv[1]
    cache.kv = cache.kv[:1] + ((K.at[2].set(7.0), V.at[3].set(-1.0)),) + cache.kv[2:]
    with pytest.raises(OutOfPages):
        cache.reserve("b", 1)
    cache.grow(8)
    assert cache.page_cfg.num_pages == 8 and cache.pages_free == 4 and cache.pages_in_use == 3
    assert cache.kv[1][0].shape[0] == 8 and cache.bytes_total == 8 * cache.page_bytes
    assert float(cache.kv[1][0][2].min()) == 7.0 and float(cache.kv[1][1][3].max()) == -1.0  # bytes kept
    assert not np.asarray(cache.kv[1][0][4:]).any()  # the new pages are zero
    assert cache.reserve("b", 5) == [4, 5] and cache.pages_of("a") == [1, 2, 3]  # ids kept, new ones lowest first
    cache.grow(6)  # never shrinks
    assert cache.page_cfg.num_pages == 8
    cache.free("a"), cache.free("b")
    cache.allocator.check()
    assert cache.pages_free == 7


def test_table_pads_with_the_null_page_and_buckets_its_width():
    cache = PagedKVCache(tiny_config(), PageConfig(page_size=2, num_pages=32))
    cache.reserve("a", 3)
    cache.reserve("b", 11)
    table = cache.table(["a", None, "b"])
    assert table.dtype == np.int32 and table.shape == (3, bucket_pages(6)) == (3, 8)
    assert table[0].tolist() == [1, 2] + [NULL_PAGE] * 6
    assert table[1].tolist() == [NULL_PAGE] * 8
    assert table[2, :6].tolist() == cache.pages_of("b")
    assert cache.table(["b"], max_pages=2).tolist() == [cache.pages_of("b")[:2]]
    assert [bucket_pages(n) for n in (0, 4, 5, 300, 513, 700)] == [4, 4, 8, 512, 768, 768]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_dtype_is_the_model_dtype_and_stats_count_bytes(dtype):
    cfg = tiny_config(dtype=dtype)
    cache = PagedKVCache(cfg, PageConfig(page_size=4, num_pages=6))
    assert len(cache.kv) == cfg.num_layers
    assert all(a.shape == (6, cfg.num_kv_heads, 4, cfg.head_dim) and a.dtype == jnp.dtype(dtype)
               for layer in cache.kv for a in layer)
    cache.reserve("a", 5)
    per_token = kv_bytes_per_token(cfg)
    assert per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    assert cache.stats() == {"kv_pages_in_use": 2, "kv_pages_free": 3, "kv_bytes_in_use": 2 * 4 * per_token,
                             "kv_bytes_total": 6 * 4 * per_token, "kv_requests": 1,
                             "kv_h2d_arrived_bytes": 0, "kv_h2d_fetched_bytes": 0, "kv_h2d_other_bytes": 0}


# ------------------------------------------------------------------ page writes
def _interleaved(cache, lengths):
    """Reserve one page at a time, round robin, so every request's pages are scattered."""
    for n in range(1, max(lengths) + 1):
        for b, length in enumerate(lengths):
            if n <= length:
                cache.reserve(b, n)


def test_prefill_and_decode_writes_read_back_as_the_dense_kv():
    cfg = tiny_config(num_layers=2)
    rng = np.random.default_rng(0)
    lengths = [5, 0, 13]
    cache = PagedKVCache(cfg, PageConfig(page_size=4, num_pages=12))
    _interleaved(cache, [n + 1 for n in lengths])
    B, T = 3, 16
    kv = [tuple(jnp.asarray(rng.standard_normal((B, cfg.num_kv_heads, T, cfg.head_dim)), jnp.float32)
                for _ in "kv") for _ in range(cfg.num_layers)]
    table = cache.table([0, 1, 2])
    kv_pages = paged.paged_write_prefill(cache.kv, table, [k for k, _ in kv], [v for _, v in kv],
                                         jnp.zeros(3, jnp.int32), jnp.asarray(lengths, jnp.int32))
    new = jnp.asarray(rng.standard_normal((cfg.num_layers, B, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    kv_pages = paged.paged_write(kv_pages, table, jnp.asarray(lengths, jnp.int32), new, -new)
    for l in range(cfg.num_layers):
        got_k = np.asarray(paged.gather_context(kv_pages[l][0], table))
        got_v = np.asarray(paged.gather_context(kv_pages[l][1], table))
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(got_k[b, :, :n], np.asarray(kv[l][0])[b, :, :n])
            np.testing.assert_array_equal(got_v[b, :, :n], np.asarray(kv[l][1])[b, :, :n])
            np.testing.assert_array_equal(got_k[b, :, n], np.asarray(new[l, b]))
            np.testing.assert_array_equal(got_v[b, :, n], -np.asarray(new[l, b]))
            np.testing.assert_array_equal(got_k[b, :, n + 1:cache.page_size * len(cache.pages_of(b))], 0)


def test_idle_rows_and_positions_past_the_table_write_only_the_null_page():
    cfg = tiny_config(num_layers=1)
    cache = PagedKVCache(cfg, PageConfig(page_size=4, num_pages=4))
    cache.reserve("a", 4)
    table = np.stack([cache.table(["a"], 1)[0], [NULL_PAGE]])  # row 1: idle
    new = jnp.ones((1, 2, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    kv_pages = paged.paged_write(cache.kv, table, jnp.asarray([4, 2], jnp.int32), new, new)  # 4: past 1 page
    K = np.asarray(kv_pages[0][0])
    assert (K[NULL_PAGE] != 0).any() and (K[1:] == 0).all()


# ------------------------------------------------------- paged decode == dense
def _mixed_batch(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    T = max(lengths)
    tokens = rng.integers(3, model.cfg.vocab_size, (len(lengths), T)).astype(np.int32)
    return tokens, np.asarray(lengths, np.int32)


@pytest.mark.parametrize("family,dtype,tol", [("llama", "float32", 1e-4), ("qwen2", "float32", 1e-4),
                                              ("qwen3", "float32", 1e-4), ("llama", "bfloat16", 0.15)])
def test_paged_decode_steps_match_the_dense_decode_step(family, dtype, tol):
    model = tiny_model(family, dtype=dtype)
    tokens, lengths = _mixed_batch(model, [1, 9, 4, 21])
    _, kv = model.prefill(tokens, lengths)
    dense = model.cache_from_prefill(kv, 32)
    cache = PagedKVCache(model.cfg, PageConfig(page_size=4, num_pages=24))
    assert cache.dtype == jnp.dtype(dtype)
    rows = list(range(len(lengths)))
    _interleaved(cache, lengths.tolist())
    cache.kv = model.write_prefill_pages(cache.kv, cache.table(rows), kv, lengths)
    positions, tok = lengths.copy(), np.array([5, 6, 7, 8], np.int32)
    for _ in range(6):  # crosses page boundaries of every row
        for b in rows:
            cache.reserve(b, int(positions[b]) + 1)
        got, cache.kv = model.paged_decode_step(cache.kv, cache.table(rows), tok, positions)
        want, dense = model.decode_step(dense, tok, positions)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        tok = np.asarray(jnp.argmax(want, -1), np.int32)
        positions = positions + 1


# ------------------------------------------------------ chunked == whole prefill
@pytest.mark.parametrize("family,chunk,lengths", [("llama", 8, [3, 19, 30]), ("qwen3", 16, [16, 1, 33]),
                                                  ("qwen2", 1024, [1100])])
def test_chunked_prefill_equals_whole_prefill(family, chunk, lengths):
    """Chunk 1024 > PREFILL_QUERY_CHUNK runs the chunk's queries in sub-chunks (lax.map)."""
    model = tiny_model(family)
    tokens, lengths = _mixed_batch(model, lengths, seed=1)
    want_logits, want_kv = model.prefill(tokens, lengths)
    cache = PagedKVCache(model.cfg, PageConfig(page_size=4, num_pages=4 + sum(-(-n // 4) for n in lengths)))
    rows = list(range(len(lengths)))
    _interleaved(cache, lengths.tolist())
    n_chunks = -(-int(lengths.max()) // chunk)
    padded = np.zeros((len(rows), n_chunks * chunk), np.int32)
    padded[:, :tokens.shape[1]] = tokens
    got_logits = np.zeros_like(np.asarray(want_logits))
    for i in range(n_chunks):
        s = i * chunk
        table = cache.table(rows, max_pages=-(-(s + chunk) // 4))
        chunk_len = np.clip(lengths - s, 0, chunk)
        logits, cache.kv = model.prefill_chunk(cache.kv, table, padded[:, s:s + chunk], np.full(len(rows), s), chunk_len)
        ends = (lengths - 1) // chunk == i
        got_logits[ends] = np.asarray(logits)[ends]
    np.testing.assert_allclose(got_logits, np.asarray(want_logits), rtol=1e-4, atol=1e-4)
    table = cache.table(rows)
    for (K, V), (Kp, Vp) in zip(want_kv, cache.kv):
        for want, pages in ((K, Kp), (V, Vp)):
            got = np.asarray(paged.gather_context(pages, table))
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(got[b, :, :n], np.asarray(want)[b, :, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block,max_pages", [(8, 7), (16, 8), (512, 9)])
def test_chunk_attention_reads_the_context_block_by_block(monkeypatch, block, max_pages):
    """The blocked chunk attention (a loop over CONTEXT_BLOCK tokens of context up to max(start))
    equals attention over the whole gathered table, masked: starts inside a block, at a block edge,
    0, a table width that is not a multiple of the block, a row with nothing to attend (zeros)."""
    monkeypatch.setattr(paged, "CONTEXT_BLOCK", block)
    rng = np.random.default_rng(3)
    B, C, H, H_kv, D, P, num_pages = 5, 6, 4, 2, 8, 4, 40
    q = jnp.asarray(rng.standard_normal((B, C, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, C, H_kv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, C, H_kv, D)), jnp.float32)
    K_pages = jnp.asarray(rng.standard_normal((num_pages, H_kv, P, D)), jnp.float32)
    V_pages = jnp.asarray(rng.standard_normal((num_pages, H_kv, P, D)), jnp.float32)
    table = jnp.asarray(rng.integers(1, num_pages, (B, max_pages)), jnp.int32)
    start = jnp.asarray([13, 0, 8, max_pages * P - 1, 0], jnp.int32)
    lengths = jnp.asarray([6, 3, 1, 6, 0], jnp.int32)
    got = paged.chunk_attention(q, k, v, K_pages, V_pages, table, start, lengths)
    want = paged.context_attention(q, k, v, paged.gather_context(K_pages, table), paged.gather_context(V_pages, table),
                                   start, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got[4]).any()  # start 0, no valid chunk token: every key masked


def test_chunk_attention_never_reads_the_blocks_past_the_context(monkeypatch):
    """The loop stops at the last block holding context (cost follows the chunk's position, not
    the table's width): pages further on are not read, so NaN there cannot reach the output."""
    monkeypatch.setattr(paged, "CONTEXT_BLOCK", 8)  # 2 pages of 4 a block
    rng = np.random.default_rng(4)
    B, C, H, H_kv, D, P = 2, 4, 2, 1, 8, 4
    K_pages = rng.standard_normal((6, H_kv, P, D)).astype(np.float32)
    V_pages = K_pages.copy()
    K_pages[5] = V_pages[5] = np.nan  # the pages of blocks 1..3
    table = jnp.asarray([[1, 2, 5, 5, 5, 5, 5, 5], [3, 4, 5, 5, 5, 5, 5, 5]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, C, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, C, H_kv, D)), jnp.float32)
    out = paged.chunk_attention(q, kv, kv, jnp.asarray(K_pages), jnp.asarray(V_pages), table,
                                jnp.asarray([5, 8], jnp.int32), jnp.asarray([4, 4], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


def _abstract_decode_step(max_pages: int):
    """(jitted paged decode compute of a 2-layer tiny model, its abstract args for 3 rows)."""
    import functools

    import jax

    from models.transformer import init_params

    cfg = tiny_config(num_layers=2)
    params = jax.eval_shape(lambda: init_params(cfg))
    kv = jax.eval_shape(lambda: paged.init_pages(cfg, 80, 4))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return (jax.jit(functools.partial(paged.paged_decode_step_compute, cfg)),
            (params, kv, i32(3, max_pages), i32(3), i32(3)))


def test_the_decode_program_does_not_grow_with_the_table_width():
    """Pages are read by one gather a layer, not a loop over pages: the lowered CPU program has the
    same gather / slice / loop ops for a 2-page and a 64-page table."""
    import re

    def ops(max_pages):
        step, args = _abstract_decode_step(max_pages)
        with dispatch.cpu_kernels(False):  # the reference's gather (the CPU kernel has none)
            text = step.lower(*args).as_text()
        return sorted(re.findall(r"stablehlo\.(gather|dynamic_slice|while)", text))

    assert ops(2) == ops(64) and "gather" in ops(2)


def test_each_layer_gathers_its_pages_after_the_previous_layer_ran():
    """The page gather's copy of a layer's KV is made just before that layer's attention: XLA's
    scheduler hoisted every layer's gather (it read only parameters) to the program start, so all
    layers' copies were live at once and read back cold (docs/performance.md, "Where decode time
    goes"). In the compiled CPU schedule, the first instruction reading layer 1's K or V pages comes
    after the one reading layer 0's output projection."""
    import re

    import jax

    step, args = _abstract_decode_step(16)
    with dispatch.cpu_kernels(False):  # the XLA reference, what a GPU without the Mosaic kernel runs
        text = step.lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):].splitlines()[1:]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(args)]

    def first_use(path_fragment):  # schedule index of the first instruction reading that parameter
        number = next(i for i, p in enumerate(paths) if p.startswith(path_fragment))
        name = next(re.match(r"\s*(%\S+) = ", l).group(1) for l in entry if f" parameter({number})" in l)
        return next(i for i, l in enumerate(entry) if re.search(re.escape(name) + r"[,)]", l.partition(" = ")[2]))

    o_proj_0 = first_use("[0]['layers'][0]['o_proj']")
    assert first_use("[1][1][0]") > o_proj_0 and first_use("[1][1][1]") > o_proj_0


def test_a_nan_query_row_leaves_the_other_rows_paged_attention_unchanged():
    """The reference's page indices depend on the query (so XLA cannot hoist the gather); each
    row's on its own query only: a NaN in one request's query must not redirect another
    request's page reads (it would silently attend over the null page)."""
    from pallas_kernels.mosaic_attention import paged_decode_attention_partials_reference as ref

    rng = np.random.default_rng(0)
    num_pages, H_kv, P, D, B, H = 9, 2, 4, 8, 3, 4
    k = jnp.asarray(rng.standard_normal((num_pages, H_kv, P, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_pages, H_kv, P, D)), jnp.float32)
    table = jnp.asarray([[1, 2, 3], [4, 5, 0], [6, 7, 8]], jnp.int32)
    lengths = jnp.asarray([10, 7, 12], jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.float32)
    out, lse = ref(q, k, v, table, lengths)
    bad_out, bad_lse = ref(q.at[0, 0, 0].set(jnp.nan), k, v, table, lengths)
    np.testing.assert_array_equal(np.asarray(bad_out[1:]), np.asarray(out[1:]))
    np.testing.assert_array_equal(np.asarray(bad_lse[1:]), np.asarray(lse[1:]))
    assert np.isnan(np.asarray(bad_out[0])).any()
