"""CALVO's loading stages in the PagedBatcher (jkv/serving/prefix_loader.py), with an L3 whose reads wait
on a gate the test opens: while one request's prefix loads, another request is admitted and streams
all its tokens; the loaded request's tokens equal the run without prefix caching; cancelling it
mid-load frees every page and staging row; an L3 that fails mid-load costs a recompute of the rest
only. Finished requests' pages are written back to L3, so a second batcher sharing the pool (the
fake one here, a real redis-server below) hits them with the same tokens."""
import threading

import numpy as np
import pytest

from engine_events import collect, submit
from jkv.kvcache import remote_tier
from jkv.kvpool import HostKVPool
from jkv.scheduling import Stage
from jkv.serving import prefix_loader
from jkv.serving.metrics import ServerMetrics
from tests.kvpool.redis_server import needs_redis_server, running_redis
import test_prefix_batcher
from test_prefix_batcher import PAGE, _answer, _assert_same, _greedy, _idle_and_leak_free, _metric, _prompt, _start

model = test_prefix_batcher.model
reference = test_prefix_batcher.reference

MAX_TOKENS = 8
PROMPT = _prompt(np.random.default_rng(21), 4 * PAGE + 3)  # 4 shareable pages
GATED = "redis://gated.invalid"  # opened by the `l3` fixture's stand-in, never dialled


class GatedPool(HostKVPool):
    """An L3 stand-in: reads wait until `gate` is set (`reading` says one is waiting); after
    `fail_after` reads every read misses, as from a pool that died. Shared by several batchers, so
    closing it keeps its entries."""

    def __init__(self):
        super().__init__(64 << 20)
        self.gate = threading.Event()
        self.gate.set()
        self.reading = threading.Event()
        self.reads = 0
        self.fail_after: int | None = None

    def get_many(self, keys, buffers):
        self.reading.set()
        if not self.gate.wait(60):
            return [None] * len(keys)
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            return [None] * len(keys)
        return super().get_many(keys, buffers)

    def close(self):
        pass


@pytest.fixture
def l3(monkeypatch):
    pool = GatedPool()
    monkeypatch.setattr(remote_tier, "open_remote_pool", lambda url, op_timeout_s, retry_after_s: pool)
    return pool


def _with_l3(model, metrics=None, url=GATED, **kw):
    return _start(model, metrics, prefix_cache_l3=url, prefix_cache_l3_timeout=kw.pop("timeout", 60.0),
                  schedule="fifo", **kw)


def _finish(b):
    _idle_and_leak_free(b)
    assert b.loader.loading == 0 and b.loader.pipeline.slots_in_use() == {"host": 0, "device": 0}
    assert b.kv.writeback.flush(30)
    b.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith(("calvo-", "jkv-prefix-"))], "threads left"


def _seed(model, reference, url=GATED):
    """A first batcher serves PROMPT and finishes: its pages reach L3 through the finished-request
    write-back (nothing is evicted on this pool)."""
    metrics = ServerMetrics()
    a = _with_l3(model, metrics, url)
    try:
        _assert_same(_answer(collect(submit(a, "seed", PROMPT, _greedy(MAX_TOKENS), logprobs=1))),
                     reference(PROMPT, MAX_TOKENS), "the first server")
        assert a.kv.writeback.flush(30)
        assert _metric(metrics, "jkv_prefix_cache_evictions_total", {"tier": "device"}) == 0
        assert _metric(metrics, "jkv_prefix_cache_finished_writes_total") >= 4
        assert _metric(metrics, "jkv_prefix_cache_remote_writes_total") >= 4
        written = _metric(metrics, "jkv_prefix_cache_finished_writes_total")
        collect(submit(a, "again", PROMPT, _greedy(2)))  # all its pages are in L1 and known in L3: none again
        assert a.kv.writeback.flush(30) and _metric(metrics, "jkv_prefix_cache_finished_writes_total") == written
    finally:
        _finish(a)


def _load_behind_the_gate(model, reference, l3):
    """A second batcher, and request X on PROMPT (its 4 pages in L3 only) with its L3 read waiting
    at the closed gate: (batcher, its metrics, X's event queue)."""
    _seed(model, reference)
    metrics = ServerMetrics()
    b = _with_l3(model, metrics)
    l3.gate.clear()
    l3.reading.clear()
    q = submit(b, "X", PROMPT, _greedy(MAX_TOKENS), logprobs=1)
    if not l3.reading.wait(60):
        l3.gate.set()
        _finish(b)
        raise AssertionError("X's prefix never reached the fetch stage")
    return b, metrics, q


def test_while_a_prefix_loads_from_l3_another_request_is_admitted_and_streams_all_its_tokens(model, reference, l3):
    """fifo: before the loading stages the head request's L3 read held the whole queue."""
    b, metrics, loading = _load_behind_the_gate(model, reference, l3)
    try:
        short = _prompt(np.random.default_rng(3), PAGE)  # no shareable page: nothing to load
        got = _answer(collect(submit(b, "R", short, _greedy(24), logprobs=1), timeout=45))
        assert not l3.gate.is_set() and loading.empty(), "R ran only after X's load"
        assert len(got[0]) == 24
        _assert_same(got, reference(short, 24), "the request run during the load")
        assert b.kv.pages_in_use >= 5  # X holds all its pages while it loads (proactive allocation)
        l3.gate.set()
        _assert_same(_answer(collect(loading)), reference(PROMPT, MAX_TOKENS), "the request loaded from L3")
        # X's read took R's whole stream (> AHEAD_MAX_S): the link is now taken one chunk at a time
        assert b.loader.pipeline.depth(Stage.FETCH) == 1
        assert _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"}) == 4 * PAGE
        assert _metric(metrics, "jkv_prefix_cache_load_seconds_count", {"tier": "l3"}) == 1
        assert _metric(metrics, "jkv_prefix_cache_l3_errors_total") == 0
    finally:
        l3.gate.set()
        _finish(b)


def test_cancelling_a_request_mid_load_frees_its_pages_and_staging_rows_and_a_retry_loads_right(
        model, reference, l3, monkeypatch):
    monkeypatch.setattr(prefix_loader, "AHEAD_MAX_S", 30.0)  # every read here counts as fast
    b, metrics, q = _load_behind_the_gate(model, reference, l3)
    try:
        b.cancel("X")
        assert collect(q)[-1].finish_reason == "cancelled"
        assert b.pages_in_use == 0 and b.kv.requests == [] and b.loader.loading == 0  # before the read returns
        b.kv.allocator.check()
        l3.gate.set()  # the abandoned read ends; what it fetched lands nowhere
        _assert_same(_answer(collect(submit(b, "X2", PROMPT, _greedy(MAX_TOKENS), logprobs=1))),
                     reference(PROMPT, MAX_TOKENS), "the retry")
        assert _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"}) == 4 * PAGE
        assert b.loader.pipeline.depth(Stage.FETCH) == 2  # a fast link: the next chunk is fetched ahead
    finally:
        l3.gate.set()
        _finish(b)


def test_an_l3_failing_mid_load_costs_a_recompute_of_the_pages_after_it_only(model, reference, l3, monkeypatch):
    monkeypatch.setattr(prefix_loader, "CHUNK_PAGES", 1)  # one read per page
    _seed(model, reference)
    l3.fail_after = l3.reads + 1  # the first page's read answers, the next ones miss
    metrics = ServerMetrics()
    b = _with_l3(model, metrics)
    try:
        _assert_same(_answer(collect(submit(b, "X", PROMPT, _greedy(MAX_TOKENS), logprobs=1))),
                     reference(PROMPT, MAX_TOKENS), "a load cut short")
        assert _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"}) == PAGE
    finally:
        _finish(b)


@needs_redis_server
def test_a_second_server_sharing_redis_hits_the_prefix_the_first_one_finished(model, reference, tmp_path):
    with running_redis(tmp_path) as redis:
        _seed(model, reference, redis.url)
        metrics = ServerMetrics()
        b = _with_l3(model, metrics, redis.url, timeout=1.0)
        try:
            _assert_same(_answer(collect(submit(b, "X", PROMPT, _greedy(MAX_TOKENS), logprobs=1))),
                         reference(PROMPT, MAX_TOKENS), "the second server")
            assert _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"}) == 4 * PAGE
        finally:
            _finish(b)
