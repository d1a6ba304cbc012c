"""`jkv serve --schedule`: CALVO's policies order the paged engine's admission.

The policy picks (pure Python), the engine's order when several requests wait (requests queued before
the engine thread starts, so every one of them waits at the first admission: no timing), greedy
tokens equal for every policy and without prefix caching, the SLO reaching the policy from the
HTTP body field and header, and the errors for a bad --schedule or SLO."""
import argparse
import asyncio
import queue
import types

import httpx
import pytest

from jkv import SamplingParams
from jkv.scheduling import CostModel
from jkv.serving.admission import (REFIT_EVERY, SCHEDULES, SLO_HEADER, AdmissionScheduler, Refit, parse_slo_ms)
from jkv.serving.batcher import BatcherConfig, EngineRequest
from jkv.serving.config import add_serve_arguments, config_from_args
from jkv.serving.metrics import ServerMetrics
from jkv.serving.paged_batcher import PagedBatcher
from jkv.serving.server import create_app
from models import tiny_model

PAGE = 8
CHUNK = 32
COST = CostModel(a=1e-5, b=1e-3, c=1e-4, d=1e-3, deployment="test")


def _req(rid, arrival, n=0, slo_ms=None):
    return types.SimpleNamespace(request_id=rid, arrival=arrival, slo_ms=slo_ms, prompt_token_ids=[0] * n)


def _pick(name, waiting, estimate=lambda r: (0, len(r.prompt_token_ids)), loaded=lambda r: False, now=0.0):
    return AdmissionScheduler(name, COST if name not in ("fifo", "edf") else None).pick(waiting, estimate, loaded, now)


@pytest.mark.parametrize("name", ["sjf", "srpt"])
def test_cost_policies_pick_the_short_request_that_arrived_second(name):
    long, short = _req("long", 0.0, 400), _req("short", 1.0, 20)
    assert _pick(name, [long, short]) is short
    assert _pick("fifo", [long, short]) is long


def test_lstf_picks_the_least_slack_and_puts_a_hopeless_request_behind_a_feasible_one():
    tight, loose = _req("tight", 1.0, 20, slo_ms=2000), _req("loose", 0.0, 20, slo_ms=9000)
    assert _pick("lstf", [loose, tight], now=1.5) is tight
    hopeless = _req("hopeless", 0.0, 20, slo_ms=1000)  # its deadline (1.0 s) passed at now = 1.5
    assert _pick("lstf", [hopeless, loose], now=1.5) is loose
    assert _pick("edf", [hopeless, loose], now=1.5) is hopeless


def test_srpt_counts_a_request_whose_l3_pages_arrived_as_having_no_load_left():
    a, b = _req("a", 0.0, 40), _req("b", 1.0, 40)
    estimate = lambda r: (400, 40) if r is a else (100, 40)  # noqa: E731  a loads more
    assert _pick("srpt", [a, b], estimate) is b
    assert _pick("srpt", [a, b], estimate, loaded=lambda r: r is a) is a
    assert _pick("sjf", [a, b], estimate, loaded=lambda r: r is a) is b  # sjf's key is static


def test_edf_orders_by_deadline_and_requests_without_slo_go_last():
    none, late, soon = _req("none", 0.0), _req("late", 1.0, slo_ms=5000), _req("soon", 2.0, slo_ms=100)
    assert _pick("edf", [none, late, soon]) is soon
    assert _pick("edf", [none, late]) is late


def test_parse_slo_ms_takes_the_body_then_the_header_and_names_a_bad_header():
    assert parse_slo_ms(None, None) is None
    assert parse_slo_ms(250.0, "10") == 250.0
    assert parse_slo_ms(None, "40.5") == 40.5
    for bad in ("soon", "-3", "0", "nan"):
        with pytest.raises(ValueError, match=f"{SLO_HEADER}: '{bad}' must be a positive number"):
            parse_slo_ms(None, bad)


def test_refit_follows_the_measured_lines_and_keeps_the_model_without_two_sizes():
    refit = Refit(COST)
    for i in range(REFIT_EVERY - 1):
        assert refit.add_load(64, 0.5) is None
    assert refit.add_load(64, 0.5) is None  # one size: nothing to fit, the model stays
    for i in range(REFIT_EVERY - 1):
        refit.add_load(16 * (i + 1), 0.002 * 16 * (i + 1) + 0.01)
    model = refit.add_compute(100, 0.2)
    assert model is not None and model.c == COST.c and model.d == COST.d  # compute: one sample, kept
    assert model.a > 1e-4 and model.b >= 0  # the load line moved to the slower measured link


def test_a_bad_schedule_is_refused_by_argparse_and_by_the_config():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(p)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'rr'"):
        p.parse_args(["--schedule", "rr"])
    assert config_from_args(p.parse_args(["--schedule", "edf"])).batcher_config(256).schedule == "edf"
    assert BatcherConfig().schedule == "srpt" == SCHEDULES[2]
    with pytest.raises(ValueError, match="schedule='rr' must be one of fifo, sjf, srpt, edf, lstf"):
        BatcherConfig(schedule="rr")


# ------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=5)


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cost") / "cost.json"
    COST.save(path)
    return str(path)


def _run_queued(model, requests, **cfg):
    """Start a PagedBatcher after queueing `requests` ((rid, prompt, max_tokens, slo_ms)), so they all
    wait at its first admission; returns (request ids in the order of their first event, tokens by id)."""
    config = dict(max_slots=1, max_model_len=256, page_size=PAGE, prefill_chunk=CHUNK)
    config.update(cfg)
    b = PagedBatcher(model, BatcherConfig(**config))
    events = queue.Queue()
    for rid, prompt, max_tokens, slo in requests:
        b.submit(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), events.put,
                               slo_ms=slo))
    b.start()
    order, tokens, done = [], {}, 0
    try:
        while done < len(requests):
            ev = events.get(timeout=120)
            assert ev.error is None, ev.error
            if ev.request_id not in tokens:
                order.append(ev.request_id)
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            done += ev.finish_reason is not None
    finally:
        b.stop()
    assert b.kv.pages_in_use == 0
    return order, tokens


def _prompt(seed, n):
    return [3 + (seed * 37 + 11 * i) % 290 for i in range(n)]


@pytest.mark.parametrize("schedule, first", [("srpt", "short"), ("sjf", "short"), ("fifo", "long")])
def test_srpt_admits_a_short_request_before_a_long_one_that_arrived_first(model, cost_file, schedule, first):
    order, _ = _run_queued(model, [("long", _prompt(1, 160), 4, None), ("short", _prompt(2, 12), 4, None)],
                           schedule=schedule, cost_model=cost_file)
    assert order[0] == first


def test_edf_admits_by_the_slo_deadline(model):
    order, _ = _run_queued(model, [("relaxed", _prompt(1, 20), 3, 60_000.0), ("none", _prompt(2, 20), 3, None),
                                   ("urgent", _prompt(3, 20), 3, 50.0)], schedule="edf")
    assert order == ["urgent", "relaxed", "none"]


def test_greedy_tokens_are_the_same_for_every_policy_and_without_prefix_caching(model, cost_file):
    system = _prompt(7, 48)  # six shared pages
    requests = [(f"r{i}", system + _prompt(10 + i, 5 + 9 * i), 6, 200.0 * (4 - i)) for i in range(4)]
    _, want = _run_queued(model, requests, max_slots=2, enable_prefix_caching=False, schedule="fifo")
    for schedule in SCHEDULES:
        extra = {} if schedule == "srpt" else {"cost_model": cost_file}  # srpt: the start-up probe's model
        _, got = _run_queued(model, requests, max_slots=2, schedule=schedule, **extra)
        assert got == want, f"--schedule {schedule} changed greedy tokens"


def test_the_slo_from_the_body_or_header_reaches_the_engine_and_a_bad_one_gets_400(model):
    b = PagedBatcher(model, BatcherConfig(max_slots=2, max_model_len=256, page_size=PAGE, prefill_chunk=CHUNK,
                                          schedule="edf"))
    seen = []
    submit = b.submit
    b.submit = lambda req: (seen.append(req.slo_ms), submit(req))[1]
    b.start()
    app = create_app(b, "tiny", ServerMetrics())

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"model": "tiny", "prompt": _prompt(4, 10), "max_tokens": 2, "temperature": 0}
            ok_header = await c.post("/v1/completions", json=body, headers={SLO_HEADER: "250"})
            ok_body = await c.post("/v1/completions", json={**body, "slo_ms": 75}, headers={SLO_HEADER: "9"})
            bad_header = await c.post("/v1/completions", json=body, headers={SLO_HEADER: "soon"})
            bad_body = await c.post("/v1/completions", json={**body, "slo_ms": -5})
            return ok_header, ok_body, bad_header, bad_body

    try:
        ok_header, ok_body, bad_header, bad_body = asyncio.run(main())
    finally:
        b.stop()
    assert ok_header.status_code == ok_body.status_code == 200
    assert seen == [250.0, 75.0]
    assert bad_header.status_code == 400 and f"{SLO_HEADER}: 'soon'" in bad_header.json()["error"]["message"]
    assert bad_body.status_code == 400 and bad_body.json()["error"]["param"] == "slo_ms"
