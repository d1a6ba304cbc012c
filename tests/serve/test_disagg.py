"""Disaggregated serving: `--role prefill` x2 + `jkv decode-worker` + `--role router --prefill --decode`
(SmartGen mode over a paced TCP link), and `--role all --disaggregation smartgen`, all live
subprocesses on loopback driven with the official openai client. After every test no request
KV is left on any role (their /health leak counters)."""
import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from conftest import ServerProcess, health, metric, wait_for as wait_until
from jkv import SamplingParams
from jkv.serving.config import ServeConfig, add_serve_arguments, config_from_args

SECRET = {"JKV_SECRET": "serve-disagg-test-secret"}
# kr 0.3 with sequential order: 70 % of every prompt's KV stays on the prefill worker until it is
# fetched on demand or pushed speculatively, so both lanes and the speculative path move bytes.
TRANSFER = ["--selector", "streamingllm", "--strategy", "sequential", "--kr-fraction", "0.3"]
LINK = "128kbit"  # 16 KB/s after a 64 KB burst: a 1000-token prompt's proactive KV takes seconds
LONG_PROMPT = [3 + (7 * i) % 300 for i in range(1000)]


def start_parallel(*specs):
    """Start several ServerProcess(args, env=..., command=...) at once (JAX start-up dominates)."""
    out, errors = [None] * len(specs), []

    def one(i, kw):
        try:
            out[i] = ServerProcess(**kw)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, kw)) for i, kw in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in out:
            if s is not None:
                s.stop(signal.SIGKILL)
        raise errors[0]
    return out


wait_for = functools.partial(wait_until, timeout=20)  # this file's default wait


class Stack:
    def __init__(self, prefills, decode, router):
        self.prefills, self.decode, self.router = prefills, decode, router

    def live_prefills(self):
        return [p for p in self.prefills if p.proc.poll() is None]

    def leaks(self):
        """(decode KV requests + device pages in use, {prefill url: KV requests}) — all zero when
        nothing leaked."""
        h = health(self.decode.url)
        return (h["kv_host_requests"] + h["kv_pages_in_use"],
                {p.url: health(p.url)["kv_host_requests"] for p in self.live_prefills()})

    def assert_no_leak(self, timeout=15):
        deadline = time.time() + timeout
        while True:
            d, p = self.leaks()
            if d == 0 and not any(p.values()) and metric(self.decode.url, "jkv_kv_slots_allocated") == 0:
                return
            assert time.time() < deadline, f"KV left allocated: decode {d}, prefill {p}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tiny_dir, cache_env):
    env = dict(cache_env, **SECRET)
    common = ["--model", str(tiny_dir), "--port", "0", "--selector", "streamingllm"]
    pa, pb = start_parallel(*[dict(args=["--role", "prefill", *common, "--bandwidth", LINK, "--worker-name", name,
                                         "--lease-s", "60"], env=env) for name in ("prefill-a", "prefill-b")])
    addrs = [health(p.url)["transport_address"] for p in (pa, pb)]
    decode = router = None
    try:
        decode = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", *TRANSFER,
                                "--disaggregation", "smartgen", "--bandwidth", LINK, "--max-slots", "8",
                                "--max-model-len", "1024", "--prefill-worker", addrs[0], "--prefill-worker", addrs[1]],
                               env=env, command="decode-worker")
        router = ServerProcess(["--role", "router", "--port", "0", "--prefill", pa.url, "--prefill", pb.url,
                                "--decode", decode.url, "--health-interval", "0.2", "--health-timeout", "1"])
        yield Stack([pa, pb], decode, router)
    finally:
        for s in (router, decode):
            if s is not None:
                assert s.stop() == 0, "".join(s.log[-30:])
        for p in (pa, pb):
            p.stop()


@pytest.fixture
def live(stack):
    yield stack
    stack.assert_no_leak()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_startup_logs_one_line_per_component(stack):
    decode_log = "".join(stack.decode.log)
    assert "mode disaggregated smartgen (selector streamingllm, strategy sequential, transport tcp" in decode_log
    assert "continuous batching of up to 8 requests" in decode_log and "prefill-a" in decode_log
    prefill_log = "".join(stack.prefills[0].log)
    assert "prefill-worker: prefill-a" in prefill_log and "transport tcp listening on 127.0.0.1:" in prefill_log
    assert "router: disaggregated pool" in "".join(stack.router.log)
    h = health(stack.prefills[0].url)
    assert h["role"] == "prefill" and h["name"] == "prefill-a" and "|" in h["transport_address"]
    assert httpx.post(stack.prefills[0].url + "/v1/completions", json={}).status_code == 404


def test_greedy_output_through_router_equals_llm_generate(live, tiny_llm):
    c = client(live.router.url)
    prompt = "the quick brown fox"
    want = tiny_llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, n=2,
                             extra_body={"ignore_eos": True})
    assert [ch.text for ch in r.choices] == [want.text, want.text]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 48)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 24
    stop = want.text[6:9]  # a stop string inside the greedy output: cut there, not shown
    cut = tiny_llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut.text and r.choices[0].finish_reason == "stop" and stop not in cut.text
    messages = [{"role": "user", "content": "lazy dog"}]
    chat_want = tiny_llm.generate([messages], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    streamed = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == chat_want


def test_requests_spread_across_prefill_instances_and_kv_counters_move(live, tiny_llm):
    pa, pb = live.prefills
    before = {p.url: metric(p.url, "jkv_prefill_requests_total", {"outcome": "prefilled"}) for p in (pa, pb)}
    kv_before = {path: metric(live.decode.url, "jkv_kv_transfer_bytes_total", {"path": path})
                 for path in ("proactive", "on_demand", "speculative")}
    prompts = [f"a stitch in time {i}" for i in range(6)]
    wants = [o.text for o in tiny_llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]

    async def main():
        ac = openai.AsyncOpenAI(base_url=live.router.url + "/v1", api_key="x", max_retries=0, timeout=120)
        rs = await asyncio.gather(*(ac.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                                          extra_body={"ignore_eos": True}) for p in prompts))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == wants
    for i in range(4):  # one at a time: the router alternates between idle prefill instances
        assert client(live.router.url).completions.create(model="tiny", prompt=prompts[i], max_tokens=4,
                                                          temperature=0).choices[0].text is not None
    per = {p.url: metric(p.url, "jkv_prefill_requests_total", {"outcome": "prefilled"}) - before[p.url]
           for p in (pa, pb)}
    assert sum(per.values()) == 10 and min(per.values()) >= 3, per
    assert {"prefill-a", "prefill-b"} <= {
        o for o in ("prefill-a", "prefill-b")
        if metric(live.decode.url, "jkv_decode_requests_by_prefill_worker_total", {"owner": o}) > 0}
    kv = {path: metric(live.decode.url, "jkv_kv_transfer_bytes_total", {"path": path}) - kv_before[path]
          for path in kv_before}
    # proactive and on-demand bytes moved; speculation moved none: these short prompts are within
    # StreamingLLM's budget, so their first decode step fetched every row the proactive push left,
    # and a row the decode side kept is never pushed again (jkv/disagg/served_rows.py)
    assert kv["proactive"] > 0 and kv["on_demand"] > 0 and kv["speculative"] == 0, kv
    assert metric(live.decode.url, "jkv_kv_on_demand_ratio_count") >= 10
    assert 0 < metric(live.decode.url, "jkv_kv_on_demand_ratio_sum") < metric(live.decode.url,
                                                                              "jkv_kv_on_demand_ratio_count")
    pushed = sum(metric(p.url, "jkv_kv_transfer_bytes_total", {"path": "proactive"}) for p in (pa, pb))
    assert pushed > 0
    assert metric(live.decode.url, "jkv_http_requests_total", {"role": "decode", "status": "200"}) >= 10
    assert metric(live.decode.url, "jkv_kv_transfer_failures_total") == 0


def test_prefill_worker_header_chooses_the_kv_owner(live):
    pa, pb = live.prefills
    counts = lambda: [metric(p.url, "jkv_prefill_requests_total", {"outcome": "prefilled"}) for p in (pa, pb)]  # noqa
    before = counts()
    c = openai.OpenAI(base_url=live.decode.url + "/v1", api_key="x", max_retries=0, timeout=60,
                      default_headers={"X-JKV-Prefill-Worker": health(pb.url)["transport_address"]})
    for _ in range(3):  # round robin would give prefill-a some of these
        assert c.completions.create(model="tiny", prompt="fox", max_tokens=2).usage.completion_tokens >= 1
    assert [a - b for a, b in zip(counts(), before)] == [0, 3]


def test_client_disconnect_mid_stream_cancels_and_frees_kv_on_both_roles(live):
    d = live.decode.url
    cancelled = metric(d, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"})
    tokens = metric(d, "jkv_generation_tokens_total")
    body = {"model": "tiny", "prompt": "fox", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.router.url + "/v1/completions", json=body, timeout=60) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    wait_for(lambda: metric(d, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"}) == cancelled + 1,
             what="decode-side cancellation")
    live.assert_no_leak()
    assert metric(d, "jkv_generation_tokens_total") - tokens < 1000  # stopped early, not run to max_tokens


def test_a_request_arriving_mid_decode_joins_the_running_batch(live, tiny_llm):
    """Continuous admission: a short request sent while a long one streams completes (with the
    colocated greedy text) before the long one ends — it was cancelled by our disconnect, not run
    to max_tokens, which a static batch would have done before admitting the short one."""
    d = live.decode.url
    cancelled = metric(d, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"})
    want = tiny_llm.generate("lazy dog", SamplingParams(max_tokens=6, ignore_eos=True))[0].text
    body = {"model": "tiny", "prompt": "fox", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.router.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: dropping the iterator would close the stream (a cancel)
        assert next(line for line in lines if line.startswith("data:"))
        short = client(live.router.url).completions.create(model="tiny", prompt="lazy dog", max_tokens=6,
                                                           temperature=0, extra_body={"ignore_eos": True})
        assert short.choices[0].text == want and short.choices[0].finish_reason == "length"
        assert next(line for line in lines if line.startswith("data:")) != "data: [DONE]"  # still streaming
    wait_for(lambda: metric(d, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"}) == cancelled + 1,
             what="the long request cancelled by the disconnect (it was still decoding)")
    live.assert_no_leak()


def test_bad_input_and_unknown_model_errors_like_role_all(live):
    r = httpx.post(live.router.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5000})
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
    r = httpx.post(live.decode.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_prefill_instance_dying_mid_request_is_an_error_event_and_service_stays_up(live):
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    box = {}

    def consume():
        with httpx.stream("POST", live.router.url + "/v1/completions", json=body, timeout=60) as r:
            box["lines"] = [line for line in r.iter_lines() if line.startswith("data:")]

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: any(health(p.url)["kv_host_requests"] for p in live.prefills), what="the KV held on a prefill")
    victim = next(p for p in live.prefills if health(p.url)["kv_host_requests"])
    survivor = next(p for p in live.prefills if p is not victim)
    victim.proc.send_signal(signal.SIGKILL)  # its proactive writes are still crawling over the paced link
    t.join(60)
    lines = box["lines"]
    assert lines and lines[-1] != "data: [DONE]", lines[-3:]
    err = json.loads(lines[-1][len("data:"):])["error"]
    assert "prefill worker" in err["message"] and "failed" in err["message"], err
    wait_for(lambda: not next(u for u in health(live.router.url)["upstreams"] if u["url"] == victim.url)["healthy"],
             what="router removing the dead prefill instance")
    before = metric(survivor.url, "jkv_prefill_requests_total", {"outcome": "prefilled"})
    c = client(live.router.url)
    for _ in range(3):  # new requests succeed on the surviving prefill instance
        assert c.completions.create(model="tiny", prompt="fox", max_tokens=3).usage.completion_tokens >= 1
    assert metric(survivor.url, "jkv_prefill_requests_total", {"outcome": "prefilled"}) - before == 3
    assert metric(live.decode.url, "jkv_kv_transfer_failures_total") >= 1
    assert health(live.router.url)["status"] == "ok"


@pytest.fixture(scope="module")
def local_disagg(tiny_dir, cache_env):
    """One `--role all --disaggregation smartgen` server with a local prefill worker for the two tests
    below (one process start instead of two): the first sends its request, the second, last in the
    file, kills the worker. --prefill-restarts 0: the killed worker stays dead (restarts:
    tests/serve/test_supervision.py)."""
    s = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", *TRANSFER,
                       "--disaggregation", "smartgen", "--num-prefill-workers", "1", "--bandwidth", "1gbit",
                       "--max-model-len", "512", "--prefill-restarts", "0"], env=cache_env)
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


def test_role_all_with_disaggregation_starts_local_prefill_workers(local_disagg, tiny_llm):
    s = local_disagg
    assert "prefill-worker: local process prefill-0" in "".join(s.log)
    want = tiny_llm.generate("lazy dog", SamplingParams(max_tokens=10, ignore_eos=True))[0].text
    r = client(s.url).completions.create(model="tiny", prompt="lazy dog", max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    assert metric(s.url, "jkv_kv_transfer_bytes_total", {"path": "proactive"}) > 0
    h = health(s.url)
    assert h["mode"] == "smartgen" and h["kv_host_requests"] == 0 and h["prefill_workers"][0]["alive"]


# ----------------------------------------------------------------------------- configuration (no servers)
def parse(argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_disaggregated_flags_and_config_file(tmp_path):
    y = tmp_path / "decode.yaml"
    y.write_text("role: decode\nprefill-worker: ['127.0.0.1:1|127.0.0.1:2']\ndisaggregation: +parallel\n"
                 "strategy: sequential\nkr_fraction: 0.25\nbandwidth: 2gbit\nspec-ratio: 0.2\n")
    cfg = parse(["--config", str(y), "--kr-fraction", "0.5"])
    dis = cfg.disagg
    assert (dis.transfer.mode, dis.transfer.kr_fraction, dis.bandwidth, dis.transfer.spec_ratio, dis.addresses) == (
        "+parallel", 0.5, "2gbit", 0.2, ("127.0.0.1:1|127.0.0.1:2",))
    assert dis.transfer.bandwidth_bps == 2e9 and cfg.uses_disaggregation
    t = tmp_path / "router.toml"
    t.write_text('role = "router"\nprefill = ["http://p:1", "http://p:2"]\ndecode = "http://d:1"\n')
    assert parse(["--config", str(t)]).prefill == ("http://p:1", "http://p:2")
    assert ServeConfig(role="prefill", transport_listen="127.0.0.1:0").transport_listen == "127.0.0.1:0"


@pytest.mark.parametrize("argv,match", [
    (["--role", "decode"], "needs at least one --prefill-worker"),
    (["--role", "router", "--prefill", "http://p:1"], "needs both --prefill URLs"),
    (["--role", "all", "--prefill-worker", "a:1"], "--prefill-worker is only for --role decode"),
    (["--role", "prefill", "--disaggregation", "smartgen"], "--disaggregation is for --role all or decode"),
    (["--role", "all", "--disaggregation", "smartgen"], "needs an importance profile"),
    (["--role", "all", "--disaggregation", "fast", "--strategy", "sequential"], "fast"),
    (["--role", "all", "--disaggregation", "full", "--bandwidth", "lots"], "lots"),
])
def test_bad_disaggregated_options_name_the_value(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(argv)


# ----------------------------------------------------------------------------- hardening (issue 23)
def test_logprobs_on_the_disaggregated_engine_are_a_400_naming_them(live):
    for body in ({"prompt": "fox", "max_tokens": 2, "logprobs": 1},
                 {"prompt": "fox", "max_tokens": 0, "echo": True},
                 {"messages": [{"role": "user", "content": "fox"}], "max_tokens": 2, "logprobs": True}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(live.router.url + path, json=dict(body, model="tiny"), timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "not supported by the disaggregated engine" in err["message"] and err["param"] in (
            "logprobs", "max_tokens"), err


def _state(pid: int) -> str | None:
    """The /proc state letter of `pid` ("Z" for a zombie), None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return None


def test_no_live_prefill_worker_is_unready_and_the_router_stops_routing_there(local_disagg):
    s = local_disagg
    router = None
    try:
        router = ServerProcess(["--role", "router", "--port", "0", "--upstream", s.url, "--health-interval", "0.2"])
        assert httpx.get(s.url + "/ready", timeout=10).status_code == 200 and health(s.url)["status"] == "ok"
        line = next(x for x in s.log if "local process prefill-0 (pid" in x)
        pid = int(line.split("(pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(s.url + "/ready", timeout=10).status_code == 503, what="/ready turning 503")
        h = health(s.url)
        assert h["status"] == "degraded" and not h["ready"] and "no live prefill worker" in h["reason"], h
        wait_for(lambda: _state(pid) is None, timeout=10, what=f"the killed worker (pid {pid}) being reaped")
        wait_for(lambda: not health(router.url)["upstreams"][0]["healthy"], what="the router dropping the upstream")
        assert httpx.get(router.url + "/ready", timeout=10).status_code == 503
        r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "fox", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503, r.text
        assert "exited with code -9" in "".join(s.log)
    finally:
        if router is not None:
            assert router.stop() == 0, "".join(router.log[-30:])


def test_serve_help_says_the_disaggregated_engine_batches_continuously():
    from jkv.serving.launch import add_serve

    sub = argparse.ArgumentParser().add_subparsers()
    add_serve(sub)
    text = " ".join(sub.choices["serve"].format_help().split())
    assert "static batches" not in text and "batches continuously" in text


def test_decode_peer_gone_before_prefill_is_a_warning_not_an_error(tiny_dir, caplog):
    from types import SimpleNamespace

    from jkv.disagg import protocol as proto
    from jkv.disagg.prefill_worker import PrefillWorker
    from jkv.disagg.selectors import build_selector
    from models import load_model

    model = load_model(str(tiny_dir), use_cache=False)
    worker = PrefillWorker(model, build_selector(model, "streamingllm"), "prefill-t", secret=SECRET["JKV_SECRET"])
    caplog.set_level(logging.INFO, logger="jkv")
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        # what the "prefill" notification hook enqueues, from a decode worker that has disconnected since
        worker._jobs.put(SimpleNamespace(peer="decode-gone", payload=proto.pack(
            {"requests": [{"rid": "req-gone-1", "tokens": [1, 2, 3]}]})))
        wait_for(lambda: any("req-gone-1" in r.getMessage() for r in caplog.records), timeout=10,
                 what="the dropped request being logged")
    finally:
        worker.close()
        runner.join(10)
    mine = [r for r in caplog.records if "req-gone-1" in r.getMessage() or "decode-gone" in r.getMessage()]
    assert mine and all(r.levelno == logging.WARNING and r.exc_info is None for r in mine), \
        [(r.levelname, r.getMessage()) for r in mine]
    assert "decode-gone" in mine[0].getMessage()
