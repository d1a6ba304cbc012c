"""The decode worker's KV lives in device pages (jkv/disagg/decode_pages.py): after every decode
step the device mask shows exactly the prompt rows that were copied host->device, the step's
host->device byte counters equal the bytes of the rows that arrived or were fetched in that step,
the pages hold the bytes that landed in staging, and once every row is local a step moves nothing."""
import numpy as np
import pytest

from jkv.disagg.decode_worker import DecodeWorker
from jkv.kvbuffers.geometry import LOCAL
from jkv.transfer.plan import TransferConfig

from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

CAUSES = ("arrived", "fetched", "other")


@pytest.fixture(scope="module")
def workers(model, selectors):
    w = InProcessWorkers(model, selectors["oracle"], 1)
    yield w
    w.close()


def _prompt_rows(decode, lv):
    """(device mask, K pages, V pages) of lv's prompt rows: i8[L, H, N], [L, H, N, D] x 2."""
    pages = decode.pages.cache.pages_of(lv.rid)
    n = lv.geometry.num_tokens
    mask = np.asarray(decode.pages.mask)[:, pages]  # [L, pages, H, P]
    L, _, H, P = mask.shape
    mask = mask.transpose(0, 2, 1, 3).reshape(L, H, -1)[:, :, :n]
    kv = [np.stack([np.asarray(decode.pages.cache.kv[layer][i])[pages].transpose(1, 0, 2, 3).reshape(H, -1, decode.pages.head_dim)[:, :n]
                    for layer in range(L)]) for i in (0, 1)]
    return mask, kv[0], kv[1]


def _run(model, sel, workers, mode, max_tokens, monkeypatch, profile=None, **kw):
    """Generate the batch; after each step record (h2d bytes by cause, device-local prompt rows)
    and check that every device-local prompt row holds the staging row's bytes."""
    decode = DecodeWorker(model, sel, TransferConfig(mode=mode, max_blocks=16, **kw), secret=SECRET,
                          profile=profile)
    steps = []
    real_end = DecodeWorker._end_step

    def end_step(self, st, *a):
        local = 0
        for lv in st.lives:
            mask, K, V = _prompt_rows(self, lv)
            on = mask == LOCAL
            if lv.kv.freed:  # its staging went early: only once every row was on the device
                assert on.all() and lv.on_device.all() and lv.kv.kv is None
                local += int(on.sum())
                continue
            staged = (lv.kv.mask[:, None, :lv.geometry.num_tokens] == LOCAL) | lv.fetched[:, :, :lv.geometry.num_tokens]
            assert (on == lv.on_device).all() and not (on & ~staged).any()  # a 1 only for a row in staging
            n = lv.geometry.num_tokens
            np.testing.assert_array_equal(K[on], lv.kv.kv[0][:, :, :n][on])
            np.testing.assert_array_equal(V[on], lv.kv.kv[1][:, :, :n][on])
            local += int(on.sum())
        steps.append(({c: self.phases.steps[-1].get(f"h2d_{c}_bytes_n", 0) for c in CAUSES}, local,
                      all((_prompt_rows(self, lv)[0] == LOCAL).all() for lv in st.lives)))
        return real_end(self, st, *a)

    monkeypatch.setattr(DecodeWorker, "_end_step", end_step)
    try:
        decode.connect(workers.addresses)
        outs = decode.generate(make_requests(workers.prompts, max_tokens))
        assert all(o.finish_reason == "length" for o in outs)
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0
        return decode, steps, outs
    finally:
        decode.close()


@pytest.mark.parametrize("mode", ["partial", "smartgen", "full"])
def test_step_host_to_device_bytes_are_the_rows_that_arrived_or_were_fetched(model, selectors, profiles, prompts,
                                                                               workers, mode, monkeypatch):
    workers.prompts = prompts[:2]
    kw = dict(kr_fraction=0.3) if mode != "full" else {}
    decode, steps, outs = _run(model, selectors["oracle"], workers, mode, 14, monkeypatch,
                               profile=profiles["oracle"], **kw)
    row_bytes = decode.pages.row_bytes
    assert row_bytes == 2 * model.cfg.head_dim * np.dtype(model.cfg.dtype).itemsize  # the pool is the model dtype
    before = 0
    for h2d, local, _ in steps:
        assert h2d["other"] == 0
        assert h2d["arrived"] + h2d["fetched"] == (local - before) * row_bytes  # every counted byte is a new row
        before = local
    check_totals(decode, outs, before * row_bytes)
    if mode == "partial":  # no speculation: what was not pushed stays remote unless it is fetched
        assert not steps[-1][2] and sum(h2d["fetched"] for h2d, _, _ in steps) > 0
        return
    first_all_local = next(i for i, (_, _, done) in enumerate(steps) if done)
    assert all(sum(h2d.values()) == 0 for h2d, _, _ in steps[first_all_local + 1:])  # zero once all is local
    if mode == "full":  # everything had arrived before decode: the first step lands it, then nothing
        assert first_all_local == 0 and steps[0][0]["fetched"] == 0
    else:  # smartgen: on-demand rows crossed as "fetched", speculation pushed the rest as "arrived"
        assert sum(h2d["fetched"] for h2d, _, _ in steps) > 0
        assert first_all_local < len(steps) - 1 and sum(h2d["arrived"] for h2d, _, _ in steps[1:]) > 0


def check_totals(decode, outs, landed_bytes):
    per_step = [s for o in outs for s in o.metrics.extra["step_phases"]]
    assert any("h2d_arrived_bytes_n" in s for s in per_step)  # the counters reach the results
    assert decode.pages.h2d_bytes["arrived"] + decode.pages.h2d_bytes["fetched"] == landed_bytes
    assert decode.pages.stats()["kv_pages_in_use"] == 0
