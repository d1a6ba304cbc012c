"""Continuous admission in the decode worker: a request submitted while another decodes joins the
running batch at a step boundary (different pool capacities: the selector metadata is re-stacked
on join and on leave), produces the tokens the static `generate()` gives, and a cancel mid-batch
frees its KV on both sides while the other request continues. Leak checks after every test."""
import threading
import time

import numpy as np
import pytest

from jkv.disagg.decode_worker import CAPACITY_BUCKET, DecodeWorker
from jkv.engine import Request
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers

# A fits one capacity bucket, B (longer prompt, more tokens) needs two: B's join grows the batch
# N_cap, A's leave shrinks it back.
A_LEN, A_TOKENS = 70, 10
B_LEN, B_TOKENS = 300, 14


@pytest.fixture(scope="module", params=["oracle", "infinigen"])
def sel(selectors, request):
    return selectors[request.param]  # both ship per-request metadata: exercises the re-stacking


@pytest.fixture(scope="module")
def workers(model, sel):
    w = InProcessWorkers(model, sel, 1)
    yield w
    w.close()


@pytest.fixture
def decode(model, sel, workers):
    d = DecodeWorker(model, sel, TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3,
                                                max_blocks=16), secret=SECRET)
    d.connect(workers.addresses)
    yield d
    assert d.num_active == 0 and d._running == [] and d._pending == []
    assert d.pool.live() == [] and d.pages.cache.pages_in_use == 0 and d.pool.bytes_in_use == 0
    assert workers.workers[0].held() == []
    d.close()


@pytest.fixture(scope="module")
def requests(model):
    rng = np.random.default_rng(11)
    a, b = (rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (A_LEN, B_LEN))
    return (Request("A", a, a, SamplingParams(max_tokens=A_TOKENS, ignore_eos=True)),
            Request("B", b, b, SamplingParams(max_tokens=B_TOKENS, ignore_eos=True)))


class Recorder:
    """on_token / on_done hooks: the global order of sampled tokens and each request's output."""

    def __init__(self):
        self.events, self.outputs = [], {}

    def on_token(self, rid, token):
        self.events.append((rid, token))

    def on_done(self, out):
        assert out.request_id not in self.outputs, "on_done called twice"
        self.outputs[out.request_id] = out

    def tokens(self, rid):
        return [t for r, t in self.events if r == rid]


def run_until(decode, cond, timeout=120.0):
    """Step the decode worker until cond() holds. Bounded by wall time, not a step count: a step
    returns early when something arrives, so under load a fixed count ran out before a slow
    hand-off (1 Mbit/s pushes) landed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        decode.step(wait=0.05)
    raise AssertionError(f"condition not reached within {timeout} s")


def test_a_request_submitted_mid_decode_joins_the_running_batch(decode, requests, workers):
    req_a, req_b = requests
    static = decode.generate([req_a, req_b])  # the reference: one static batch, shared N_cap
    assert [o.finish_reason for o in static] == ["length", "length"]
    rec = Recorder()
    decode.submit(req_a, on_token=rec.on_token, on_done=rec.on_done)
    run_until(decode, lambda: len(rec.tokens("A")) >= 3)
    decode.submit(req_b, on_token=rec.on_token, on_done=rec.on_done)
    decode.step()  # drains B: planned and handed in while A keeps decoding
    assert [lv.req.request_id for lv in decode._pending] == ["B"]
    assert decode._pending[0].kv.capacity == 2 * CAPACITY_BUCKET  # its own pool, not A's N_cap
    assert decode._pending[0].handoff.wait(60)
    a_before_join = len(rec.tokens("A"))
    capacities = []
    run_until(decode, lambda: capacities.append([lv.kv.capacity for lv in decode._running]) or len(rec.outputs) == 2)
    # B decoded while A was still running: its tokens come before A's last one, A kept going after.
    first_b = rec.events.index(("B", rec.tokens("B")[0]))
    last_a = len(rec.events) - 1 - rec.events[::-1].index(("A", rec.tokens("A")[-1]))
    assert a_before_join < A_TOKENS and first_b < last_a
    assert [CAPACITY_BUCKET, 2 * CAPACITY_BUCKET] in capacities and [2 * CAPACITY_BUCKET] in capacities
    for ref in static:
        out = rec.outputs[ref.request_id]
        assert out.finish_reason == "length" and out.token_ids == ref.token_ids
        assert rec.tokens(ref.request_id) == ref.token_ids  # streamed == final
        assert len(out.metrics.extra["step_phases"]) == len(ref.token_ids) - 1


def test_cancel_mid_batch_frees_both_sides_and_the_other_continues(decode, requests, workers):
    req_a, req_b = requests
    ref_a = decode.generate([req_a])[0].token_ids
    rec = Recorder()
    decode.submit(req_b, on_token=rec.on_token, on_done=rec.on_done)
    decode.submit(req_a, on_token=rec.on_token, on_done=rec.on_done)
    run_until(decode, lambda: len(decode._running) == 2 and len(rec.tokens("A")) >= 2)
    rid_b = next(lv.rid for lv in decode._running if lv.req.request_id == "B")
    assert rid_b in workers.workers[0].held() and decode.pool.get(rid_b) is not None
    box = {}
    canceller = threading.Thread(target=lambda: box.setdefault("ok", decode.cancel("B")))
    canceller.start()
    canceller.join(30)
    assert box == {"ok": True}
    assert rid_b not in workers.workers[0].held() and decode.pool.get(rid_b) is None  # freed before cancel returns
    n_b = len(rec.tokens("B"))
    run_until(decode, lambda: len(rec.outputs) == 2)
    assert rec.outputs["B"].finish_reason == "error" and "cancelled" in rec.outputs["B"].metrics.extra["error"]
    assert len(rec.tokens("B")) <= n_b + 1  # at most the step that was in flight
    assert rec.outputs["A"].finish_reason == "length" and rec.outputs["A"].token_ids == ref_a
    assert decode.cancel("B") is False  # nothing left in flight


def test_cancel_of_a_queued_request_never_plans_it(decode, requests):
    rec = Recorder()
    decode.submit(requests[0], on_token=rec.on_token, on_done=rec.on_done)
    assert decode.num_active == 1 and decode.cancel("A") is True
    decode.step()
    assert rec.events == [] and rec.outputs["A"].finish_reason == "error"
    assert "cancelled" in rec.outputs["A"].metrics.extra["error"]


def test_submit_rejects_a_request_longer_than_the_context(decode, model):
    n = model.cfg.max_position_embeddings
    with pytest.raises(ValueError):
        decode.submit(Request("long", [3] * n, [3] * n, SamplingParams(max_tokens=8)))
    assert decode.num_active == 0


def test_cancel_on_two_threads_while_pushes_are_in_flight_keeps_the_link(model, sel, requests):
    """A cancel racing another cancel (the server cancels from its control thread and from the
    engine thread) must not unregister the regions while the owner still writes into them: a WRITE
    to an unknown region closes the bulk connection and every later hand-off of that worker stalls."""
    slow = InProcessWorkers(model, sel, 1, bandwidth="1mbit")  # pushes crawl: free waits for them
    d = DecodeWorker(model, sel, TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3,
                                                max_blocks=16), secret=SECRET)
    try:
        d.connect(slow.addresses)
        rec = Recorder()
        d.submit(requests[1], on_token=rec.on_token, on_done=rec.on_done)
        d.step()  # planned and handed in; its proactive pushes start crawling
        run_until(d, lambda: slow.workers[0].held() != [])
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=lambda: (barrier.wait(), d.cancel("B"))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        run_until(d, lambda: "B" in rec.outputs)
        d.submit(requests[0], on_token=rec.on_token, on_done=rec.on_done)
        run_until(d, lambda: "A" in rec.outputs)
        assert rec.outputs["A"].finish_reason == "length"
        assert d.endpoint.metrics.snapshot()["frames_rejected"] == 0
        assert d.num_active == 0 and d.pool.live() == [] and d.pages.cache.pages_in_use == 0 and slow.workers[0].held() == []
    finally:
        d.close()
        slow.close()


def test_an_engine_error_fails_the_requests_in_flight_and_frees_them(decode, requests, monkeypatch):
    rec = Recorder()
    real_gather = DecodeWorker._gather

    def broken(self, *a):
        raise RuntimeError("lane exploded")

    decode.submit(requests[0], on_token=rec.on_token, on_done=rec.on_done)
    decode.submit(requests[1], on_token=rec.on_token, on_done=rec.on_done)
    run_until(decode, lambda: len(decode._running) == 2)
    monkeypatch.setattr(DecodeWorker, "_gather", broken)
    decode.step()  # logged, not raised
    assert {o.finish_reason for o in rec.outputs.values()} == {"error"} and len(rec.outputs) == 2
    assert all("lane exploded" in o.metrics.extra["error"] for o in rec.outputs.values())
    assert decode.num_active == 0 and decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0
    monkeypatch.setattr(DecodeWorker, "_gather", real_gather)
    after = Recorder()  # the worker keeps serving
    decode.submit(requests[0], on_token=after.on_token, on_done=after.on_done)
    run_until(decode, lambda: "A" in after.outputs)
    assert after.outputs["A"].finish_reason == "length" and len(after.outputs["A"].token_ids) == A_TOKENS


def test_a_lost_bulk_connection_fails_the_pending_request_instead_of_hanging(model, sel, requests):
    """Hand-offs travel on the bulk connection: when it dies before a request's hand-off, the
    request fails (naming the worker) and is freed on the prefill side over the main connection."""
    slow = InProcessWorkers(model, sel, 1, bandwidth="1mbit")
    d = DecodeWorker(model, sel, TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3,
                                                max_blocks=16), secret=SECRET)
    try:
        (owner,) = d.connect(slow.addresses)
        rec = Recorder()
        d.submit(requests[1], on_token=rec.on_token, on_done=rec.on_done)
        d.step()
        run_until(d, lambda: slow.workers[0].held() != [])
        d.endpoint.peers[d._bulk_of[owner]].close()
        run_until(d, lambda: "B" in rec.outputs)
        out = rec.outputs["B"]
        assert out.finish_reason == "error" and "prefill worker 'prefill-0' failed" in out.metrics.extra["error"]
        assert d.num_active == 0 and d.pool.live() == [] and d.pages.cache.pages_in_use == 0 and slow.workers[0].held() == []
        assert d.connect_one(slow.addresses[0]) == owner and d.owner_alive(owner)  # reconnects the bulk lane
    finally:
        d.close()
        slow.close()
