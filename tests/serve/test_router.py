"""`jkv serve --role router` over two `--role all` upstreams: spreading, health, failure handling."""
import json
import signal
import time

import httpx
import openai
import pytest

from conftest import ServerProcess, metric, wait_idle
from jkv import SamplingParams


@pytest.fixture(scope="module")
def upstream_b(tiny_dir, cache_env):
    # The shared `server`'s flags: the programs this one compiles on first use (JKV_WARMUP=0, conftest.py) then
    # come from the run's XLA cache (tests/conftest.py), where the shared server's warm-up put them.
    s = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", "--max-slots", "6",
                       "--max-model-len", "1024"], env=cache_env)
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def router(server, upstream_b):
    r = ServerProcess(["--role", "router", "--port", "0", "--upstream", server.url, "--upstream", upstream_b.url,
                       "--health-interval", "0.2", "--health-timeout", "0.5"])
    yield r
    assert r.stop() == 0, "".join(r.log[-20:])


@pytest.fixture(scope="module")
def slow_checking_router(server, upstream_b):
    """A second router that checks health only every 60 s: it learns of a dead upstream by connecting."""
    r = ServerProcess(["--role", "router", "--port", "0", "--upstream", server.url, "--upstream", upstream_b.url,
                       "--health-interval", "60"])
    yield r
    assert r.stop() == 0, "".join(r.log[-20:])


def upstream_state(router):
    return {u["url"]: u for u in httpx.get(router.url + "/health").json()["upstreams"]}


def wait_for(cond, timeout=10, what=""):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_requests_spread_across_upstreams_with_correct_output(router, server, upstream_b, tiny_llm,
                                                             slow_checking_router):
    import asyncio

    prompts = [f"the quick brown {i}" for i in range(8)]
    wants = [tiny_llm.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))[0].text for p in prompts]

    async def main():
        ac = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        rs = await asyncio.gather(*(ac.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0,
                                                          extra_body={"ignore_eos": True}) for p in prompts))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == wants
    per = {u: metric(router.url, "jkv_router_upstream_requests_total", {"upstream": u, "outcome": "ok"})
           for u in (server.url, upstream_b.url)}
    assert all(n >= 2 for n in per.values()), per  # least in-flight tokens spreads a burst
    assert sum(per.values()) == 8
    streamed = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0).completions.create(
        model="tiny", prompt=prompts[0], max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == wants[0]
    assert [m.id for m in openai.OpenAI(base_url=router.url + "/v1", api_key="x").models.list().data] == ["tiny"]
    assert wait_idle(upstream_b.url) == (0, 0)


def test_client_disconnect_through_the_router_cancels_upstream(router, server, upstream_b):
    before = sum(metric(u, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"})
                 for u in (server.url, upstream_b.url))
    body = {"model": "tiny", "prompt": "fox", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    wait_for(lambda: sum(metric(u, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"})
                         for u in (server.url, upstream_b.url)) == before + 1, what="upstream cancellation")
    assert wait_idle(upstream_b.url) == (0, 0) and wait_idle(server.url) == (0, 0)
    wait_for(lambda: all(u["inflight_requests"] == 0 for u in upstream_state(router).values()), what="router release")


def test_unhealthy_upstream_is_removed_and_re_added(router, server, upstream_b):
    upstream_b.proc.send_signal(signal.SIGSTOP)  # frozen: /health times out
    try:
        wait_for(lambda: not upstream_state(router)[upstream_b.url]["healthy"], what="B marked unhealthy")
        before = metric(router.url, "jkv_router_upstream_requests_total", {"upstream": server.url})
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        for _ in range(4):
            assert c.completions.create(model="tiny", prompt="fox", max_tokens=3).choices[0].text is not None
        assert metric(router.url, "jkv_router_upstream_requests_total", {"upstream": server.url}) - before == 4
        assert metric(router.url, "jkv_router_upstream_healthy", {"upstream": upstream_b.url}) == 0
    finally:
        upstream_b.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: upstream_state(router)[upstream_b.url]["healthy"], what="B re-added")
    assert wait_idle(upstream_b.url) == (0, 0)


def test_upstream_death_mid_stream_is_an_error_event_and_service_stays_up(router, server, upstream_b):
    body = {"model": "tiny", "prompt": "lazy dog", "max_tokens": 1000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as hc:
        for _ in range(4):  # until the stream lands on B (ties rotate between upstreams)
            with hc.stream("POST", router.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                if upstream_state(router)[upstream_b.url]["inflight_requests"] == 1:
                    upstream_b.proc.send_signal(signal.SIGKILL)
                    rest = [line for line in lines if line.startswith("data:")]
                    break
        else:
            pytest.fail("no stream was routed to upstream B")
    assert rest[-1] != "data: [DONE]"
    err = json.loads(rest[-1][len("data:"):])["error"]
    assert upstream_b.url in err["message"] and "mid-stream" in err["message"]
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
    for _ in range(3):  # B is dead: everything goes to A, no errors
        assert c.completions.create(model="tiny", prompt="fox", max_tokens=3).usage.completion_tokens >= 1
    assert not upstream_state(router)[upstream_b.url]["healthy"]
    assert wait_idle(server.url) == (0, 0)  # the cancelled retries left nothing allocated on A


def test_connection_refused_is_retried_on_another_upstream(slow_checking_router, server, upstream_b):
    r = slow_checking_router
    assert upstream_b.proc.poll() is not None, "runs after the test that kills B"
    assert upstream_state(r)[upstream_b.url]["healthy"]  # no health check since B died
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=30)
    for _ in range(4):  # rotation sends one of these to B first: refused, retried on A, never seen by the client
        assert c.completions.create(model="tiny", prompt="fox", max_tokens=2).usage.completion_tokens >= 1
    assert metric(r.url, "jkv_router_upstream_requests_total", {"upstream": upstream_b.url,
                                                                "outcome": "connect_error"}) == 1
    assert not upstream_state(r)[upstream_b.url]["healthy"]


def test_router_with_no_live_upstream_is_a_clear_503():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = ServerProcess(["--role", "router", "--port", "0", "--upstream", dead, "--health-interval", "0.2"])
    try:
        resp = httpx.post(r.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status_code == 503
        assert "no healthy 'all' upstream" in resp.json()["error"]["message"]
        assert httpx.get(r.url + "/health").status_code == 503
    finally:
        assert r.stop() == 0
