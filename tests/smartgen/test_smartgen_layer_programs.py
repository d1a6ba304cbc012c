"""Programs per layer in a smartgen decode step with remote rows (jkv/disagg/decode_lanes.py): one
program computes q, k, v, writes the new token's K, V, lands the rows that arrived or were
prefetched, selects, splits and attends; only a true miss (a selected row still remote after that
landing) adds a second program, after its synchronous fetch. Counted on the engine thread: every
jitted dispatch of a layer the worker can make (the model's qkv, the page write and landing
programs of `DecodePages`, every `LayerPrograms` program, the selected-row count); the lookahead's
hint for the next layer runs on its helper thread and is not the layer's. Before this, such a layer
ran select, split and attend (3), then qkv, the page write and `landed` (3)."""
import collections
import threading

import numpy as np
import pytest

from jkv.disagg import decode_program
from jkv.disagg.decode_worker import DecodeWorker
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

PROGRAMS = ("select", "split", "attend", "fused", "landed", "attend_landed")  # whichever the worker has


class _Counted:
    """A jitted callable that counts its calls on the engine thread into `counts[current key]`
    (`.lower` passes through)."""

    def __init__(self, fn, counts, key):
        self._fn, self._counts, self._key = fn, counts, key
        self._engine = threading.get_ident()  # generate() runs the steps on the calling thread

    def __call__(self, *a, **kw):
        if threading.get_ident() == self._engine and self._key() is not None:  # None: outside a layer
            self._counts[self._key()] += 1
        return self._fn(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._fn, name)


@pytest.fixture(scope="module")
def workers(model, selectors):
    w = InProcessWorkers(model, selectors["infinigen"], 1)
    yield w
    w.close()


def test_a_layer_with_remote_rows_runs_one_program_unless_a_selected_row_misses(model, selectors, profiles,
                                                                                  prompts, workers, monkeypatch):
    decode = DecodeWorker(model, selectors["infinigen"], TransferConfig(mode="smartgen", kr_fraction=0.3,
                                                                        max_blocks=16),
                          secret=SECRET, profile=profiles["infinigen"])
    counts, misses, remote_layers, where = collections.Counter(), set(), set(), [None]
    for name in PROGRAMS:
        if hasattr(decode.programs, name):
            monkeypatch.setattr(decode.programs, name, _Counted(getattr(decode.programs, name), counts,
                                                                lambda: where[0]))
    for owner, name in ((decode.pages, "_land_rows"), (decode.pages, "write_new"), (model, "qkv"),
                        (decode_program, "selected_rows")):  # whichever exist
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, _Counted(getattr(owner, name), counts, lambda: where[0]))
    real_layer, real_call = DecodeWorker._decode_layer, DecodeWorker._call

    def decode_layer(self, st, layer):
        where[0] = (len(self.phases.steps), layer)
        if any(lv.fetchable for lv in st.lives):
            remote_layers.add(where[0])
        try:
            return real_layer(self, st, layer)
        finally:
            where[0] = None

    def call(self, owner, payload):  # the synchronous fetch of a true miss (the lookahead's go elsewhere)
        misses.add(where[0])
        return real_call(self, owner, payload)

    monkeypatch.setattr(DecodeWorker, "_decode_layer", decode_layer)
    monkeypatch.setattr(DecodeWorker, "_call", call)
    try:
        decode.connect(workers.addresses)
        outs = decode.generate(make_requests(prompts, max_tokens=12))
    finally:
        decode.close()
    assert all(o.finish_reason == "length" for o in outs)
    assert sum(o.metrics.extra["on_demand_ratio"] for o in outs) > 0  # rows were fetched on demand
    assert remote_layers and misses <= remote_layers
    for key in remote_layers:  # one program, plus one after the fetch of a true miss
        assert counts[key] == 1 + (key in misses), (key, counts[key], key in misses)
    later = [key for key in remote_layers if key[0] > 1]  # after the first step (no prefetch of its layers)
    single = [key for key in later if key not in misses]
    assert later and len(single) >= len(later) / 2, (len(single), len(later))  # the common case is one program
    assert all(counts[key] == 1 for key in set(counts) - remote_layers)  # all local: one program
    assert decode.pages.cache.pages_in_use == 0 and decode.pool.live() == []
