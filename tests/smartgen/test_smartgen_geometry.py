"""KV geometry (blocks, runs), host pool bookkeeping and leak accounting — no JAX."""
import numpy as np
import pytest

from jkv.kvbuffers import LOCAL, PAD, REMOTE, BlockGeometry, KVBufferPool, PoolExhausted


@pytest.mark.parametrize("n, M, m_eff, bt", [(10, 1024, 10, 1), (2048, 1024, 1024, 2), (2049, 1024, 1024, 3),
                                              (100, 7, 7, 15), (5, 5, 5, 1)])
def test_blocks_per_layer_and_tokens(n, M, m_eff, bt):
    g = BlockGeometry(n, 4, M)
    assert (g.blocks_per_layer, g.block_tokens, g.num_blocks) == (m_eff, bt, 4 * m_eff)
    covered = np.zeros(n, int)
    for m in range(g.blocks_per_layer):
        start, stop = g.token_range(m)
        covered[start:stop] += 1
    assert (covered == 1).all()  # every token in exactly one block of a layer


def test_overshooting_blocks_are_empty_and_skipped():
    g = BlockGeometry(2049, 2, 1024)  # 1024 blocks of 3 tokens cover 3072 > 2049
    assert g.token_range(683) == (2049, 2049) and g.is_empty(683)
    assert g.token_range(682) == (2046, 2049)
    ids = g.nonempty_ids()
    assert len(ids) == 2 * 683 and ids[683] == 1024  # layer 1 starts at flat id M_eff


def test_runs_coalesce_contiguous_blocks():
    g = BlockGeometry(10, 1, 5)  # 2 tokens per block
    assert g.runs([3, 0, 1, 4]) == [(0, 4), (6, 10)]
    assert g.runs([]) == []


def test_block_of_and_split():
    g = BlockGeometry(100, 3, 7)
    assert g.block_of([0, 14, 15, 99]).tolist() == [0, 0, 1, 6]
    assert g.split(7 * 2 + 3) == (2, 3)
    with pytest.raises(ValueError, match="block_id"):
        g.split(21)


def test_geometry_validates():
    with pytest.raises(ValueError, match="num_tokens"):
        BlockGeometry(0, 2)


def test_pool_layout_offsets_and_mask():
    pool = KVBufferPool(num_layers=3, num_kv_heads=2, head_dim=4)
    kv = pool.allocate("a", prompt_len=5, capacity=8)
    assert kv.kv.ctypes.data % 4096 == 0  # page-aligned for registration
    assert kv.mask.shape == (3, 8) and (kv.mask[:, :5] == REMOTE).all() and (kv.mask[:, 5:] == PAD).all()
    flat = kv.kv.reshape(-1)
    kv.kv[1, 2, 1, 6, 3] = 7.0
    assert flat[kv.offset(1, 2, 1, 6) // 4 + 3] == 7.0
    assert kv.mask_offset(2, 3) == 2 * 8 + 3
    assert not kv.all_local()
    kv.mask[:, :5] = LOCAL
    assert kv.all_local() and kv.local_fraction() == 1.0


def test_pool_capacity_and_leak_accounting():
    pool = KVBufferPool(2, 1, 4, capacity_bytes=2 * (2 * 2 * 1 * 8 * 4 * 4 + 2 * 8))
    pool.allocate("a", 3, 8)
    pool.allocate("b", 8, 8)
    with pytest.raises(PoolExhausted, match="free"):
        pool.allocate("c", 1, 8)
    with pytest.raises(ValueError, match="already"):
        pool.allocate("a", 1, 8)
    assert pool.live() == ["a", "b"]
    assert pool.free("a") and not pool.free("a")
    pool.free("b")
    assert pool.live() == [] and pool.bytes_in_use == 0
