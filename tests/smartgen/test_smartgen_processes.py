"""Real OS processes: two prefill worker processes feeding one decode worker; the invariant
across them, a prefill worker killed mid-transfer (fail / recompute), cancel, and leak checks
on both sides (the workers report what they still hold over the "stats" RPC)."""
import threading
import time

import pytest

from jkv.disagg import protocol as proto
from jkv.disagg.cluster import LocalPrefillWorkers
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.selectors import save_selector
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import MAX_TOKENS, MODEL_SPEC, SECRET, InProcessWorkers, generate, make_requests


def start_workers(tmp_path, selector, **kw):
    path = tmp_path / "selector.pkl"
    save_selector(selector, path)
    return LocalPrefillWorkers(2, MODEL_SPEC, str(path), secret=SECRET, **kw)


def worker_stats(decode: DecodeWorker, owner: str) -> dict:
    header, _ = proto.unpack(decode.endpoint.peer(owner).call("stats", b"", timeout=10))
    return header


@pytest.fixture(scope="module")
def reference(model, selectors, prompts):
    """Tokens of `full` transfer from one in-process prefill worker, per prompt."""
    workers = InProcessWorkers(model, selectors["infinigen"], 1)
    try:
        return [o.token_ids for o in generate(model, selectors["infinigen"], workers.addresses, "full", prompts)]
    finally:
        workers.close()


@pytest.fixture(scope="module")
def process_workers(tmp_path_factory, selectors):
    """Two prefill worker processes on a paced link (4 Mbit/s, so transfers outlast prefill)."""
    workers = start_workers(tmp_path_factory.mktemp("sel"), selectors["infinigen"], bandwidth="4mbit")
    yield workers
    procs = list(workers.procs)
    workers.close()
    assert all(p.poll() is not None for p in procs)  # no worker process left running


def test_two_prefill_processes_keep_the_invariant_and_free_everything(process_workers, model, selectors, profiles,
                                                                         prompts, reference):
    sel = selectors["infinigen"]
    tokens = {}
    for mode in ("full", "partial", "smartgen"):
        decode = DecodeWorker(model, sel, TransferConfig(mode=mode, kr_fraction=0.3, max_blocks=16),
                              secret=SECRET, profile=profiles["infinigen"])
        try:
            decode.connect(process_workers.addresses)
            outs = decode.generate(make_requests(prompts, tag=mode))
            assert {o.metrics.extra["owner"] for o in outs} == {"prefill-0", "prefill-1"}
            tokens[mode] = [o.token_ids for o in outs]
            for owner in decode.owners:
                stats = worker_stats(decode, owner)
                assert stats["held"] == [] and stats["bytes_in_use"] == 0, stats
            assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0
        finally:
            decode.close()
    assert tokens["partial"] == tokens["full"] and tokens["smartgen"] == tokens["full"]


def _kill_after_handoffs(decode, kill, owner, box):
    def run():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with decode._lock:
                lives = list(decode._live.values())
            if lives and all(lv.handoff.is_set() for lv in lives):
                break
            time.sleep(0.01)
        box["remote_left"] = [lv.kv.local_fraction() < 1 for lv in lives if lv.owner == owner]
        kill()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _check_fault_outputs(outs, on_failure, reference):
    for i, o in enumerate(outs):
        owner0 = i % 2 == 0
        if owner0 and on_failure == "fail":
            assert o.finish_reason == "error" and o.token_ids == []
            assert "prefill worker 'prefill-0' failed" in o.metrics.extra["error"]
        elif owner0:
            assert o.finish_reason == "length" and o.metrics.extra["recomputed"], o.metrics.extra
            assert len(o.token_ids) == MAX_TOKENS
        else:  # the other worker's requests are served as if nothing happened
            assert o.finish_reason == "length" and o.token_ids == reference[i]


def test_prefill_process_killed_during_transfer_fails_its_requests_only(process_workers, model, selectors, prompts,
                                                                        reference):
    sel = selectors["infinigen"]
    decode = DecodeWorker(model, sel, TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3,
                                                     max_blocks=16), secret=SECRET)
    try:
        decode.connect(process_workers.addresses)
        box = {}
        killer = _kill_after_handoffs(decode, lambda: process_workers.kill(0), "prefill-0", box)
        outs = decode.generate(make_requests(prompts))
        killer.join()
        assert box["remote_left"] and all(box["remote_left"])  # the kill really hit mid-transfer
        _check_fault_outputs(outs, "fail", reference)
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0 and decode.pool.bytes_in_use == 0
        stats = worker_stats(decode, "prefill-1")
        assert stats["held"] == [] and stats["bytes_in_use"] == 0
    finally:
        decode.close()


def test_recompute_after_a_prefill_worker_dies(model, selectors, prompts, reference):
    sel = selectors["infinigen"]
    workers = InProcessWorkers(model, sel, 2, bandwidth="4mbit")
    decode = DecodeWorker(model, sel, TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3,
                                                     max_blocks=16), secret=SECRET, on_failure="recompute")
    try:
        decode.connect(workers.addresses)
        box = {}
        killer = _kill_after_handoffs(decode, workers.workers[0].endpoint.close, "prefill-0", box)
        outs = decode.generate(make_requests(prompts))
        killer.join()
        assert box["remote_left"] and all(box["remote_left"])
        _check_fault_outputs(outs, "recompute", reference)
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0 and workers.workers[1].held() == []
    finally:
        decode.close()
        workers.close()


def _check_only_r1_cancelled(outs, reference, decode, workers):
    """r1 ended cancelled, the others generated the reference tokens, nothing stays allocated."""
    assert outs[1].finish_reason == "error" and "cancelled" in outs[1].metrics.extra["error"]
    for i in (0, 2, 3):
        assert outs[i].finish_reason == "length" and outs[i].token_ids[:len(reference[i])] == reference[i]
    assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0 and workers.workers[0].held() == []


def test_cancel_frees_both_sides(model, selectors, prompts, reference):
    sel = selectors["infinigen"]
    workers = InProcessWorkers(model, sel, 1, bandwidth="4mbit")
    decode = DecodeWorker(model, sel, TransferConfig(mode="partial", kr_fraction=0.3, max_blocks=16), secret=SECRET)
    try:
        decode.connect(workers.addresses)
        requests = make_requests(prompts, max_tokens=12)
        box = {}

        def cancel_when_decoding():
            while not (decode._live and all(lv.handoff.is_set() for lv in list(decode._live.values()))):
                time.sleep(0.01)
            rid = next(lv.rid for lv in decode._live.values() if lv.req.request_id == "r1")
            box["held_before"] = rid in workers.workers[0].held()
            box["cancelled"] = decode.cancel("r1")
            box["held_after"] = rid in workers.workers[0].held()
            box["decode_after"] = decode.pool.get(rid) is not None

        t = threading.Thread(target=cancel_when_decoding, daemon=True)
        t.start()
        outs = decode.generate(requests)
        t.join()
        assert box == dict(held_before=True, cancelled=True, held_after=False, decode_after=False)
        _check_only_r1_cancelled(outs, reference, decode, workers)
    finally:
        decode.close()
        workers.close()


def test_lease_expiry_frees_kv_of_a_vanished_decode(model, selectors, prompts, caplog):
    sel = selectors["oracle"]
    workers = InProcessWorkers(model, sel, 1, lease_s=3.0)
    decode = DecodeWorker(model, sel, TransferConfig(mode="partial", kr_fraction=0.3, max_blocks=16), secret=SECRET)
    try:
        decode.connect(workers.addresses)
        decode._release_remote = lambda lv: None  # a decode that never says "free"
        with caplog.at_level("WARNING", logger="jkv.disagg.prefill_worker"):
            decode.generate(make_requests(prompts[:1], max_tokens=2))

            def expired():
                return [r for r in caplog.records if "lease expired" in r.getMessage()]

            # still held, unless a loaded box made generate() outlast the lease (then it expired already)
            assert workers.workers[0].held() != [] or expired()
            deadline = time.monotonic() + 10
            while workers.workers[0].held() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert workers.workers[0].held() == [] and workers.workers[0].pool.bytes_in_use == 0
        assert expired(), "the KV was freed, but not by the lease"
    finally:
        decode.close()
        workers.close()


def test_a_transfer_longer_than_the_lease_keeps_its_kv(model, selectors, prompts, caplog):
    """The lease covers silence, not a slow link: a push still draining renews it (a 4 x 2K full
    transfer on the benchmark's paced link outlasted the 300 s lease)."""
    sel = selectors["oracle"]
    cfg = model.cfg
    nbytes = 2 * cfg.num_layers * cfg.num_kv_heads * len(prompts[0]) * cfg.head_dim * 4
    workers = InProcessWorkers(model, sel, 1, lease_s=0.3, bandwidth=nbytes * 8 / 1.2)  # full push ~1.2 s
    try:
        with caplog.at_level("WARNING", logger="jkv.disagg.prefill_worker"):
            outs = generate(model, sel, [workers.addresses[0]], "full", prompts[:1], max_blocks=16)
        assert outs[0].finish_reason != "error" and outs[0].metrics.ttst > 1.0
        assert outs[0].metrics.extra["bytes"]["proactive"] == nbytes
        assert not [r for r in caplog.records if "lease expired" in r.getMessage()]
        assert workers.workers[0].held() == [] and workers.workers[0].pool.bytes_in_use == 0
    finally:
        workers.close()


class _PausingModel:
    """The worker's model, with a pause after prefill layer 0 (to race a cancel against the
    rest of the prefill); everything else delegates."""

    def __init__(self, model, at_layer0, resume):
        self._model, self._at_layer0, self._resume = model, at_layer0, resume

    def __getattr__(self, name):
        return getattr(self._model, name)

    def prefill(self, tokens, lengths, on_layer=None, **kw):
        def hook(layer, K, V):
            on_layer(layer, K, V)
            if layer == 0:
                self._at_layer0.set()
                assert self._resume.wait(30)
        return self._model.prefill(tokens, lengths, on_layer=hook, **kw)


def test_cancel_during_prefill_stops_its_writes_and_keeps_the_link(model, selectors, prompts, reference):
    """A request cancelled while its prefill is still running: the worker must not push its
    later layers (the decode side has unregistered the regions — such a write would be rejected
    and take the whole bulk connection down, failing every other request on that worker)."""
    sel = selectors["infinigen"]
    at_layer0, resume = threading.Event(), threading.Event()
    workers = InProcessWorkers(model, sel, 1)
    workers.workers[0].model = _PausingModel(model, at_layer0, resume)
    decode = DecodeWorker(model, sel, TransferConfig(mode="full", max_blocks=16), secret=SECRET)
    try:
        decode.connect(workers.addresses)
        box = {}

        def cancel_mid_prefill():
            assert at_layer0.wait(60)
            box["cancelled"] = decode.cancel("r1")
            resume.set()

        t = threading.Thread(target=cancel_mid_prefill, daemon=True)
        t.start()
        outs = decode.generate(make_requests(prompts))
        t.join()
        assert box == dict(cancelled=True)
        assert outs[1].finish_reason == "error" and "cancelled" in outs[1].metrics.extra["error"]
        for i in (0, 2, 3):
            assert outs[i].finish_reason == "length" and outs[i].token_ids == reference[i]
        assert decode.endpoint.metrics.snapshot()["frames_rejected"] == 0
        assert decode.alive_owners() == ["prefill-0"]
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0 and workers.workers[0].held() == []
    finally:
        resume.set()
        decode.close()
        workers.close()


def test_a_cancel_racing_a_fetch_refetches_without_it_and_fails_nothing_else(model, selectors, prompts, reference):
    """A request cancelled between the mask snapshot and its "fetch" RPC: the prefill worker has
    already freed it and refuses the RPC; that must not count as the owner failing (which would
    fail every other request it holds) — the step fetches again without the cancelled request."""
    sel = selectors["infinigen"]
    workers = InProcessWorkers(model, sel, 1, bandwidth="4mbit")
    decode = DecodeWorker(model, sel, TransferConfig(mode="partial", kr_fraction=0.3, max_blocks=16), secret=SECRET)
    real_call, box = decode._call, {}

    def racing_call(owner, payload):
        header, _ = proto.unpack(payload)
        if not box and any(rid.startswith("r1.") for rid, _ in header["items"]):
            box["cancelled"] = decode.cancel("r1")  # freed on both sides before this RPC goes out
        return real_call(owner, payload)

    decode._call = racing_call
    try:
        decode.connect(workers.addresses)
        outs = decode.generate(make_requests(prompts, max_tokens=12))
        assert box == dict(cancelled=True)
        _check_only_r1_cancelled(outs, reference, decode, workers)
    finally:
        decode.close()
        workers.close()
