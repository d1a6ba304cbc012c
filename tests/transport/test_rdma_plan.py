"""RDMA work-request planning (pure Python), checked against a direct reference."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.rdma_plan import (BlockWrite, DeviceLimits, LocalSpan, MaskWrite, execute,
                                 plan_writes)

LOCAL_BASE = {1: 10_000, 2: 50_000}
REMOTE_BASE, MASK_BASE = 200_000, 900_000
LOCAL_SIZE, REMOTE_SIZE, MASK_SIZE = 4096, 8192, 64


def _memories():
    local = {k: (base, bytearray((k * 31 + i) % 251 for i in range(LOCAL_SIZE)))
             for k, base in LOCAL_BASE.items()}
    local[3] = (70_000, bytearray(b"\x01" * MASK_SIZE))  # mask values
    remote = {7: (REMOTE_BASE, bytearray(REMOTE_SIZE)), 8: (MASK_BASE, bytearray(MASK_SIZE))}
    return local, remote


@st.composite
def block_lists(draw):
    blocks, dest, mask_slot = [], draw(st.integers(0, 64)), 0
    for _ in range(draw(st.integers(1, 8))):
        sources = []
        for _ in range(draw(st.integers(1, 6))):
            lkey = draw(st.sampled_from([1, 2]))
            off = draw(st.integers(0, LOCAL_SIZE - 64))
            sources.append(LocalSpan(LOCAL_BASE[lkey] + off, draw(st.integers(0, 64)), lkey))
        mask = None
        if draw(st.booleans()) and mask_slot < MASK_SIZE - 4:
            n = draw(st.integers(1, 3))
            mask = MaskWrite(LocalSpan(70_000 + mask_slot, n, 3), MASK_BASE + mask_slot, 8)
            mask_slot += n if draw(st.booleans()) else n + 1  # contiguous or not
        block = BlockWrite(tuple(sources), REMOTE_BASE + dest, 7, mask)
        blocks.append(block)
        dest += block.length + draw(st.sampled_from([0, 0, 5]))  # contiguous or a gap
    return blocks


def _reference(blocks, local, remote):
    for b in blocks:
        data = b"".join(bytes(local[s.lkey][1][s.addr - local[s.lkey][0]:][:s.length]) for s in b.sources)
        lo = b.dest_addr - REMOTE_BASE
        remote[7][1][lo:lo + len(data)] = data
        if b.mask:
            m = b.mask
            lo = m.dest_addr - MASK_BASE
            remote[8][1][lo:lo + m.source.length] = b"\x01" * m.source.length


@given(blocks=block_lists(), max_sge=st.integers(1, 4), max_wr=st.integers(1, 6),
       max_msg=st.integers(1, 200), max_inline=st.integers(0, 4), coalesce=st.booleans())
@settings(max_examples=300, deadline=None)
def test_plan_matches_reference_and_respects_limits(blocks, max_sge, max_wr, max_msg, max_inline, coalesce):
    limits = DeviceLimits(max_sge=max_sge, max_send_wr=max_wr, max_inline=max_inline, max_msg=max_msg)
    batches = plan_writes(blocks, limits, coalesce=coalesce)
    local, remote = _memories()
    execute(batches, local, remote)
    _, expected = _memories()
    _reference(blocks, local, expected)
    assert remote[7][1] == expected[7][1] and remote[8][1] == expected[8][1]
    flat = [wr for b in batches for wr in b]
    assert [wr.wr_id for wr in flat] == list(range(1, len(flat) + 1))
    for batch in batches:
        assert 1 <= len(batch) <= max_wr
        assert [wr.signaled for wr in batch] == [False] * (len(batch) - 1) + [True]
    for i, wr in enumerate(flat):
        assert 1 <= len(wr.sges) <= max_sge and wr.length <= max_msg
        assert wr.inline == (wr.is_mask and wr.length <= max_inline)
        if wr.is_mask:  # every data WR of the mask's blocks was posted before it
            for j, other in enumerate(flat):
                if not other.is_mask and set(other.blocks) & set(wr.blocks):
                    assert j < i


def test_sge_batching_merges_adjacent_spans_and_coalesces_contiguous_blocks():
    spans = tuple(LocalSpan(10_000 + 100 * i, 100, 1) for i in range(10))  # contiguous in memory
    limits = DeviceLimits(max_sge=2)
    blocks = [BlockWrite(spans[:5], REMOTE_BASE, 7, MaskWrite(LocalSpan(70_000, 1, 3), MASK_BASE, 8)),
              BlockWrite(spans[5:], REMOTE_BASE + 500, 7, MaskWrite(LocalSpan(70_001, 1, 3), MASK_BASE + 1, 8))]
    (batch,) = plan_writes(blocks, limits)
    assert [(wr.is_mask, wr.length, len(wr.sges)) for wr in batch] == [(False, 1000, 1), (True, 2, 1)]
    assert batch[1].inline and batch[1].signaled and batch[1].blocks == (0, 1)
    (batch,) = plan_writes(blocks, limits, coalesce=False)
    assert [wr.is_mask for wr in batch] == [False, True, False, True]


def test_scattered_sources_split_by_max_sge():
    spans = tuple(LocalSpan(10_000 + 200 * i, 100, 1) for i in range(7))  # gaps: no merging
    (batch,) = plan_writes([BlockWrite(spans, REMOTE_BASE, 7)], DeviceLimits(max_sge=3))
    assert [len(wr.sges) for wr in batch] == [3, 3, 1]
    assert [wr.remote_addr - REMOTE_BASE for wr in batch] == [0, 300, 600]


@pytest.mark.parametrize("kw", [dict(max_sge=0), dict(max_send_wr=0), dict(max_msg=0), dict(max_inline=-1)])
def test_limits_validation(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        DeviceLimits(**kw)
