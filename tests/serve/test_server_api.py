"""The OpenAI API of a live `jkv serve --role all` subprocess, driven by the official openai client."""
import asyncio
import time

import httpx
import openai
import pytest

from conftest import metric
from jkv import SamplingParams


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **kw))[0]


def test_completions_greedy_equals_llm_generate_with_usage(live, tiny_llm):
    want = expected(tiny_llm, "the quick brown", 12)
    r = client(live).completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(tiny_llm.encode_prompt("the quick brown"))
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_and_non_stream_equal_llm_generate(live, tiny_llm):
    msgs = [{"role": "user", "content": "JAX compiles"}]
    want = expected(tiny_llm, msgs, 15)
    c = client(live)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=15, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=15, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(tiny_llm.encode_prompt(msgs))


def test_chat_n2_stream_interleaves_choices(live, tiny_llm):
    msgs = [{"role": "user", "content": "fox"}]
    want = expected(tiny_llm, msgs, 8)
    chunks = list(client(live).chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                       n=2, stream=True))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == want.text
        assert mine[-1].finish_reason == want.finish_reason


def test_completion_stream_deltas_concatenate_to_the_full_text(live, tiny_llm):
    want = expected(tiny_llm, "a stitch in time", 30, ignore_eos=True)
    stream = client(live).completions.create(model="tiny", prompt="a stitch in time", max_tokens=30, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len(chunks) > 3  # really streamed, not one blob
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_stop_string_cuts_the_text_in_stream_and_non_stream(live, tiny_llm):
    full = expected(tiny_llm, "the lazy dog", 40, ignore_eos=True).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.find(stop)]
    c = client(live)
    r = c.completions.create(model="tiny", prompt="the lazy dog", max_tokens=40, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="tiny", prompt="the lazy dog", max_tokens=40, temperature=0,
                                       stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == want  # no piece of the stop string leaked


def test_n_choices_seeded_sampling_is_reproducible(live):
    c = client(live)
    kw = dict(model="tiny", prompt="quick", max_tokens=10, temperature=1.0, top_p=0.95, seed=11, n=3,
              extra_body={"ignore_eos": True})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) > 1  # choice i uses seed + i
    assert a.usage.completion_tokens == 30
    chunks = list(c.completions.create(stream=True, **kw))
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(3)]
    assert texts == [ch.text for ch in a.choices]


def test_sixteen_concurrent_streams_are_correct_and_counted(live, tiny_llm):
    prompts = [f"the fox {w} {i}" for i, w in enumerate(["jumps", "runs", "naps", "eats"] * 4)]
    wants = [expected(tiny_llm, p, 6 + i % 5, ignore_eos=True).text for i, p in enumerate(prompts)]
    before = metric(live.url, "jkv_http_requests_total", {"endpoint": "/v1/completions", "status": "200"})
    ttft_before = metric(live.url, "jkv_time_to_first_token_seconds_count")

    async def one(ac, i, p):
        s = await ac.completions.create(model="tiny", prompt=p, max_tokens=6 + i % 5, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in s])

    async def main():
        ac = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*(one(ac, i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == wants  # 16 clients, 6 slots: some queue, all join the running batch
    assert metric(live.url, "jkv_http_requests_total", {"endpoint": "/v1/completions", "status": "200"}) - before == 16
    assert metric(live.url, "jkv_time_to_first_token_seconds_count") - ttft_before == 16


def test_models_health_and_metrics(live):
    models = client(live).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    for name in ("jkv_time_to_second_token_seconds_count", "jkv_time_between_tokens_seconds_count",
                 "jkv_e2e_request_latency_seconds_count", "jkv_kv_slots_total"):
        assert metric(live.url, name) > 0, name


# ------------------------------------------------------------------ errors
def _error(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


def test_over_long_prompt_is_400_naming_both_lengths(live):
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": [5] * 1010, "max_tokens": 20})
    err = _error(r, 400)
    assert "1024" in err["message"] and "1010 in the prompt" in err["message"] and "20 for the" in err["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(live).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 1100}],
                                             max_tokens=4)


def test_unknown_model_is_404(live):
    with pytest.raises(openai.NotFoundError) as e:
        client(live).completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and "gpt-9" in e.value.body["message"]


@pytest.mark.parametrize("body,field", [
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": "many"}, "n"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": [99999], "max_tokens": 2}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a", ""]}, "stop"),
])
def test_invalid_fields_are_400_naming_the_field(live, body, field):
    err = _error(httpx.post(live.url + "/v1/completions", json=body), 400)
    assert err["param"] == field or field in err["message"], err


def test_malformed_json_and_unknown_route(live):
    r = httpx.post(live.url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={"content-type": "application/json"})
    assert "not valid JSON" in _error(r, 400)["message"]
    _error(httpx.get(live.url + "/v1/nothing"), 404)


# -------------------------------------------------------------- disconnect
def test_client_disconnect_mid_stream_cancels_and_frees_the_slot(live):
    cancelled = metric(live.url, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"})
    body = {"model": "tiny", "prompt": "fox", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metric(live.url, "jkv_kv_slots_allocated") == 1
        pages = metric(live.url, "jkv_kv_pages_in_use")
        assert pages > 0 and metric(live.url, "jkv_kv_device_bytes_in_use") > 0
    t0 = time.time()
    while metric(live.url, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"}) == cancelled:
        assert time.time() - t0 < 10, "the request was not cancelled after the client went away"
        time.sleep(0.05)
    assert metric(live.url, "jkv_kv_slots_allocated") == 0  # freed long before its 1000 tokens
    assert metric(live.url, "jkv_kv_pages_in_use") == 0 and metric(live.url, "jkv_kv_device_bytes_in_use") == 0
    assert metric(live.url, "jkv_kv_pages_free") >= pages


def test_client_disconnect_non_streaming_cancels(live):
    cancelled = metric(live.url, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"})
    body = {"model": "tiny", "prompt": "fox", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "n": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    t0 = time.time()
    while metric(live.url, "jkv_engine_requests_finished_total", {"finish_reason": "cancelled"}) < cancelled + 8:
        assert time.time() - t0 < 10, "the request was not cancelled after the client went away"
        time.sleep(0.05)
