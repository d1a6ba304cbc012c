"""The on-demand fetch wire format and the pool byte layout (jkv/kvbuffers/fetch.py): both sides
of the RPC round-trip through the one module, without a transport."""
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kvbuffers.fetch import (FetchCall, iter_reply, keep_rows, kv_offset, mask_offset, pack_reply, parse_fetch,
                               reply_rows)
from jkv.kvbuffers.pool import RequestKV

L, H, N, D = 3, 2, 16, 4


@st.composite
def fetches(draw):
    """A layer and, per request, per KV head, distinct positions in [0, N) (possibly none)."""
    layer = draw(st.integers(0, L - 1))
    requests = []
    for i in range(draw(st.integers(1, 3))):
        heads = [np.asarray(draw(st.lists(st.integers(0, N - 1), unique=True, max_size=N)), np.int32)
                 for _ in range(H)]
        if sum(len(p) for p in heads):  # callers add only requests with something to fetch
            requests.append((f"r{i}", heads))
    return layer, requests


def _serve(sources, payload):
    """What the prefill worker does with a payload: rows of each (request, head), K then V."""
    layer, items = parse_fetch(payload)
    ks, vs = [], []
    for rid, heads in items:
        for head, p in enumerate(heads):
            if len(p):
                ks.append(sources[rid][0, layer, head, p])
                vs.append(sources[rid][1, layer, head, p])
    return pack_reply(ks, vs)


@settings(max_examples=60, deadline=None)
@given(fetches(), st.integers(0, 2**31 - 1))
def test_fetch_round_trips_rows_into_the_right_slots(fetch, seed):
    layer, requests = fetch
    rng = np.random.default_rng(seed)
    sources = {rid: rng.standard_normal((2, L, H, N, D)).astype(np.float32) for rid, _ in requests}
    call = FetchCall(layer)
    for b, (rid, heads) in enumerate(requests):
        call.add(rid, [((b, h), p) for h, p in enumerate(heads)])
    parsed_layer, items = parse_fetch(call.payload())
    assert parsed_layer == layer and [rid for rid, _ in items] == [rid for rid, _ in requests]
    for (_, got), (_, want) in zip(items, requests):
        assert [p.tolist() for p in got] == [p.tolist() for p in want]
    if not requests:
        return
    reply = reply_rows(_serve(sources, call.payload()), call.rows, D, "test reply")
    lives = [types.SimpleNamespace(kv=types.SimpleNamespace(kv=np.zeros((2, L, H, N, D), np.float32),
                                                            take_write=lambda: True),
                                   fetched=np.zeros((L, H, N), bool), fetch_bytes=0) for _ in requests]
    for (b, h), positions, k, v in iter_reply(reply, call.segments):
        keep_rows(lives[b], layer, h, positions, k, v)
    for b, (rid, heads) in enumerate(requests):
        lv, asked = lives[b], sum(len(p) for p in heads)
        for h, p in enumerate(heads):
            np.testing.assert_array_equal(lv.kv.kv[:, layer, h, p], sources[rid][:, layer, h, p])
            assert lv.fetched[layer, h].sum() == len(p) and lv.fetched[layer, h, p].all()
        assert lv.fetch_bytes == 2 * asked * D * 4
        untouched = ~lv.fetched[None, :, :, :, None].repeat(2, 0).repeat(D, -1)
        assert not lv.kv.kv[untouched].any()  # nothing outside the asked rows was written


def test_a_reply_of_the_wrong_size_names_its_source():
    with pytest.raises(RuntimeError, match="fetch reply from 'p0' has 8 floats, expected 16"):
        reply_rows(np.zeros(8, np.float32).tobytes(), 2, D, "fetch reply from 'p0'")


def test_empty_reply_and_request_without_rows():
    assert pack_reply([], []) == b""
    call = FetchCall(1)
    call.add("r0", [("a", np.zeros(0, np.int32)), ("b", np.asarray([3], np.int32))])
    assert call.items == [["r0", [0, 1]]] and [k for k, _ in call.segments] == ["b"] and call.rows == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(1, 5), st.data())
def test_pool_offsets_address_the_flat_buffer(num_layers, heads, capacity, head_dim, data):
    kv = RequestKV("r", num_layers, heads, capacity, head_dim, prompt_len=1)
    kv.kv[...] = np.arange(kv.kv.size, dtype=np.float32).reshape(kv.kv.shape)
    which, layer = data.draw(st.integers(0, 1)), data.draw(st.integers(0, num_layers - 1))
    head, token = data.draw(st.integers(0, heads - 1)), data.draw(st.integers(0, capacity - 1))
    off = kv_offset(num_layers, heads, capacity, head_dim, which, layer, head, token)
    assert off == kv.offset(which, layer, head, token)
    flat = kv.kv.reshape(-1).view(np.uint8)
    assert flat[off:off + 4].view(np.float32)[0] == kv.kv[which, layer, head, token, 0]
    moff = mask_offset(capacity, layer, token)
    assert moff == kv.mask_offset(layer, token) and kv.mask.reshape(-1)[moff] == kv.mask[layer, token]
