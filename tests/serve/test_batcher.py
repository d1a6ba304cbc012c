"""ContinuousBatcher on a tiny random model: equals LLM.generate, joins mid-flight, cancels, no leaks."""
import time

import numpy as np
import pytest

from jkv import LLM, SamplingParams
from jkv.serving.batcher import BatcherConfig, ContextLengthError, ContinuousBatcher, EngineRequest
from jkv.serving.metrics import ServerMetrics
from models import load_model, tiny_model
from engine_events import collect, submit as _submit, token_ids as _ids


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture
def batcher(model):
    b = ContinuousBatcher(model, BatcherConfig(max_slots=3, max_model_len=256))
    b.start()
    yield b
    b.stop()
    assert b.num_running == 0 and b.num_waiting == 0, "a slot or queued request leaked"


def _collect(q, timeout=60):
    return collect(q, timeout)


def test_greedy_equals_llm_generate_with_staggered_arrivals(model, batcher):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 301, n)) for n in (5, 17, 9, 30, 3)]
    prompts = [[int(t) for t in p] for p in prompts]
    maxes = [12, 5, 20, 7, 9]
    llm = LLM(model)
    want = [llm.generate(p, SamplingParams(max_tokens=m, ignore_eos=True))[0].token_ids
            for p, m in zip(prompts, maxes)]
    qs = []
    for i, (p, m) in enumerate(zip(prompts, maxes)):  # 5 requests, 3 slots: later ones queue and join mid-decode
        qs.append(_submit(batcher, f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True)))
        time.sleep(0.01 * i)
    got = [_ids(_collect(q)) for q in qs]
    assert got == want


def test_seeded_sampling_is_independent_of_batch_mates(batcher):
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    alone = _ids(_collect(_submit(batcher, "a", [5, 6, 7], sp)))
    other = _submit(batcher, "b", [9, 9, 9, 9], SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    together = _ids(_collect(_submit(batcher, "c", [5, 6, 7], sp)))
    _collect(other)
    assert alone == together and len(alone) == 8


def test_cancel_frees_the_slot_and_ends_with_cancelled(batcher):
    q = _submit(batcher, "long", [4, 5], SamplingParams(max_tokens=200, ignore_eos=True))
    q.get(timeout=30)  # running
    assert batcher.num_running == 1
    batcher.cancel("long")
    events = _collect(q)
    assert events[-1].finish_reason == "cancelled" and len(_ids(events)) < 200
    assert batcher.num_running == 0


def test_cancel_of_a_queued_request(model):
    metrics = ServerMetrics()
    b = ContinuousBatcher(model, BatcherConfig(max_slots=1, max_model_len=128), metrics)
    b.start()
    try:
        q1 = _submit(b, "x", [3], SamplingParams(max_tokens=100, ignore_eos=True))
        q2 = _submit(b, "y", [3], SamplingParams(max_tokens=100, ignore_eos=True))
        b.cancel("y")
        assert _collect(q2)[-1].finish_reason == "cancelled"
        assert _collect(q1)[-1].finish_reason == "length"
    finally:
        b.stop()
    assert b.num_running == 0 and b.num_waiting == 0
    assert metrics.queue_len._value.get() == 0 and metrics.slots_allocated._value.get() == 0
    assert metrics.finished.labels("cancelled")._value.get() == 1


def test_over_long_request_names_both_lengths(batcher):
    with pytest.raises(ContextLengthError, match=r"maximum context length is 256.*250 in the prompt, 10"):
        batcher.submit(EngineRequest("big", [3] * 250, SamplingParams(max_tokens=10), lambda ev: None))
    assert batcher.num_waiting == 0


def test_stop_fails_running_requests_with_an_error_event(model):
    b = ContinuousBatcher(model, BatcherConfig(max_slots=2, max_model_len=512))
    b.start()
    q = _submit(b, "z", [3, 4], SamplingParams(max_tokens=400, ignore_eos=True))
    q.get(timeout=30)
    b.stop()
    last = _collect(q)[-1]
    assert last.finish_reason == "error" and "shutting down" in last.error
    assert b.num_running == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash, re-raised
@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_after_an_engine_crash_new_requests_are_refused_not_left_waiting(model, layout, monkeypatch):
    from jkv.serving.batcher import create_batcher

    b = create_batcher(model, BatcherConfig(max_slots=2, max_model_len=256, kv_layout=layout))
    steps = 0

    def broken_decode(*a, **kw):  # the first decode step of the engine dies (a bug, a device error)
        nonlocal steps
        steps += 1
        raise RuntimeError("boom in decode")

    monkeypatch.setattr(b, "_step", broken_decode)
    b.start()
    try:
        first = _collect(_submit(b, "a", [3, 4], SamplingParams(max_tokens=5)), timeout=30)
        assert first[-1].finish_reason == "error" and "boom in decode" in first[-1].error
        b._thread.join(10)
        assert not b._thread.is_alive() and steps >= 1
        with pytest.raises(RuntimeError, match="engine thread has stopped; restart the server"):
            _submit(b, "b", [3, 4], SamplingParams(max_tokens=5))  # before the fix: queued forever, no event
        assert b.num_waiting == 0 and not b.readiness()[0]
    finally:
        b.stop()


def test_smollm2_chat_with_stop_string_equals_llm_generate():
    """The real model: text through the batcher (streamed deltas) equals LLM.generate, stop string included."""
    smol = load_model("smollm2-135m-instruct")
    llm = LLM(smol)
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = llm.encode_prompt(chat)
    full = llm.generate(chat, SamplingParams(max_tokens=16))[0].text
    stop = full.split()[3]  # a word in the middle of the answer
    want = full[:full.find(stop)]  # what LLM.generate returns with stop=(stop,) (greedy: same prefix)
    b = ContinuousBatcher(smol, BatcherConfig(max_slots=2, max_model_len=256))
    b.start()
    try:
        other = _submit(b, "other", ids[:10], SamplingParams(max_tokens=20, ignore_eos=True))
        events = _collect(_submit(b, "smol", ids, SamplingParams(max_tokens=16, stop=(stop,))))
        _collect(other)
    finally:
        b.stop()
    assert "".join(ev.text for ev in events) == events[-1].final_text == want
    assert events[-1].finish_reason == "stop" and len(want) > 5


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash, re-raised
def test_a_disaggregated_decode_engine_crash_fails_its_requests_frees_their_kv_and_refuses_new_ones(model):
    """DisaggBatcher's engine thread dying in a worker step (before: running requests waited forever,
    and every later request too): the running request ends with the error, the worker is told to
    release its KV, and a new submit is refused with the reason (the server's 503)."""
    from types import SimpleNamespace as NS

    from jkv.kvcache import PageConfig
    from jkv.serving.disagg_decode import DisaggBatcher

    class CrashingWorker:
        on_failure, owners = "fail", ["p0"]
        pages = NS(cache=NS(page_cfg=PageConfig(16, 64), prefix_caching=False))
        endpoint = NS(peers={})

        def __init__(self):
            self.active, self.cancelled = set(), []

        def owner_alive(self, owner):
            return True

        def submit(self, request, *, on_token=None, on_done=None, owner=None):
            self.active.add(request.request_id)

        @property
        def num_active(self):
            return len(self.active)

        def step(self, wait=0.0):
            raise RuntimeError("boom in the decode step")

        def cancel(self, request_id):
            self.cancelled.append(request_id)
            self.active.discard(request_id)
            return True

    worker = CrashingWorker()
    b = DisaggBatcher(model, worker, BatcherConfig(2, 256, kv_layout="paged"))
    b.start()
    try:
        events = _collect(_submit(b, "a", [3, 4], SamplingParams(max_tokens=5)), timeout=30)
        assert events[-1].finish_reason == "error" and "boom in the decode step" in events[-1].error
        assert worker.cancelled == ["a"] and worker.num_active == 0
        with pytest.raises(RuntimeError, match="decode engine thread has stopped; restart the server"):
            _submit(b, "b", [3, 4], SamplingParams(max_tokens=5))
        assert b.num_waiting == 0 and not b.readiness()[0]
    finally:
        b.stop(timeout=5)
