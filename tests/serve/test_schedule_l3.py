"""`jkv serve --schedule` with prefixes in L3: the policies order the L3 reads and the admissions as
CALVO's loading and compute stages do (jkv/serving/admission.py).

The L3 is an in-process pool whose reads wait on a gate the test opens, so "a read is in flight"
is a state the test holds, not a race: a request with nothing to read is admitted while another's
read is on the wire (every policy), a read once started is never abandoned and sent again for a
request that arrived later (each page crosses once), and the reads waiting behind it start in the
policy's order (sjf: the smallest load first; fifo: arrival order). The loading stages
(jkv/serving/prefix_loader.py) read a prefix in chunks of up to 8 pages, so a document's reads
are compared as the documents they serve, in order. Pages come back with the tokens they were
computed with."""
import threading
import time

import pytest

from jkv import SamplingParams
from jkv.kvpool import HostKVPool
from jkv.serving.metrics import ServerMetrics
from engine_events import collect, start_paged, submit, token_ids
import test_schedule
from test_prefix_batcher import _idle_and_leak_free, _metric
from test_schedule import COST

model = test_schedule.model  # the module-scoped tiny model fixture

PAGE = 8
MAX_TOKENS = 2
DOC_PAGES = (4, 12, 2)  # D0, D1 (the largest load), D2 (the smallest)
DOCS = [[3 + (d * 53 + 7 * i) % 290 for i in range(pages * PAGE)] for d, pages in enumerate(DOC_PAGES)]
SHORT = [9, 8, 7, 6, 5]  # no full page: nothing to read from L3
TIMEOUT = 60.0  # the L3 op timeout: far above every wait here, so no read gives up while the gate is shut


class GatedPool(HostKVPool):
    """A HostKVPool whose reads wait until `gate` is set; records each read's page digests in order.
    `close` keeps the pages (the seeding engine closes it; the engine under test reads them)."""

    def __init__(self):
        super().__init__(1 << 26)
        self.gate = threading.Event()
        self.reads: list[list[bytes]] = []

    def get_many(self, keys, buffers):
        self.reads.append([k.digest for k in keys])
        self.gate.wait(2 * TIMEOUT)
        return super().get_many(keys, buffers)

    def documents_read(self, b) -> list[tuple[int, int]]:
        """The reads as (document, pages) runs in order, consecutive reads of one document merged;
        asserts that no page was read twice (a read abandoned and sent again would repeat them)."""
        owner = {key: d for d in range(len(DOCS)) for key in b.kv.prompt_keys(_question(d))}
        pages = [key for read in self.reads for key in read]
        assert len(pages) == len(set(pages)), "a page crossed the link twice (a read was abandoned and sent again)"
        runs: list[list[int]] = []
        for key in pages:
            if runs and runs[-1][0] == owner[key]:
                runs[-1][1] += 1
            else:
                runs.append([owner[key], 1])
        return [tuple(r) for r in runs]

    def close(self):
        pass


def _engine(model, pool, monkeypatch, **cfg):
    monkeypatch.setattr("jkv.kvcache.remote_tier.open_remote_pool", lambda *a, **k: pool)
    config = dict(max_slots=2, max_model_len=256, page_size=PAGE, prefill_chunk=32,
                  prefix_cache_l3="jkvpool://in-process", prefix_cache_l3_timeout=TIMEOUT)
    config.update(cfg)
    return start_paged(model, ServerMetrics(), **config)


def _question(d):
    return DOCS[d] + [11, 12, 13 + d]


@pytest.fixture
def seeded(model, monkeypatch):
    """A pool holding every document's pages (computed by an engine too small to keep them: each
    request evicts the one before, the write-back sends them to L3) and their greedy answers."""
    pool = GatedPool()
    pool.gate.set()
    b = _engine(model, pool, monkeypatch, max_slots=1, num_pages=15)
    try:
        answers = {d: token_ids(collect(submit(b, f"seed{d}", _question(d), _sp()))) for d in range(len(DOCS))}
        for k in range(2):  # fillers of 13 pages each: every document's pages leave the device
            collect(submit(b, f"filler{k}", [5 + k] * (12 * PAGE + 3), _sp()))
        assert b.kv.writeback.flush(30)
    finally:
        b.stop()
    pool.reads.clear()
    pool.gate.clear()
    return pool, answers


def _sp():
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def _wait(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("schedule", ["fifo", "sjf", "srpt"])
def test_a_request_with_nothing_to_read_is_admitted_while_another_reads_and_that_read_is_kept(
        model, seeded, monkeypatch, tmp_path, schedule):
    pool, answers = seeded
    COST.save(tmp_path / "cost.json")
    b = _engine(model, pool, monkeypatch, schedule=schedule, cost_model=str(tmp_path / "cost.json"))
    try:
        long_q = submit(b, "long", _question(1), _sp())
        _wait(lambda: pool.reads, "the long request's L3 read did not start")
        short = collect(submit(b, "short", SHORT, _sp()), timeout=30)  # old engine: queued behind the read
        assert short[-1].finish_reason == "length" and not pool.gate.is_set()
        pool.gate.set()
        assert token_ids(collect(long_q)) == answers[1]
        assert pool.documents_read(b) == [(1, DOC_PAGES[1])], "the long request's read was abandoned and sent again"
        assert b.kv.prefix_hits_remote == DOC_PAGES[1] * PAGE
        _idle_and_leak_free(b)
    finally:
        pool.gate.set()
        b.stop()


@pytest.mark.parametrize("schedule, order", [("fifo", (0, 1, 2)), ("sjf", (0, 2, 1)), ("srpt", (0, 2, 1))])
def test_the_reads_behind_one_in_flight_start_in_the_policys_order_and_each_once(
        model, seeded, monkeypatch, tmp_path, schedule, order):
    pool, answers = seeded
    COST.save(tmp_path / "cost.json")
    b = _engine(model, pool, monkeypatch, schedule=schedule, cost_model=str(tmp_path / "cost.json"))
    try:
        queues = {0: submit(b, "d0", _question(0), _sp())}
        _wait(lambda: pool.reads, "the first L3 read did not start")
        queues.update({d: submit(b, f"d{d}", _question(d), _sp()) for d in (1, 2)})
        _wait(lambda: b.num_waiting == 3, "the requests did not queue")
        time.sleep(0.2)  # engine iterations with all three waiting: an old engine would restart reads here
        pool.gate.set()
        for d, q in queues.items():
            assert token_ids(collect(q)) == answers[d], f"document {d}: tokens differ from the computed ones"
        assert pool.documents_read(b) == [(d, DOC_PAGES[d]) for d in order]
        _idle_and_leak_free(b)
        assert _metric(b.metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"}) == sum(DOC_PAGES) * PAGE
    finally:
        pool.gate.set()
        b.stop()
