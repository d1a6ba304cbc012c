"""A selector pickled for prefill workers (save_selector -> load_selector) selects exactly as the
original: InfiniGen with its skew, HATA with its trained hash projection (no weights directory
needed on the worker)."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from jkv.disagg.selectors import load_selector, save_selector
from jkv.selection import get_selector

L, B, H_KV, H, N, D = 3, 2, 2, 4, 64, 16


def _select_all(sel, K, q, lengths):
    return [np.asarray(sel.select(layer, q, sel.prepare(layer, K, lengths), lengths)) for layer in range(2, L)]


def test_hata_ships_its_projection_and_selects_identically(tmp_path):
    rng = np.random.default_rng(3)
    projection = rng.normal(size=(L, H_KV, D, 64)).astype(np.float32)
    sel = get_selector("hata", max_ratio=0.25, bits=64, projection=projection)
    save_selector(sel, tmp_path / "hata.pkl")
    shipped = load_selector(tmp_path / "hata.pkl")
    assert shipped.name == "hata" and dataclasses.asdict(shipped.config) == dataclasses.asdict(sel.config)
    np.testing.assert_array_equal(np.asarray(shipped.projection), projection)
    K = jnp.asarray(rng.normal(size=(B, H_KV, N, D)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
    lengths = jnp.asarray([N, N - 9])
    for a, b in zip(_select_all(sel, K, q, lengths), _select_all(shipped, K, q, lengths)):
        np.testing.assert_array_equal(a, b)


def test_quest_ships_its_config(tmp_path):
    sel = get_selector("quest", max_ratio=0.3, page_size=8)
    save_selector(sel, tmp_path / "quest.pkl")
    shipped = load_selector(tmp_path / "quest.pkl")
    assert shipped.name == "quest" and shipped.config == sel.config
