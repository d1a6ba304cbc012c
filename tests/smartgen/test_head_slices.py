"""Per-KV-head-slice blocks (jkv/disagg/head_slices.py, issue 21 item 2): what a prefill worker
writes into the decode side's pool, one write_many per (layer, head slice), applied here to a
decode-side RequestKV without a transport; a malformed head range writes nothing."""
import numpy as np
import pytest

from jkv.disagg.head_slices import ExportCounters, push_slices, slice_items
from jkv.kvbuffers.fetch import check_heads
from jkv.kvbuffers.geometry import LOCAL, REMOTE, BlockGeometry
from jkv.kvbuffers.pool import RequestKV

L, H, N, CAP, D = 3, 4, 20, 24, 2


class RecordingPeer:
    """Stands in for a transport Peer: keeps every write_many's items, in order."""

    def __init__(self):
        self.calls = []

    def write_many(self, items):
        self.calls.append(list(items))
        return f"transfer-{len(self.calls)}"


def _prefill_pool(seed=0):
    return np.random.default_rng(seed).standard_normal((2, L, H, N, D)).astype(np.float32)


def _apply(calls, dest: RequestKV):
    """Apply writes as the decode side's transport does: bytes at offsets, mask after its rows.
    Returns the mask bytes seen after each write_many (a snapshot per call)."""
    kv_bytes, mask_bytes = dest.kv.reshape(-1).view(np.uint8), dest.mask.reshape(-1).view(np.uint8)
    masks = []
    for items in calls:
        for region, offset, data, then in items:
            assert region == "kv/r"
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            kv_bytes[offset:offset + raw.size] = raw
            if then is not None:
                mregion, moff, value = then
                assert mregion == "mask/r"
                mask_bytes[moff:moff + len(value)] = np.frombuffer(value, np.uint8)
        masks.append(dest.mask.copy())
    return masks


@pytest.mark.parametrize("slices", [((0, 4),), ((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4)), ((0, 3), (3, 4))])
def test_each_head_slice_is_one_block_and_the_mask_flips_after_the_last(slices):
    kv = _prefill_pool()
    geometry = BlockGeometry(N, L, 5)  # 4 tokens per block
    layer, runs = 1, geometry.runs([0, 1, 3])  # two runs: [0, 8) and [12, 16)
    peer = RecordingPeer()
    sent = push_slices(peer, "r", kv, CAP, layer, runs, slices)
    assert [heads for heads, _, _ in sent] == list(slices)
    assert [t for _, t, _ in sent] == [f"transfer-{i + 1}" for i in range(len(slices))]
    assert sum(n for _, _, n in sent) == 2 * H * 12 * D * 4  # K and V rows of every head, 12 tokens
    dest = RequestKV("r", L, H, CAP, D, N)
    masks = _apply(peer.calls, dest)
    for before in masks[:-1]:  # a row is LOCAL only once every slice (every head) has been written
        assert not (before == LOCAL).any()
    tokens = np.r_[0:8, 12:16]
    assert (masks[-1][layer, tokens] == LOCAL).all()
    others = np.setdiff1d(np.arange(N), tokens)
    assert (masks[-1][layer, others] == REMOTE).all() and (masks[-1][[0, 2], :N] == REMOTE).all()
    np.testing.assert_array_equal(dest.kv[:, layer, :, tokens], kv[:, layer, :, tokens])
    assert not dest.kv[:, layer, :, others].any() and not dest.kv[:, [0, 2]].any()
    # every slice's items hold only its own heads
    for (start, stop), items in zip(slices, peer.calls):
        heads = {(off // (CAP * D * 4)) % H for _, off, _, _ in items}
        assert heads == set(range(start, stop))


@pytest.mark.parametrize("valid, bad", [((0, 1), (1, 5)), ((1, 3), (-1, 1)), ((0, 2), (2, 2)), ((0, 2), ("a", 4))])
def test_a_malformed_head_range_is_rejected_before_any_write(valid, bad):
    peer = RecordingPeer()
    with pytest.raises(ValueError, match="KV-head range") as err:
        push_slices(peer, "r", _prefill_pool(), CAP, 0, [(0, 4)], (valid, bad))
    assert str(bad[0]) in str(err.value)
    assert peer.calls == []  # the valid first slice was not written either


@pytest.mark.parametrize("slices", [((0, 2),), ((0, 2), (1, 4)), ((0, 2), (2, 4), (2, 4))])
def test_slices_must_cover_each_head_once(slices):
    peer = RecordingPeer()
    with pytest.raises(ValueError, match="cover each of the 4 KV heads once"):
        push_slices(peer, "r", _prefill_pool(), CAP, 0, [(0, 4)], slices)
    assert peer.calls == []


def test_check_heads_names_the_range_and_the_fix():
    check_heads((0, 4), 4)
    check_heads((3, 4), 4)
    with pytest.raises(ValueError, match=r"\[2, 6\) is outside the model's 4 KV heads.*0 <= start < stop <= 4"):
        check_heads((2, 6), 4)
    with pytest.raises(ValueError, match="must be a \\(start, stop\\) pair"):
        check_heads((1,), 4)


def test_slice_items_without_runs_write_nothing():
    assert slice_items("r", _prefill_pool(), CAP, 0, (0, 2), [], True) == []
    assert push_slices(RecordingPeer(), "r", _prefill_pool(), CAP, 0, [], ((0, 2), (2, 4))) == []


def test_export_counters_count_by_slice():
    counters = ExportCounters(((0, 1), (1, 2)))
    counters.exported(4)
    counters.pushed((1, 2))
    counters.held_only((0, 1))
    assert counters.snapshot() == dict(copies=4, layers=1, blocks={"0:1": 0, "1:2": 1}, held={"0:1": 1, "1:2": 0})
