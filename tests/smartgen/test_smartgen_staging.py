"""A decode request's host staging buffer (jkv/kvbuffers/pool.py RequestKV, registered with the
transport) is freed as soon as nothing more can arrive for it (its owner returned from "free")
and every row of every layer is in the device pages, not when the request finishes
(jkv/disagg/decode_owners.py `_free_staging`). A write still in flight for freed staging (a
"ckv" frame queued on the notify thread, a fetch reply) is dropped and counted, never written;
after a cancel the same holds; no staging byte, region or page leaks."""
import types

import numpy as np
import pytest

from jkv.disagg import protocol as proto
from jkv.disagg.decode_worker import DecodeWorker
from jkv.kvbuffers.fetch import keep_rows
from jkv.transfer.plan import TransferConfig

from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

MAX_TOKENS = 16  # room for the rows smartgen did not fetch to land (step 8 on an AMD EPYC) well before the end


@pytest.fixture(scope="module")
def workers(model, selectors, prompts):
    w = InProcessWorkers(model, selectors["oracle"], 1)
    w.prompts = prompts[:2]
    yield w
    w.close()


def _late_writes(decode, lv):
    """A "ckv" frame and a fetch reply for lv arriving now; True for each one that was written."""
    before = decode.pool.late_writes_dropped
    decode._on_compressed(types.SimpleNamespace(payload=proto.pack(dict(rid=lv.rid)), peer="prefill-0"))
    rows = np.zeros((1, decode.model.cfg.head_dim), np.float32)
    kept = keep_rows(lv, 2, 0, np.array([0]), rows + 7, rows + 7)
    assert lv.error is None or "cancelled" in lv.error  # a late write is no failure of the request
    return decode.pool.late_writes_dropped - before, kept


def _run(model, sel, workers, mode, monkeypatch, on_step=None, **kw):
    """Generate; after each step record (staging bytes in use, freed flags, regions registered)."""
    decode = DecodeWorker(model, sel, TransferConfig(mode=mode, max_blocks=16, **kw), secret=SECRET)
    steps, rids, real_end = [], set(), DecodeWorker._end_step

    def end_step(self, st, *a):
        out = real_end(self, st, *a)  # the step boundary: a request's staging may go here
        regions = [self.endpoint.regions.by_name(proto.kv_region(lv.rid)) is not None for lv in st.lives]
        rids.update(lv.rid for lv in st.lives)
        steps.append((self.pool.bytes_in_use, [lv.kv.freed for lv in st.lives], regions,
                      [not lv.completed for lv in st.lives]))
        if on_step is not None:
            on_step(self, st, len(steps))
        return out

    monkeypatch.setattr(DecodeWorker, "_end_step", end_step)
    try:
        decode.connect(workers.addresses)
        outs = decode.generate(make_requests(workers.prompts, MAX_TOKENS))
        assert decode.pool.live() == [] and decode.pool.bytes_in_use == 0  # no staging leak
        assert decode.pages.cache.pages_in_use == 0 and workers.workers[0].held() == []
        assert rids and not any(decode.endpoint.regions.by_name(name(rid)) for rid in rids
                                for name in (proto.kv_region, proto.mask_region))
        return decode, steps, outs
    finally:
        decode.close()


@pytest.mark.parametrize("mode", ["full", "smartgen"])
def test_staging_is_freed_once_every_row_is_on_the_device_not_at_finish(model, selectors, workers, mode,
                                                                         monkeypatch):
    late = {}

    def on_step(decode, st, step):
        lv = st.lives[0]
        if lv.kv.freed and not lv.completed and not late:
            late["counted"], late["kept"] = _late_writes(decode, lv)

    kw = dict(kr_fraction=0.3, strategy="sequential") if mode != "full" else {}
    decode, steps, outs = _run(model, selectors["oracle"], workers, mode, monkeypatch, on_step, **kw)
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in outs)
    # the first step after which every request's staging is gone, while they all still decode
    freed_at = next(i for i, (_, freed, _, _) in enumerate(steps) if all(freed))
    assert freed_at < MAX_TOKENS - 2 and all(steps[freed_at][3])
    if mode == "full":  # every row had arrived before decode: the first step lands it and frees it
        assert freed_at == 0
    for nbytes, freed, registered, running in steps:
        assert nbytes == 0 if all(freed) else nbytes > 0  # the staging-bytes gauge follows the frees
        assert registered == [not f for f in freed]  # its transport regions go with it
    assert late == dict(counted=2, kept=False)  # the late frame and reply were dropped and counted
    assert all(lv_freed for _, f, _, _ in steps[freed_at:] for lv_freed in f)


def test_a_write_after_a_cancel_is_dropped_and_counted_and_nothing_leaks(model, selectors, workers, monkeypatch):
    box = {}

    def on_step(decode, st, step):
        if step == 2 and not box:
            lv = st.lives[1]
            assert decode.cancel(lv.req.request_id)
            staged = lv.kv.kv.copy()  # a cancel frees the staging but keeps the arrays for a step in flight
            box["counted"], box["kept"] = _late_writes(decode, lv)
            box["unchanged"] = np.array_equal(staged, lv.kv.kv)

    decode, steps, outs = _run(model, selectors["oracle"], workers, "partial", monkeypatch, on_step,
                               kr_fraction=0.3, strategy="sequential")
    assert box == dict(counted=1, kept=False, unchanged=True)  # its "ckv" handler returns: the request failed
    assert outs[1].finish_reason == "error" and outs[0].finish_reason == "length"
