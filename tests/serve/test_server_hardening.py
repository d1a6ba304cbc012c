"""`jkv serve --role all` under large requests (body cap, tokenizing off the event loop), its
readiness endpoint, and log-probabilities / echo in OpenAI's shapes, checked against the model's
own log_softmax."""
import json
import threading
import time

import httpx
import numpy as np
import pytest

from jkv import SamplingParams
from jkv.serving.config import ServeConfig

PROMPT = "the quick brown fox"
LIMIT = ServeConfig().max_request_bytes


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def reference_logprobs(llm, ids):
    """log_softmax of the all-position prefill logits: row i scores token i + 1. f32[len(ids), V]."""
    import jax

    T = 1 << max(4, (len(ids) - 1).bit_length())
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    logits, _ = llm.model.prefill(tokens, np.array([len(ids)], np.int32), all_logits=True)
    return np.asarray(jax.nn.log_softmax(logits[0, :len(ids)].astype(np.float32), -1))


# ----------------------------------------------------------------------------- defect 3: big requests
@pytest.mark.parametrize("field", ["prompt", "ignored", "stop"])
def test_a_body_over_the_limit_is_413_naming_the_limit(live, field):
    big = "x" * (LIMIT + 1)
    body = {"model": "tiny", "prompt": "fox", "max_tokens": 2}
    body[field] = big
    r = post(live.url, "/v1/completions", body)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert str(LIMIT) in err["message"] and "--max-request-bytes" in err["message"], err


def test_a_chunked_body_over_the_limit_is_413(live):
    def chunks():  # no Content-Length: the server has to count
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // (1 << 16) + 1):
            yield b"y" * (1 << 16)
        yield b'", "max_tokens": 2}'

    r = httpx.post(live.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"], r.text


def test_health_answers_while_a_big_allowed_prompt_is_tokenized(live):
    text = "the quick brown fox jumps over the lazy dog 12345 " * (LIMIT // 60)  # ~3.5 MB, under the cap
    done, box = threading.Event(), {}

    def big():
        t0 = time.monotonic()
        box["response"] = post(live.url, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1})
        box["seconds"] = time.monotonic() - t0
        done.set()

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # the body is on the wire and being tokenized
    latencies = []
    while not done.is_set():
        t0 = time.monotonic()
        assert httpx.get(live.url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert box["response"].status_code == 400 and "maximum context length" in box["response"].text
    assert latencies, f"the big request took only {box['seconds']:.2f}s; nothing was measured"
    assert max(latencies) < 2.0, f"/health took {max(latencies):.2f}s during a {box['seconds']:.1f}s request"


# ----------------------------------------------------------------------------- defect 5: readiness
def test_ready_and_health_say_ready(live):
    r = httpx.get(live.url + "/ready", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ready"
    h = httpx.get(live.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["ready"] is True


# ----------------------------------------------------------------------------- defect 7: logprobs, echo
def test_completion_logprobs_match_the_model(live, tiny_llm):
    ids = tiny_llm.tokenizer.encode(PROMPT)
    r = post(live.url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                           "logprobs": 3, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp is not None and len(lp["tokens"]) == len(lp["token_logprobs"]) == 6 == r["usage"]["completion_tokens"]
    assert all(len(top) <= 3 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):  # greedy picks the most likely token
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)
    out = tiny_llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    ref = reference_logprobs(tiny_llm, ids + list(out.token_ids))
    want = [ref[len(ids) - 1 + i, t] for i, t in enumerate(out.token_ids)]
    np.testing.assert_allclose(lp["token_logprobs"], want, atol=1e-4)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_like_lm_eval_asks(live, tiny_llm, max_tokens):
    ids = tiny_llm.tokenizer.encode(PROMPT + " jumps over")
    r = post(live.url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": max_tokens,
                                           "temperature": 0, "logprobs": 1, "echo": True}).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(tiny_llm.tokenizer.decode(ids))
    assert len(lp["token_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference_logprobs(tiny_llm, ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], [ref[i - 1, ids[i]] for i in range(1, len(ids))],
                               atol=1e-4)
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == max_tokens


def test_echo_without_logprobs_prepends_the_prompt(live):
    r = post(live.url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                           "echo": True}).json()
    plain = post(live.url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                               "temperature": 0}).json()
    assert r["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert r["choices"][0]["logprobs"] is None


def test_chat_logprobs_in_openai_shape(live):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "fox"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    r = post(live.url, "/v1/chat/completions", body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)
    assert "".join(e["token"] for e in content) == r["choices"][0]["message"]["content"]
    stream = httpx.post(live.url + "/v1/chat/completions", json=dict(body, stream=True), timeout=120)
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content


def test_streamed_completion_logprobs_equal_the_non_streamed(live):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    whole = post(live.url, "/v1/completions", body).json()["choices"][0]
    r = httpx.post(live.url + "/v1/completions", json=dict(body, stream=True), timeout=120)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in parts) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts if p["logprobs"] for x in p["logprobs"][key]] == whole["logprobs"][key], key


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "fox", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "fox", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprob_requests_are_400_naming_the_field(live, path, body, param):
    r = post(live.url, path, dict(body, model="tiny"))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
