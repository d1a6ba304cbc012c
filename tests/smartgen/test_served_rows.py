"""Rows served on demand are not pushed again once the decode side confirmed it keeps them
(jkv/disagg/served_rows.py, jkv/disagg/prefill_pushes.py; issue 19 item 3): the bookkeeping, the
push items (the run's mask byte still flips, after the rows it covers), the "spec" handler
(confirmations before its pushes; a reply never confirmed is pushed in full) and the decode side's
numbering of fetch calls. Pure numpy and fakes; the byte ratios through the workers are in
test_prefix_split.py."""
import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.disagg import protocol as proto
from jkv.disagg.head_slices import ExportCounters, push_slices
from jkv.disagg.prefill_pushes import PushSide
from jkv.disagg.prefill_worker import _Held
from jkv.disagg.served_rows import ServedRows, missing_spans
from jkv.kvbuffers.fetch import FetchCall, keep_rows, parse_fetch_framed
from jkv.kvbuffers.geometry import LOCAL, REMOTE, BlockGeometry
from jkv.kvbuffers.pool import RequestKV
from tests.smartgen.test_head_slices import RecordingPeer

L, H, N, CAP, D = 2, 4, 20, 24, 2


class DonePeer(RecordingPeer):
    """RecordingPeer whose writes are acknowledged at once (the "spec" handler asks `done()`)."""

    def write_many(self, items):
        super().write_many(items)
        return types.SimpleNamespace(done=lambda: True)


def _apply(calls, dest: RequestKV) -> None:
    """Apply writes as the decode side's transport does, in order: bytes at offsets in their
    region (the KV pool or the mask), a trailing mask after its item's rows."""
    regions = {"kv/r": dest.kv.reshape(-1).view(np.uint8), "mask/r": dest.mask.reshape(-1).view(np.uint8)}
    for items in calls:
        for region, offset, data, then in items:
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            regions[region][offset:offset + raw.size] = raw
            if then is not None:
                regions[then.region][then.offset:then.offset + len(then.value)] = np.frombuffer(then.value, np.uint8)


def _kv(seed=0):
    return np.random.default_rng(seed).standard_normal((2, L, H, N, D)).astype(np.float32)


# ---------------------------------------------------------------- bookkeeping
def test_only_confirmed_replies_become_held():
    served = ServedRows(L, H, N)
    assert served.held_rows(0) is None
    served.record(5, 1, [np.asarray([3, 4]), np.asarray([], np.int32), np.asarray([4]), np.asarray([9])])
    served.record(6, 0, [np.asarray([1])] * H)
    served.record(7, 0, [np.asarray([], np.int32)] * H)  # nothing served: nothing to remember
    assert served.held_rows(1) is None  # served but not confirmed: a push still carries them
    assert served.confirm([5, 99]) == 4  # 99: not this request's (or already confirmed)
    assert served.held_rows(1)[0, [3, 4]].all() and served.held_rows(1)[2, 4] and served.held_rows(1)[3, 9]
    assert served.held_rows(1).sum() == 4 and not served.held_rows(0).any()  # reply 6 was never confirmed
    assert served.confirm([5]) == 0 and served.confirmed_rows == 4
    assert served.confirm([6]) == H and served.held_rows(0)[:, 1].all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.data())
def test_missing_spans_cover_exactly_the_rows_not_held(row, data):
    held = np.asarray([row, row[::-1]], bool)
    n = len(row)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    for head in (0, 1):
        spans = missing_spans(held, head, start, stop)
        covered = np.zeros(n, bool)
        last = start - 1
        for a, b in spans:
            assert last < a < b <= stop  # sorted, disjoint, not touching, non-empty
            covered[a:b] = True
            last = b
        expect = np.zeros(n, bool)
        expect[start:stop] = ~held[head, start:stop]
        np.testing.assert_array_equal(covered, expect)
    assert missing_spans(None, 0, start, stop) == [(start, stop)]


# ---------------------------------------------------------------- push items
@pytest.mark.parametrize("slices", [((0, 4),), ((0, 2), (2, 4)), ((0, 3), (3, 4))])
def test_a_push_leaves_out_held_rows_and_still_flips_every_run(slices):
    kv, layer = _kv(), 1
    runs = BlockGeometry(N, L, 5).runs([0, 1, 3])  # [0, 8) and [12, 16)
    held = np.zeros((H, N), bool)
    held[0, 2:5] = held[3, 7] = True
    held[:, 12:16] = True  # a whole run the decode side holds: only its mask byte is left to write
    dest = RequestKV("r", L, H, CAP, D, N)
    for h in range(H):  # what the decode side kept from its fetch replies (staging)
        keep_rows(types.SimpleNamespace(kv=dest, fetched=np.zeros((L, H, CAP), bool), fetch_bytes=0), layer, h,
                  np.flatnonzero(held[h]), kv[0, layer, h, held[h]], kv[1, layer, h, held[h]])
    peer = RecordingPeer()
    sent = push_slices(peer, "r", kv, CAP, layer, runs, slices, held)
    tokens = np.r_[0:8, 12:16]
    assert sum(n for _, _, n in sent) == 2 * D * 4 * (H * len(tokens) - held[:, tokens].sum())  # rows only
    written = set()
    for items in peer.calls:
        for region, offset, data, _ in items:
            if region == "kv/r":
                head, token = (offset // (CAP * D * 4)) % H, (offset // (D * 4)) % CAP
                written |= {(head, t) for t in range(token, token + len(data))}
    assert not any(held[h, t] for h, t in written)  # no held row crosses again
    assert written == {(h, t) for h in range(H) for t in tokens if not held[h, t]}
    last = peer.calls[-1]  # the mask bytes ride on the last slice's write, after its rows
    assert [it.region for it in last if it.region == "mask/r"] == ["mask/r"]  # the held run's byte, alone
    assert all(it.then is None for items in peer.calls[:-1] for it in items)
    _apply(peer.calls, dest)
    assert (dest.mask[layer, tokens] == LOCAL).all()
    assert (dest.mask[layer, np.setdiff1d(np.arange(N), tokens)] == REMOTE).all() and (dest.mask[0, :N] == REMOTE).all()
    np.testing.assert_array_equal(dest.kv[:, layer, :, tokens], kv[:, layer, :, tokens])  # every 1 is safe to read


# ---------------------------------------------------------------- the "spec" handler
class _Worker(PushSide):
    """The attributes PushSide reads, around one fake bulk peer."""

    def __init__(self):
        self.peer = DonePeer()
        self.bulk = types.SimpleNamespace(peer=lambda name: self.peer)
        self.head_slices, self.kv_export, self.lease_s = ((0, H),), ExportCounters(((0, H),)), 60.0
        self._lock, self._held = threading.Lock(), {}

    def hold(self, rid, order):
        g = BlockGeometry(N, L, 5)
        h = _Held(rid, "decode", types.SimpleNamespace(kv=_kv()), g, CAP, np.asarray(order), np.zeros(g.num_blocks, bool),
                  0, 2, 0.0, served=ServedRows(L, H, N))
        self._held[rid] = h
        return h


def _rows_written(calls, rid):
    return sum(it.data.size // D for items in calls for it in items if it.region == proto.kv_region(rid))


def test_spec_confirms_before_it_pushes_and_pushes_unconfirmed_rows_in_full():
    w = _Worker()
    a, b = w.hold("a", [0, 1]), w.hold("b", [0, 1])
    for h in (a, b):  # both served tokens 0..3 of every head of layer 0 in a reply numbered 11
        h.served.record(11, 0, [np.arange(4)] * H)
    w._spec(types.SimpleNamespace(peer="decode", payload=proto.pack(dict(rids=["a", "b"], kept={"a": [11]}))))
    assert a.bytes["speculative"] == 2 * D * 4 * H * (8 - 4) and _rows_written(w.peer.calls, "a") == 2 * H * 4
    assert b.bytes["speculative"] == 2 * D * 4 * H * 8 and _rows_written(w.peer.calls, "b") == 2 * H * 8
    assert a.sent[:2].all() and b.sent[:2].all()
    # without the field (a decode worker that confirms nothing) every row is pushed
    c = w.hold("c", [5, 6])
    c.served.record(3, 1, [np.arange(4)] * H)
    w._spec(types.SimpleNamespace(peer="decode", payload=proto.pack(dict(rids=["c"]))))
    assert c.bytes["speculative"] == 2 * D * 4 * H * 8
    assert w.kv_export.snapshot()["held"] == {f"0:{H}": 0}
    # every row of the pushed blocks held: only their mask bytes cross, counted as a held-only slice
    d = w.hold("d", [2, 3])  # layer 0, tokens [8, 16)
    d.served.record(4, 0, [np.arange(8, 16)] * H)
    w._spec(types.SimpleNamespace(peer="decode", payload=proto.pack(dict(rids=["d"], kept={"d": [4]}))))
    assert d.bytes["speculative"] == 0 and d.sent[2:4].all() and _rows_written(w.peer.calls, "d") == 0
    assert [(it.region, it.offset, bytes(it.data)) for it in w.peer.calls[-1]] == [
        (proto.mask_region("d"), 8, bytes([LOCAL]) * 8)]  # layer 0 of the decode side's [L, CAP] mask
    assert w.kv_export.snapshot()["held"] == {f"0:{H}": 1}


# ---------------------------------------------------------------- decode side
def test_fetch_calls_are_numbered_and_kept_replies_are_noted():
    first, second = FetchCall(0), FetchCall(0)
    assert first.seq != second.seq
    first.add("r", [(0, np.asarray([2, 3], np.int32))])
    layer, items, framed, seq = parse_fetch_framed(first.payload())
    assert (layer, framed, seq) == (0, False, first.seq) and items[0][0] == "r"
    lv = types.SimpleNamespace(kv=RequestKV("r", L, H, CAP, D, N), fetched=np.zeros((L, H, CAP), bool), fetch_bytes=0,
                               kept_fetches=set())
    keep_rows(lv, 0, 1, np.asarray([2]), np.ones((1, D), np.float32), np.ones((1, D), np.float32), first.seq)
    keep_rows(lv, 0, 1, np.asarray([4]), np.ones((1, D), np.float32), np.ones((1, D), np.float32))  # no number
    assert lv.kept_fetches == {first.seq} and lv.fetched[0, 1, [2, 4]].all()
