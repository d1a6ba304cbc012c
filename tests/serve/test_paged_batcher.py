"""PagedBatcher (paged KV cache + chunked prefill) on a tiny random model: every request of a
mixed-length batch equals LLM.generate, chunked prefill interleaves with decode without changing
tokens, pages come back after finish / cancel / failure / stop, and a full pool queues requests."""
import logging
import queue
import threading
import time

import numpy as np
import pytest

from jkv import LLM, SamplingParams
from jkv.serving.batcher import BatcherConfig, ContinuousBatcher, EngineRequest, create_batcher
from jkv.serving.metrics import ServerMetrics
from jkv.serving.paged_batcher import KVCapacityError, PagedBatcher, _bucket_rows, page_config, row_buckets
from models import tiny_model
from engine_events import collect as _collect, start_paged, submit as _submit, token_ids as _ids

PAGE = 8
CHUNK = 32  # prompts longer than this are prefilled in several chunks


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model)


def _paged(model, metrics=None, **kw):
    return start_paged(model, metrics, dict(max_slots=4, max_model_len=1024, page_size=PAGE, prefill_chunk=CHUNK), **kw)


@pytest.fixture
def paged(model):
    b = _paged(model)
    yield b
    b.stop()
    assert b.num_running == 0 and b.num_waiting == 0, "a seat or queued request leaked"
    assert b.pages_in_use == 0 and b.kv.requests == [], "KV pages leaked"


def _prompt(rng, n):
    return [int(t) for t in rng.integers(3, 301, n)]


def _greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_create_batcher_picks_the_layout(model):
    assert isinstance(create_batcher(model, BatcherConfig(kv_layout="slots")), ContinuousBatcher)
    assert type(create_batcher(model, BatcherConfig())) is PagedBatcher  # paged is the default
    with pytest.raises(ValueError, match="kv_layout='rows' must be one of"):
        BatcherConfig(kv_layout="rows")
    # default pool: the slot layout's KV memory (max_slots x max_model_len) plus the null page
    assert page_config(BatcherConfig(max_slots=3, max_model_len=100, page_size=16)).num_pages == 3 * 7 + 1


def test_every_request_of_a_mixed_length_batch_equals_llm_generate(model, llm, paged):
    rng = np.random.default_rng(0)
    lengths = (3, 70, 17, 130, 9, 41, 1, 100)  # 1 to 5 chunks, page boundaries crossed mid-decode
    maxes = (12, 9, 20, 6, 15, 11, 8, 10)
    prompts = [_prompt(rng, n) for n in lengths]
    want = [llm.generate(p, _greedy(m))[0].token_ids for p, m in zip(prompts, maxes)]
    qs = []
    for i, (p, m) in enumerate(zip(prompts, maxes)):  # 8 requests, 4 seats: later ones queue and join mid-decode
        qs.append(_submit(paged, f"r{i}", p, _greedy(m)))
        time.sleep(0.01 * (i % 3))
    got = [_ids(_collect(q)) for q in qs]
    assert got == want


def test_a_long_prompt_is_prefilled_between_decode_steps_of_a_running_stream(model, llm, paged):
    rng = np.random.default_rng(1)
    short, long_ = _prompt(rng, 5), _prompt(rng, 6 * CHUNK + 3)  # 7 chunks
    trace = []  # ("chunk", None) per prefill chunk of the long prompt, ("token", rid) per streamed token
    real = paged._prefill_chunk

    def traced(slot, run, n_chunk):
        if run.req.request_id == "long":
            trace.append(("chunk", None))
        return real(slot, run, n_chunk)

    paged._prefill_chunk = traced
    q_short = queue.Queue()
    paged.submit(EngineRequest("short", short, _greedy(40),
                               lambda ev: (trace.append(("token", "short")), q_short.put(ev))))
    q_short.get(timeout=60)  # the short request is streaming
    q_long = _submit(paged, "long", long_, _greedy(5))
    got_long, got_short = _ids(_collect(q_long)), _ids(_collect(q_short))
    chunks = [i for i, (kind, _) in enumerate(trace) if kind == "chunk"]
    assert len(chunks) == 7
    between = [rid for kind, rid in trace[chunks[0]:chunks[-1]] if kind == "token"]
    assert len(between) >= 6, f"the stream got {len(between)} tokens during the 7-chunk prefill (want one per chunk)"
    assert got_long == llm.generate(long_, _greedy(5))[0].token_ids
    assert len(got_short) == 39  # the first event was taken above
    assert llm.generate(short, _greedy(40))[0].token_ids[1:] == got_short


def test_prompt_logprobs_across_chunks_equal_the_slot_engine(model):
    """Prompt and token logprobs from chunked prefill equal the whole-prompt prefill's."""
    rng = np.random.default_rng(2)
    ids = _prompt(rng, 2 * CHUNK + 7)
    out = {}
    for layout in ("slots", "paged"):
        b = create_batcher(model, BatcherConfig(max_slots=2, max_model_len=320, kv_layout=layout, page_size=PAGE,
                                                prefill_chunk=CHUNK))
        b.start()
        try:
            echo = _collect(_submit(b, "echo", ids, _greedy(1), prompt_logprobs=2, prompt_only=True))
            gen = _collect(_submit(b, "gen", ids, _greedy(4), logprobs=3, prompt_logprobs=1))
        finally:
            b.stop()
        out[layout] = (echo, gen)
    (s_echo, s_gen), (p_echo, p_gen) = out["slots"], out["paged"]
    assert len(p_echo) == 1 and p_echo[0].finish_reason == "length" and p_echo[0].final_text == ""
    for want, got in ((s_echo[0].prompt_logprobs, p_echo[0].prompt_logprobs),
                      (s_gen[0].prompt_logprobs, p_gen[0].prompt_logprobs)):
        assert len(got) == len(ids) and got[0] is None
        assert [g.token_id for g in got[1:]] == ids[1:]
        np.testing.assert_allclose([g.logprob for g in got[1:]], [w.logprob for w in want[1:]], atol=1e-4)
        assert [[t for t, _ in g.top] for g in got[1:]] == [[t for t, _ in w.top] for w in want[1:]]
    s_lp = [lp for ev in s_gen for lp in (ev.logprobs or [])]
    p_lp = [lp for ev in p_gen for lp in (ev.logprobs or [])]
    assert [x.token_id for x in p_lp] == [x.token_id for x in s_lp] == _ids(p_gen)
    np.testing.assert_allclose([x.logprob for x in p_lp], [x.logprob for x in s_lp], atol=1e-4)


def test_seeded_sampling_is_independent_of_batch_mates(paged):
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    alone = _ids(_collect(_submit(paged, "a", [5, 6, 7], sp)))
    other = _submit(paged, "b", [9] * 50, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    together = _ids(_collect(_submit(paged, "c", [5, 6, 7], sp)))
    _collect(other)
    assert alone == together and len(alone) == 8


def test_row_buckets_are_powers_of_two_up_to_max_slots():
    assert [_bucket_rows(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert row_buckets(8) == [1, 2, 4, 8]
    assert row_buckets(6) == [1, 2, 4, 6] and _bucket_rows(5, 6) == 6
    assert row_buckets(1) == [1]


def test_warmup_compiles_the_greedy_pick_and_the_sampler_of_every_row_bucket(model, count_compiles):
    """A batch of only greedy rows takes `sample_or_argmax`'s argmax, a program of its own per row
    bucket: left to the first such step, it compiled mid-serving (a stall of every stream)."""
    from jkv.sampling import sample_or_argmax

    b = PagedBatcher(model, BatcherConfig(max_slots=4, max_model_len=64, page_size=PAGE, prefill_chunk=CHUNK))
    b.warmup()
    with count_compiles() as compiles:
        for B in row_buckets(4):
            z = np.zeros(B, np.int32)
            for temperature in (0.0, 0.7):
                sample_or_argmax(np.ones((B, model.cfg.vocab_size), np.float32), np.full(B, temperature, np.float32),
                                 z, np.ones(B, np.float32), z.astype(np.uint32), z)
    assert compiles == []


def test_a_decode_step_runs_as_many_rows_as_its_requests_bucket_to(model, llm):
    """One request decodes in the 1-row program, three in the 4-row one, two in the 2-row one (not
    max_slots rows each step), the warm-up compiled each of them, and the tokens are unchanged."""
    steps, warm = [], []  # (requests in the step, rows of the step's program)
    real = model.paged_decode_step

    def recording(kv, table, tokens, positions, sink):
        live = int((np.asarray(table) != 0).any(axis=1).sum())  # idle rows read only the null page 0
        sink.append((live, np.asarray(table).shape[0]))
        return real(kv, table, tokens, positions)

    b = PagedBatcher(_Proxy(model, paged_decode_step=lambda *a: recording(*a, warm)),
                     BatcherConfig(max_slots=4, max_model_len=256, page_size=PAGE, prefill_chunk=CHUNK))
    b.warmup()
    assert {rows for _, rows in warm} == {1, 2, 4}
    b.model = _Proxy(model, paged_decode_step=lambda *a: recording(*a, steps))
    b.start()
    try:
        rng = np.random.default_rng(5)
        alone = _prompt(rng, 11)
        assert _ids(_collect(_submit(b, "alone", alone, _greedy(6)))) == llm.generate(alone, _greedy(6))[0].token_ids
        assert set(steps) == {(1, 1)}
        prompts, maxes = [_prompt(rng, n) for n in (5, 20, 9)], (10, 20, 30)
        qs = [_submit(b, f"r{i}", p, _greedy(m)) for i, (p, m) in enumerate(zip(prompts, maxes))]
        got = [_ids(_collect(q)) for q in qs]
    finally:
        b.stop()
    assert got == [llm.generate(p, _greedy(m))[0].token_ids for p, m in zip(prompts, maxes)]
    assert all(rows == _bucket_rows(live, 4) for live, rows in steps)
    assert {(3, 4), (2, 2), (1, 1)} <= set(steps)


def test_warmup_logs_how_many_decode_programs_it_compiles_and_each_table_width_done(model):
    """A start-up compiles for minutes on a loaded CPU: the warm-up says what it compiles and logs
    each page-table width once its programs are compiled (bench_serve_mixed shows a starting
    server's last log line), in order, ending with the widest."""
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("jkv.serving.paged_batcher")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:  # 64 tokens in pages of 8: tables of 4 and 8 pages, rows 1 and 2
        PagedBatcher(model, BatcherConfig(max_slots=2, max_model_len=64, page_size=PAGE, prefill_chunk=CHUNK)).warmup()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert lines[0] == "warm-up: compiling 4 decode programs (rows [1, 2] x page-table widths [4, 8])"
    done = [line.split(" (")[0] + line.split(" (")[1].split(",")[0] for line in lines[1:]]
    assert done == ["warm-up: decode programs for 4-page tables compiled1/2 widths",
                    "warm-up: decode programs for 8-page tables compiled2/2 widths"]


# ------------------------------------------------------------------- page leaks
def test_cancel_while_prefilling_and_while_decoding_gives_the_pages_back(model, paged):
    rng = np.random.default_rng(3)
    q_dec = _submit(paged, "dec", [4, 5], _greedy(300))
    q_dec.get(timeout=60)  # decoding
    held = paged.pages_in_use
    assert held == page_config(paged.config).pages_for(2 + 300)  # prompt + max_tokens reserved at admission
    long_ = _prompt(rng, 24 * CHUNK)
    q_pre = _submit(paged, "pre", long_, _greedy(5))
    t0 = time.time()
    while not any(r is not None and r.req.request_id == "pre" and 0 < r.prefilled < len(long_)
                  for r in list(paged._slots)):
        assert time.time() - t0 < 60, "the long prompt never started its chunked prefill"
        time.sleep(0.001)
    paged.cancel("pre")  # mid-prefill: some chunks are in its pages, the rest never run
    events = _collect(q_pre)
    assert events[-1].finish_reason == "cancelled" and _ids(events) == []
    paged.cancel("dec")
    events = _collect(q_dec)
    assert events[-1].finish_reason == "cancelled" and len(_ids(events)) < 300
    assert paged.pages_in_use == 0  # already back when the last event was emitted


def test_a_failed_prefill_ends_with_an_error_and_frees_its_pages(model, llm, paged):
    real = model.prefill_chunk

    def failing(cache, table, tokens, *a, **kw):
        if int(np.asarray(tokens)[0, 0]) == 299:
            raise RuntimeError("injected device failure")
        return real(cache, table, tokens, *a, **kw)

    paged.model = _Proxy(model, prefill_chunk=failing)
    ok = _submit(paged, "ok", [7, 8, 9], _greedy(6))
    bad = _submit(paged, "bad", [299] + [5] * (CHUNK + 3), _greedy(6))
    last = _collect(bad)[-1]
    assert last.finish_reason == "error" and "injected device failure" in last.error
    assert _ids(_collect(ok)) == llm.generate([7, 8, 9], _greedy(6))[0].token_ids
    assert paged.pages_in_use == 0


class _Proxy:
    """The model with some methods replaced (the model fixture is shared, so it is not patched)."""

    def __init__(self, model, **methods):
        self._model, self._methods = model, methods

    def __getattr__(self, name):
        return self._methods.get(name) or getattr(self._model, name)


def test_stop_fails_prefilling_and_decoding_requests_and_frees_every_page(model):
    b = _paged(model)
    q = _submit(b, "z", [3, 4], _greedy(300))
    q.get(timeout=60)
    q2 = _submit(b, "y", [5] * (20 * CHUNK), _greedy(5))  # 20 chunks: still prefilling at stop()
    b.stop()
    for qq in (q, q2):
        last = _collect(qq)[-1]
        assert last.finish_reason == "error" and "shutting down" in last.error
    assert b.num_running == 0 and b.pages_in_use == 0


# ---------------------------------------------------------------- page budget
def test_a_request_waits_for_pages_then_runs_and_one_that_never_fits_is_rejected(model, llm):
    big, small = -(-(10 + 200) // PAGE), -(-(10 + 40) // PAGE)  # pages of the requests below
    metrics = ServerMetrics()
    b = _paged(model, metrics, num_pages=1 + big + small - 2)  # "first" leaves too few pages for another
    usable = big + small - 2
    try:
        with pytest.raises(KVCapacityError, match=rf"needs {-(-260 // PAGE)} KV pages.*holds only {usable} pages.*"
                                                  r"--num-pages"):
            b.submit(EngineRequest("huge", [3] * 60, _greedy(200), lambda ev: None))
        rng = np.random.default_rng(4)
        p1, p2 = _prompt(rng, 10), _prompt(rng, 10)
        q1 = _submit(b, "first", p1, _greedy(200))
        q1.get(timeout=60)
        q2 = _submit(b, "second", p2, _greedy(40))
        q3 = _submit(b, "third", p2, _greedy(40))
        for _ in range(3):  # three more decode iterations of "first": admission has tried (and failed) each time
            q1.get(timeout=60)
        assert b.num_waiting == 2 and b.num_running == 1  # queued, not failed
        assert _metric(metrics, "jkv_kv_pages_in_use") == big
        assert _metric(metrics, "jkv_kv_pages_free") == small - 2
        assert _metric(metrics, "jkv_kv_device_bytes_in_use") > 0
        b.cancel("second")  # the head of the queue, which has tried and failed to reserve its pages
        assert _collect(q2)[-1].finish_reason == "cancelled"
        b.cancel("first")
        assert _collect(q1)[-1].finish_reason == "cancelled"
        assert _ids(_collect(q3)) == llm.generate(p2, _greedy(40))[0].token_ids  # admitted once pages came back
    finally:
        b.stop()
    assert b.kv.requests == [], "a failed reservation left an entry in the cache"
    assert b.pages_in_use == 0 and _metric(metrics, "jkv_kv_pages_in_use") == 0
    assert _metric(metrics, "jkv_kv_device_bytes_in_use") == 0


def test_page_gauges_rise_during_a_request_and_fall_after(model):
    metrics = ServerMetrics()
    b = _paged(model, metrics)
    seen = []
    done = threading.Event()

    def emit(ev):
        seen.append(_metric(metrics, "jkv_kv_pages_in_use"))
        if ev.finish_reason is not None:
            done.set()

    try:
        assert _metric(metrics, "jkv_kv_pages_in_use") == 0
        free0 = _metric(metrics, "jkv_kv_pages_free")
        b.submit(EngineRequest("g", [3] * 20, _greedy(12), emit))
        assert done.wait(60)
        assert seen[0] == -(-(20 + 12) // PAGE) and seen[-1] == 0 and _metric(metrics, "jkv_kv_pages_in_use") == 0
        assert _metric(metrics, "jkv_kv_pages_free") == free0
    finally:
        b.stop()


def _metric(metrics, name):
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} is not on /metrics")
