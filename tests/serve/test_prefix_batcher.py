"""Prefix caching in the PagedBatcher (tiny random model): tokens and their log-probs equal a run
without prefix caching for shared system prompts, multi-turn follow-ups (which reuse pages filled
by generated tokens), eviction under page pressure and random reuse with concurrent requests and
cancellation mid-prefill; pages never leak; the hit, cached-page and eviction metrics move."""
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jkv import SamplingParams
from jkv.serving.batcher import BatcherConfig
from jkv.serving.metrics import ServerMetrics
from jkv.serving.paged_batcher import PagedBatcher
from models import tiny_model
from engine_events import collect, start_paged, submit, token_ids

PAGE = 8
CHUNK = 32


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def _start(model, metrics=None, **kw):
    return start_paged(model, metrics, dict(max_slots=4, max_model_len=256, page_size=PAGE, prefill_chunk=CHUNK), **kw)


@pytest.fixture(scope="module")
def reference(model):
    """The same engine without prefix caching; answers are memoized per (prompt, max_tokens)."""
    b = _start(model, enable_prefix_caching=False)
    memo = {}

    def run(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = _answer(collect(submit(b, "ref", prompt, _greedy(max_tokens), logprobs=1)))
        return memo[key]

    yield run
    b.stop()
    assert b.kv.stats()["kv_pages_in_use"] == 0 and "prefix_hit_tokens" not in b.kv.stats()


def _greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _answer(events):
    """(token ids, their log-probs) of a finished request's events."""
    return token_ids(events), [lp.logprob for ev in events for lp in (ev.logprobs or [])]


def _assert_same(got, want, what):
    assert got[0] == want[0], f"{what}: tokens differ with prefix caching"
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, err_msg=f"{what}: log-probs differ")


def _idle_and_leak_free(b):
    t0 = time.time()
    while b.num_running or b.num_waiting:
        assert time.time() - t0 < 60, "requests did not finish"
        time.sleep(0.01)
    assert b.pages_in_use == 0 and b.kv.requests == [], "KV pages leaked"
    b.kv.allocator.check()


def _prompt(rng, n):
    return [int(t) for t in rng.integers(3, 301, n)]


def _metric(metrics, name, labels=None):
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    raise AssertionError(f"{name} is not on /metrics")


def test_shared_system_prompt_and_multi_turn_equal_the_run_without_prefix_caching(model, reference):
    metrics = ServerMetrics()
    b = _start(model, metrics)
    try:
        assert _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"}) == 0
        rng = np.random.default_rng(0)
        system = _prompt(rng, 3 * PAGE + 5)  # 3 full pages + a partial one
        users = [_prompt(rng, n) for n in (2, 11, 40, 7)]
        # the first alone (its pages get cached), then three at once sharing them
        first = _answer(collect(submit(b, "u0", system + users[0], _greedy(10), logprobs=1)))
        _assert_same(first, reference(system + users[0], 10), "first request")
        hits0 = _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"})
        assert hits0 == 0 and _metric(metrics, "jkv_prefix_cache_pages", {"tier": "device"}) >= 3
        qs = [submit(b, f"u{i}", system + u, _greedy(12), logprobs=1) for i, u in enumerate(users[1:], 1)]
        for i, q in enumerate(qs, 1):
            _assert_same(_answer(collect(q)), reference(system + users[i], 12), f"shared system prompt, user {i}")
        hits = _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"})
        assert hits >= 3 * 3 * PAGE  # each of the three reused the system prompt's 3 full pages
        # multi-turn: the follow-up prompt is the conversation so far (system, user, answer, new user turn)
        conversation = system + users[0] + first[0] + _prompt(rng, 6)
        before = hits
        follow = _answer(collect(submit(b, "turn2", conversation, _greedy(10), logprobs=1)))
        _assert_same(follow, reference(conversation, 10), "second turn")
        hits = _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"})
        full_written = (len(system + users[0]) + len(first[0]) - 1) // PAGE  # prompt + generated KV written
        assert hits - before == full_written * PAGE, "the second turn did not reuse the first turn's answer pages"
        assert _metric(metrics, "jkv_prefix_cache_query_tokens_total") >= hits
        assert _metric(metrics, "jkv_prefix_cache_evictions_total", {"tier": "device"}) == 0
        _idle_and_leak_free(b)
        assert _metric(metrics, "jkv_kv_pages_in_use") == 0  # cached pages are not "in use"
        assert _metric(metrics, "jkv_kv_pages_free") == b.page_cfg.usable_pages  # ... they count as free
        assert _metric(metrics, "jkv_prefix_cache_evictable_pages") == b.kv.pages_cached > 0
    finally:
        b.stop()
    assert b.clear_prefix_cache() > 0 and b.kv.pages_free == b.kv.allocator.capacity


def test_a_request_admitted_mid_prefill_of_its_prefix_shares_only_the_written_pages(model, reference):
    """B arrives after A's first prefill chunk (32 of its 70 tokens): B may share A's first 4 pages,
    not the pages A's later chunks have yet to write."""
    b = _start(model)
    rng = np.random.default_rng(2)
    shared_prompt = _prompt(rng, 70)
    real = b._prefill_chunk
    queues = {}

    def first_chunk_then_submit_b(slot, run, n_chunk):
        real(slot, run, n_chunk)
        if run.req.request_id == "A" and "B" not in queues:  # engine thread: B is admitted next iteration
            queues["B"] = submit(b, "B", shared_prompt + [9, 9], _greedy(8), logprobs=1)

    b._prefill_chunk = first_chunk_then_submit_b
    try:
        queues["A"] = submit(b, "A", shared_prompt + [4], _greedy(8), logprobs=1)
        got_a = _answer(collect(queues["A"]))
        got_b = _answer(collect(queues["B"]))
        assert b.kv.stats()["prefix_hit_tokens"] == 4 * PAGE
        _assert_same(got_b, reference(shared_prompt + [9, 9], 8), "B")
        _assert_same(got_a, reference(shared_prompt + [4], 8), "A")
        _idle_and_leak_free(b)
    finally:
        b.stop()


def _two_rounds_of_three_system_prompts(b, reference, tag):
    """Three 4-page system prompts asked twice each, every answer checked against the reference:
    on a 20-page pool each admission evicts cached pages of earlier prompts."""
    rng = np.random.default_rng(1)
    systems = [_prompt(rng, 4 * PAGE + 3) for _ in range(3)]
    for round_ in range(2):
        for s, system in enumerate(systems):
            prompt = system + [5 + round_, 7 + s]
            _assert_same(_answer(collect(submit(b, f"{tag}{round_}{s}", prompt, _greedy(40), logprobs=1))),
                         reference(prompt, 40), f"round {round_} system {s}")


def test_eviction_under_page_pressure_keeps_tokens_right(model, reference):
    """A pool of 20 pages: every admission must evict cached pages of earlier prompts."""
    metrics = ServerMetrics()
    b = _start(model, metrics, max_slots=2, num_pages=21)
    try:
        _two_rounds_of_three_system_prompts(b, reference, "e")
        assert _metric(metrics, "jkv_prefix_cache_evictions_total", {"tier": "device"}) > 0
        _idle_and_leak_free(b)
    finally:
        b.stop()


def test_the_host_tier_takes_evicted_pages_and_serves_them_back_with_the_same_tokens(model, reference):
    """As above with a host tier: the second round's prompts were evicted from the device pool, so
    their system prompts come back from host memory (tier "host") instead of being recomputed."""
    metrics = ServerMetrics()
    b = _start(model, metrics, max_slots=2, num_pages=21, prefix_cache_host_bytes=64 << 20)
    try:
        _two_rounds_of_three_system_prompts(b, reference, "h")
        assert _metric(metrics, "jkv_prefix_cache_host_writes_total") > 0
        host_hits = _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "host"})
        assert host_hits >= 4 * PAGE
        assert _metric(metrics, "jkv_prefix_cache_pages", {"tier": "host"}) > 0
        # the pages loaded back crossed host->device ("fetched"); nothing else did (decode steps
        # compute their KV on the device)
        page_bytes = b.kv.page_bytes
        assert _metric(metrics, "jkv_kv_host_to_device_bytes", {"cause": "fetched"}) == host_hits // PAGE * page_bytes
        assert _metric(metrics, "jkv_kv_host_to_device_bytes", {"cause": "arrived"}) == 0
        assert _metric(metrics, "jkv_kv_host_to_device_bytes", {"cause": "other"}) == 0
        _idle_and_leak_free(b)
    finally:
        b.stop()


def test_prefix_caching_off_has_no_prefix_metrics_and_shares_nothing(model):
    metrics = ServerMetrics()
    b = _start(model, metrics, enable_prefix_caching=False)
    try:
        p = list(range(3, 3 + 3 * PAGE))
        for i in range(2):
            collect(submit(b, f"o{i}", p, _greedy(3)))
        assert "jkv_prefix_cache" not in metrics.render().decode()
        assert b.kv.pages_cached == 0 and b.kv.allocator.num_free == b.kv.allocator.capacity
    finally:
        b.stop()


# ---------------------------------------------------------------------------- property test
@pytest.fixture(scope="module", params=["device", "host"])
def shared(model, request):
    """One engine with a 24-page pool for every example (so cached pages carry over between them);
    "host": with an L2 tier, so evicted prefixes come back through the loading stages
    (jkv/serving/prefix_loader.py) and a cancel may land mid-load."""
    b = _start(model, max_slots=3, num_pages=25, prefix_cache_host_bytes=(64 << 20) * (request.param == "host"))
    yield b
    b.stop()
    _idle_and_leak_free(b)
    assert b.loader is None or b.loader.pipeline.slots_in_use() == {"host": 0, "device": 0}
    b.clear_prefix_cache()
    assert b.kv.pages_free == b.kv.allocator.capacity and b.kv.pages_cached == 0


_SYSTEMS = [[(7 * s + 3 * j) % 290 + 5 for j in range(n)] for s, n in enumerate((PAGE + 1, 2 * PAGE, 3 * PAGE + 5,
                                                                               5 * PAGE + 2))]
_request = st.tuples(st.integers(0, len(_SYSTEMS) - 1),  # which system prompt
                     st.lists(st.integers(3, 300), max_size=2 * PAGE + 3),  # the user's tail
                     st.integers(1, 12),  # max_tokens
                     st.sampled_from(["keep", "keep", "keep", "cancel"]),  # cancel right after submit
                     st.floats(0, 0.05))  # delay before the next submit


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_request, min_size=2, max_size=6))
def test_random_reuse_concurrency_and_cancellation_never_give_wrong_kv_or_leak(shared, reference, requests):
    queues = []
    for i, (system, tail, max_tokens, fate, delay) in enumerate(requests):
        prompt = _SYSTEMS[system] + tail
        q = submit(shared, f"p{i}", prompt, _greedy(max_tokens), logprobs=1)
        if fate == "cancel":
            shared.cancel(f"p{i}")  # queued, mid-prefill or decoding: whichever it reached
        queues.append((prompt, max_tokens, fate, q))
        time.sleep(delay)
    for i, (prompt, max_tokens, fate, q) in enumerate(queues):
        events = collect(q)
        if events[-1].finish_reason == "cancelled":
            assert fate == "cancel"
            continue
        _assert_same(_answer(events), reference(prompt, max_tokens), f"request {i}")
    _idle_and_leak_free(shared)


def test_smollm2_multi_turn_chat_with_a_system_prompt_equals_llm_generate():
    """The real model (SmolLM2-135M, float32): a shared system prompt and a second turn that reuses
    the first turn's prompt and answer pages give LLM.generate's greedy tokens."""
    from jkv import LLM
    from models import load_model

    smol = load_model("smollm2-135m-instruct")
    llm = LLM(smol)
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence and "
                                           "never use lists. Prefer plain words over jargon."}
    turn1 = [system, {"role": "user", "content": "What is the capital of France?"}]
    other = [system, {"role": "user", "content": "Name a large ocean."}]
    metrics = ServerMetrics()
    # 8 pages, the pool LLM's engine sizes itself for these requests (a power of two above the 4 and
    # 6 pages of turn 1 and turn 2): the batcher's KV then has the reference's shape and its decode
    # steps run the reference's compiled SmolLM2 programs instead of compiling their own (~10 s of
    # CPU each). 7 usable pages hold turn 1's cached pages while turn 2 reserves its 6.
    b = PagedBatcher(smol, BatcherConfig(max_slots=2, max_model_len=512, page_size=16, prefill_chunk=64,
                                         num_pages=8), metrics)
    b.start()
    try:
        sp = SamplingParams(max_tokens=16)
        a1 = token_ids(collect(submit(b, "t1", llm.encode_prompt(turn1), sp)))
        assert a1 == llm.generate(turn1, sp)[0].token_ids
        assert token_ids(collect(submit(b, "o", llm.encode_prompt(other), sp))) == llm.generate(other, sp)[0].token_ids
        text1 = smol.tokenizer.decode(a1)
        turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And of Italy?"}]
        before = _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"})
        a2 = token_ids(collect(submit(b, "t2", llm.encode_prompt(turn2), sp)))
        assert a2 == llm.generate(turn2, sp)[0].token_ids
        assert _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"}) - before >= 3 * 16
        _idle_and_leak_free(b)
    finally:
        b.stop()
