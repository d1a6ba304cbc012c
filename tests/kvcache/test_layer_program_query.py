"""The decode worker's layer program computes the layer's q, k, v itself (jkv/disagg/decode_program.py
`project_and_write`): InfiniGen's speculative selection query comes from the previous layer's input
projected inside the program, and must select exactly what the selector selects with that query
projected by `Model.qkv` (the colocated reference, jkv/selection/sparse_decode.py), while the new
token's K, V land in its page slot with mask 1."""
import jax.numpy as jnp
import numpy as np

from jkv.disagg import decode_program
from jkv.disagg.decode_pages import DecodePages
from jkv.disagg.selectors import build_selector
from jkv.kvbuffers.geometry import LOCAL
from jkv.kvcache import PageConfig
from models import tiny_model

B, P, CAPACITY = 2, 16, 512


def test_speculative_query_in_the_program_selects_as_the_reference():
    model = tiny_model("qwen2", 0)
    cfg, sel = model.cfg, build_selector(model, "infinigen")
    layer = cfg.num_layers - 1
    rng = np.random.default_rng(0)
    x, x_prev = (jnp.asarray(rng.standard_normal((B, cfg.hidden_size)), cfg.dtype) for _ in range(2))
    x_query = decode_program.query_input(sel, layer, False, x_prev)
    assert x_query is x_prev  # InfiniGen speculates at this layer
    assert decode_program.query_input(sel, 0, False, x_prev) is None  # never at layer 0
    pos = jnp.asarray([500, 300], jnp.int32)
    cached = rng.standard_normal((B, cfg.num_kv_heads, CAPACITY, cfg.head_dim)).astype(np.float32)
    meta = sel.prepare(layer, jnp.asarray(cached), pos)  # tokens < pos are cached
    pages = DecodePages(cfg, PageConfig(page_size=P, num_pages=B * CAPACITY // P + 1))
    table = jnp.asarray(1 + np.arange(B * CAPACITY // P, dtype=np.int32).reshape(B, -1))
    K, V = pages.cache.kv[layer]
    programs = decode_program.LayerPrograms(cfg, sel)
    meta_out, kv_index, selected, _, _, K, V, mask = programs.fused(
        capacity=CAPACITY, dense=False, params=model.layer_params(layer), state=sel.layer_state(layer), meta=meta,
        x=x, x_query=x_query, pos=pos, now_cached=pos + 1, K=K, V=V, mask=pages.mask, layer=np.int32(layer),
        table=table, fetchable=np.zeros(B, bool))

    _, k, v = model.qkv(layer, x, pos)
    spec = model.qkv(layer, x_prev, pos)[0]
    want_meta = sel.append(layer, meta, k, pos)
    want = np.asarray(sel.select(layer, spec, want_meta, pos + 1))
    np.testing.assert_array_equal(np.asarray(kv_index), want)
    np.testing.assert_array_equal(np.asarray(selected), (want >= 0).sum(1))
    own = np.asarray(sel.select(layer, model.qkv(layer, x, pos)[0], want_meta, pos + 1))
    assert not np.array_equal(own, want)  # the speculative query selects differently: the test can tell
    for b in range(B):  # the new token's K, V in its page slot, its mask 1 for every KV head
        page, slot = int(table[b, int(pos[b]) // P]), int(pos[b]) % P
        np.testing.assert_array_equal(np.asarray(K[page, :, slot]), np.asarray(k[b], K.dtype))
        np.testing.assert_array_equal(np.asarray(V[page, :, slot]), np.asarray(v[b], V.dtype))
        assert (np.asarray(mask[layer, page, :, slot]) == LOCAL).all()
    assert int((np.asarray(mask) == LOCAL).sum()) == B * cfg.num_kv_heads  # nothing else written
    del meta_out
