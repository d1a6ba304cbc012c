"""Landing inside a decode layer's program (jkv/disagg/decode_pages.py `landing`,
jkv/kvcache/sparse.py `land_pieces`): the rows that wait in staging cross host->device as real
pieces of exactly their count (a size the count lacks is the device-resident null piece, a bulk
past 2**LANDING_BITS - 1 rows lands by `land`'s own programs), and after `land_pieces` the pages
hold every row, its mask 1, while the null page keeps PAD and nothing else changes."""
import types

import jax
import numpy as np
import pytest

from jkv.disagg import decode_pages
from jkv.disagg.decode_pages import DecodePages
from jkv.kvbuffers.geometry import LOCAL, PAD, REMOTE
from jkv.kvcache import NULL_PAGE, PageConfig
from jkv.kvcache import sparse
from models import tiny_config

P = 16
_land_pieces = jax.jit(sparse.land_pieces)  # one program for every case (the pieces' shapes are fixed)


class _Clock:
    def __init__(self):
        self.counts = {}

    def count(self, key, n):
        self.counts[key] = self.counts.get(key, 0) + n


def _request(cfg, n, arrived, fetched, rng):
    """A LiveRequest's landing view: staging rows [2, L, H_kv, N, D] with its staging mask LOCAL over
    `arrived` tokens and `fetched` (bool[L, H_kv, N]) rows fetched on demand."""
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    mask = np.full((L, n), REMOTE, np.int8)
    mask[:, arrived] = LOCAL
    kv = types.SimpleNamespace(kv=rng.standard_normal((2, L, H, n, D)).astype(np.float32), mask=mask)
    return types.SimpleNamespace(rid="r", kv=kv, geometry=types.SimpleNamespace(num_tokens=n), fetched=fetched,
                                 on_device=np.zeros((L, H, n), bool), landed=np.zeros(L, bool), recomputed=False)


# (arrived tokens (every head), fetched rows): rows 0, 1, 5, 377, 1023 (every piece), 2000 (a bulk)
@pytest.mark.parametrize("n_arrived,n_fetched", [(0, 0), (0, 1), (2, 1), (150, 77), (511, 1), (700, 600)])
def test_landing_pieces_carry_exactly_the_waiting_rows_and_land_them(n_arrived, n_fetched):
    cfg = tiny_config("llama", num_kv_heads=2, head_dim=8)
    n = 2048
    pages = DecodePages(cfg, PageConfig(page_size=P, num_pages=n // P + 2))
    pages.plan("r", n, n)
    rng = np.random.default_rng(n_arrived + n_fetched)
    fetched = np.zeros((cfg.num_layers, cfg.num_kv_heads, n), bool)
    layer = 1
    fetched[layer, 1, rng.choice(np.arange(n_arrived, n), n_fetched, replace=False)] = True
    lv = _request(cfg, n, np.arange(n_arrived), fetched, rng)
    want = np.zeros((cfg.num_kv_heads, n), bool)
    want[:, :n_arrived] = True
    want |= fetched[layer]
    rows = int(want.sum())
    table = pages.table(["r"], n)
    clock = _Clock()
    landing = pages.landing([lv], layer, table, clock)
    if rows == 0:
        assert landing is None and clock.counts.get("h2d_arrived_bytes_n", 0) == 0
        return
    inside = rows % (1 << decode_pages.LANDING_BITS)
    assert len(landing) == decode_pages.LANDING_BITS
    for b, piece in enumerate(landing):
        assert all(part.shape[0] == 1 << b for part in piece)
        real = bool(inside >> b & 1)
        assert all(isinstance(part, np.ndarray) == real for part in piece)  # only real rows are host arrays
        if not real:
            assert all(isinstance(part, jax.Array) for part in piece) and not np.asarray(piece[0]).any()
    host_rows = sum(piece[0].shape[0] for piece in landing if isinstance(piece[0], np.ndarray))
    assert host_rows == inside  # no padding row crosses
    assert clock.counts.get("h2d_arrived_bytes_n", 0) == cfg.num_kv_heads * n_arrived * pages.row_bytes
    assert clock.counts.get("h2d_fetched_bytes_n", 0) == n_fetched * pages.row_bytes
    assert lv.on_device[layer].sum() == rows and lv.on_device[layer][want].all()
    K, V = pages.cache.kv[layer]
    K, V, mask = _land_pieces(K, V, pages.mask, np.int32(layer), landing)
    K, V, mask = np.asarray(K), np.asarray(V), np.asarray(mask)
    own = np.asarray(pages.cache.pages_of("r"))
    token_mask = mask[layer, own].transpose(1, 0, 2).reshape(cfg.num_kv_heads, -1)[:, :n]
    assert ((token_mask == LOCAL) == want).all()  # a 1 exactly for every landed row
    assert (mask[layer, NULL_PAGE] == PAD).all()  # the null pieces write PAD to the null page
    heads, tokens = np.nonzero(want)
    got_k = K[own[tokens // P], heads, tokens % P]
    np.testing.assert_array_equal(got_k, lv.kv.kv[0, layer, heads, tokens])
    np.testing.assert_array_equal(V[own[tokens // P], heads, tokens % P], lv.kv.kv[1, layer, heads, tokens])
    others = np.delete(np.arange(mask.shape[1]), np.concatenate([own, [NULL_PAGE]]))
    assert (mask[:, others] == PAD).all() and not K[others].any()  # no other page written
