"""Importance (SmartGen Eq. 1), Kr (Eq. 2), profile files and proactive orders, by hand."""
import math

import numpy as np
import pytest

from jkv.kvbuffers import BlockGeometry
from jkv.transfer import ImportanceProfile, ProfileBin, TransferConfig, block_importance, compute_kr
from jkv.transfer.plan import proactive_order


def test_eq1_by_hand():
    # L=3, H_kv=2, N=4, M=2 -> blocks of 2 tokens; layers 0,1 are +inf.
    counts = np.zeros((3, 2, 4))
    counts[2, 0] = [4, 0, 1, 1]
    counts[2, 1] = [2, 2, 0, 0]
    imp = block_importance(counts, BlockGeometry(4, 3, 2))
    assert np.isinf(imp[:2]).all() and (imp[:2] > 0).all()
    # block (2, 0): entries (h0: 4, 0), (h1: 2, 2) -> 8 / 4; block (2, 1): (1, 1, 0, 0) -> 2 / 4
    assert imp[2].tolist() == [2.0, 0.5]


def test_eq1_uneven_last_block_and_empty_blocks():
    counts = np.ones((3, 1, 5))
    counts[2, 0, 4] = 9.0
    imp = block_importance(counts, BlockGeometry(5, 3, 2))  # blocks of 3 tokens: [0,3), [3,5)
    assert imp[2].tolist() == [1.0, 5.0]  # (1 + 9) / 2
    g = BlockGeometry(7, 3, 4)  # 4 blocks of 2 tokens over 7 tokens: last block [6,7)
    imp = block_importance(np.ones((3, 1, 7)), g)
    assert imp[2].tolist() == [1.0, 1.0, 1.0, 1.0]
    g = BlockGeometry(5, 3, 4)  # blocks of 2: [0,2) [2,4) [4,5) and one empty block
    assert block_importance(np.ones((3, 1, 5)), g)[2, 3] == -np.inf


def test_eq1_shape_check():
    with pytest.raises(ValueError, match="geometry"):
        block_importance(np.ones((3, 1, 6)), BlockGeometry(5, 3, 2))


@pytest.mark.parametrize("M, L, tp, tt, expected", [
    (1024, 32, 1.0, 6.5, math.floor(1024 * 31 / 6.5)),  # Eq. 2 inside the range
    (1024, 32, 1.0, 100.0, 2048),  # slow link: clipped up to 2M (the dense layers)
    (1024, 32, 1.0, 0.1, 32 * 1024),  # fast link: clipped to L*M = full transfer
    (4, 2, 1.0, 10.0, 8),  # 2M == L*M
    (8, 4, 0.0, 1.0, 16),  # no prefill time: only the dense layers
    (8, 4, 1.0, 0.0, 32),  # free link: everything
])
def test_eq2_kr_and_clipping(M, L, tp, tt, expected):
    assert compute_kr(M, L, tp, tt) == expected


def test_kr_from_config_falls_back_to_full_on_fast_link():
    g = BlockGeometry(4096, 30, 1024)
    nbytes = 2 * 30 * 3 * 4096 * 64 * 4
    slow = TransferConfig(mode="smartgen", bandwidth_bps=1e9)
    fast = TransferConfig(mode="smartgen", bandwidth_bps=1e12)
    assert slow.kr(g, prefill_s=1.0, request_bytes=nbytes) == math.floor(1024 * 29 * 1.0 / (nbytes * 8 / 1e9))
    assert fast.kr(g, prefill_s=1.0, request_bytes=nbytes) == g.num_blocks
    assert TransferConfig(mode="full").kr(g, None, nbytes) == g.num_blocks
    assert TransferConfig(kr_fraction=0.25).kr(g, None, nbytes) == g.num_blocks // 4
    with pytest.raises(ValueError, match="bandwidth"):
        TransferConfig(mode="partial").kr(g, 1.0, nbytes)


def test_kr_leaves_the_metadata_its_share_of_the_prefill_window():
    g = BlockGeometry(2048, 30, 64)  # M = 64 -> M (L - 1) = 1856
    cfg = TransferConfig(mode="smartgen", bandwidth_bps=8e7)  # 10 MB/s: 10 MB of KV -> Tt = 1 s
    assert cfg.kr(g, prefill_s=0.5, request_bytes=10_000_000) == 928  # 1856 * 0.5 / 1
    # 1 MB of selector metadata takes 0.1 s of the 0.5 s window: 1856 * 0.4 = 742.4
    assert cfg.kr(g, prefill_s=0.5, request_bytes=10_000_000, metadata_bytes=1_000_000) == 742
    # metadata alone fills the window: only the two dense layers go (2M)
    assert cfg.kr(g, prefill_s=0.5, request_bytes=10_000_000, metadata_bytes=6_000_000) == 128


def test_config_validation_and_modes():
    assert TransferConfig(mode="+speculative").mode == "smartgen"
    assert TransferConfig(mode="partial", strategy="random").effective_strategy == "sequential"
    flags = {m: (TransferConfig(mode=m).parallel_lanes, TransferConfig(mode=m).speculative)
             for m in ("partial", "+profile", "+parallel", "smartgen")}
    assert flags == {"partial": (False, False), "+profile": (False, False), "+parallel": (True, False),
                     "smartgen": (True, True)}
    for bad in (dict(mode="fast"), dict(strategy="best"), dict(spec_ratio=0), dict(max_blocks=0),
                dict(kr_fraction=1.5)):
        with pytest.raises(ValueError):
            TransferConfig(**bad)


def test_profile_save_load_closest_bin_and_tp(tmp_path):
    imp = np.arange(12, dtype=float).reshape(3, 4)
    imp[:2] = np.inf
    prof = ImportanceProfile("infinigen", "tiny", 4, [ProfileBin(400, imp, 2.0), ProfileBin(100, imp * 2, 0.5)],
                             bandwidth_bps=1e9)
    path = tmp_path / "p.npz"
    prof.save(path)
    back = ImportanceProfile.load(path)
    assert [b.prompt_len for b in back.bins] == [100, 400] and back.bandwidth_bps == 1e9
    assert back.closest_bin(240).prompt_len == 100 and back.closest_bin(260).prompt_len == 400
    np.testing.assert_array_equal(back.importance_for(BlockGeometry(390, 3, 4)), imp)
    assert back.prefill_time(50) == pytest.approx(0.25) and back.prefill_time(250) == pytest.approx(1.25)
    assert back.prefill_time(800) == pytest.approx(4.0)
    # resampling to fewer blocks keeps relative positions
    assert back.importance_for(BlockGeometry(2, 3, 4))[2].tolist() == [18.0, 22.0]  # bin 100: imp * 2
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(ValueError, match="jkv profile"):
        ImportanceProfile.load(tmp_path / "bad.npz")


def test_proactive_orders():
    g = BlockGeometry(8, 3, 4)  # 2 tokens per block; ids l*4+m
    imp = np.full((3, 4), np.inf)
    imp[2] = [0.1, 3.0, 3.0, 0.5]
    prof = proactive_order("profile", g, imp)
    assert prof.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 8]  # ties in address order
    assert proactive_order("sequential", g).tolist() == list(range(12))
    stream = proactive_order("streaming", g)
    assert stream[:3].tolist() == [0, 4, 8] and stream[3:6].tolist() == [3, 7, 11]  # sinks, then newest
    rnd = proactive_order("random", g, seed=1)
    assert sorted(rnd.tolist()) == list(range(12)) and rnd.tolist() != list(range(12))
    with pytest.raises(ValueError, match="profile"):
        proactive_order("profile", g, None)


def test_build_profile_counts_selections_by_hand(model):
    """Sequential selection keeps tokens [0, ceil(0.2 * N)) of every head: with a 40-token prompt
    and 3 decode steps (N = 41, 42, 43 -> 9 tokens each) S(e) = 3 for tokens 0..8, so with
    blocks of 5 tokens I[l>=2] = [3, 12/5, 0, ...] (Eq. 1)."""
    from jkv.selection.registry import get_selector
    from jkv.transfer.profile import build_profile

    prompt = list(range(3, 43))
    prof = build_profile(model, get_selector("sequential"), "sequential", {40: [prompt]}, steps=3, max_blocks=8)
    (b,) = prof.bins
    assert b.prompt_len == 40 and b.importance.shape == (3, 8) and b.prefill_s > 0
    assert np.isinf(b.importance[:2]).all()
    np.testing.assert_allclose(b.importance[2], [3.0, 2.4, 0, 0, 0, 0, 0, 0])


def test_metadata_bytes_for_kr_match_what_prefill_ships(model, selectors):
    """Eq. 2's metadata share is computed from shapes on the decode side; it must equal the
    bytes of the selector metadata the prefill side prepares (layers past the dense ones)."""
    import jax
    import jax.numpy as jnp

    from jkv.disagg.decode_worker import DecodeWorker
    from tests.smartgen.smartgen_cases import SECRET

    cfg, n = model.cfg, 77
    K = jnp.asarray(np.random.default_rng(0).normal(size=(1, cfg.num_kv_heads, n, cfg.head_dim)), jnp.float32)
    for name, sel in selectors.items():
        decode = DecodeWorker(model, sel, TransferConfig(mode="full"), secret=SECRET)
        try:
            got = decode._metadata_bytes(n)
        finally:
            decode.close()
        shipped = sum(np.asarray(x).nbytes for layer in range(sel.config.dense_layers, cfg.num_layers)
                      for x in jax.tree_util.tree_leaves(sel.prepare(layer, K, jnp.asarray([n], jnp.int32))))
        assert got == shipped > 0, name
