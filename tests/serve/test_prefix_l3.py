"""The prefix cache's remote tier (L3, a real redis-server) through the PagedBatcher and through
`jkv serve --role all`: tokens equal the run without prefix caching; pages evicted from the device
(and from a small host tier) come back from Redis (tier "remote" hits); Redis killed or stopped
while requests run costs recompute, a warning and jkv_prefix_cache_l3_errors_total, never a wait
past the op timeout, and L3 hits resume once Redis is back on its port; the write-back leaks no
page and no thread."""
import logging
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from conftest import ServerProcess, metric, wait_idle
from engine_events import collect, submit
from jkv import SamplingParams
from jkv.kvcache import kv_bytes_per_token
from jkv.serving.metrics import ServerMetrics
from tests.kvpool.redis_server import MISSING_REASON, REDIS_SERVER, running_redis
from tests.stop_process import stop_process
import test_prefix_batcher
from test_prefix_batcher import PAGE, _answer, _assert_same, _greedy, _idle_and_leak_free, _metric, _prompt, _start

# the tiny model and the reference engine without prefix caching (module-scoped: this module gets its own)
model = test_prefix_batcher.model
reference = test_prefix_batcher.reference

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=MISSING_REASON)

TIMEOUT = 0.3
MAX_TOKENS = 8
# 12 usable pages; a request of a 4-page system prompt + 2 tokens + 8 generated holds 6, so the third
# distinct system prompt evicts the first one's pages (least recently used first)
POOL = dict(max_slots=2, num_pages=13)
SYSTEMS = [_prompt(np.random.default_rng(7 + s), 4 * PAGE + 3) for s in range(3)]


@pytest.fixture
def redis_server(tmp_path):
    with running_redis(tmp_path) as server:  # resumed first if a failed test left it stopped
        yield server


def _ask(b, reference, tag, system, turn):
    """One request on `system`, checked against the reference; then the write-back is flushed so the
    next admission sees what this one evicted."""
    prompt = SYSTEMS[system] + [5 + turn, 7 + system]
    _assert_same(_answer(collect(submit(b, tag, prompt, _greedy(MAX_TOKENS), logprobs=1))),
                 reference(prompt, MAX_TOKENS), f"{tag}: system {system}, turn {turn}")
    assert b.kv.writeback.flush(30)


def _rounds(b, reference, tag, n=2):
    for turn in range(n):
        for s in range(len(SYSTEMS)):
            _ask(b, reference, f"{tag}{turn}{s}", s, turn)


def _remote_hits(metrics):
    return _metric(metrics, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"})


def _warned(caplog):
    return any(r.levelno == logging.WARNING and "recompute" in r.getMessage() for r in caplog.records)


def _finish(b):
    _idle_and_leak_free(b)
    assert b.kv.writeback.flush(30) and b.kv.writeback.pending_pages == 0
    b.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith(("jkv-prefix-writeback", "jkv-prefix-l3"))]


def test_pages_evicted_from_device_and_host_come_back_from_redis_with_the_same_tokens(model, reference, redis_server):
    metrics = ServerMetrics()
    two_pages = 2 * PAGE * kv_bytes_per_token(model.cfg)  # L2 holds 2 pages: most evicted pages leave it too
    b = _start(model, metrics, prefix_cache_host_bytes=two_pages, prefix_cache_l3=redis_server.url,
               prefix_cache_l3_timeout=TIMEOUT, **POOL)
    try:
        _rounds(b, reference, "t")
        assert _metric(metrics, "jkv_prefix_cache_remote_writes_total") > 0
        assert _metric(metrics, "jkv_prefix_cache_host_writes_total") > 0
        assert _remote_hits(metrics) >= 2 * PAGE, "no page came back from Redis"
        assert _metric(metrics, "jkv_prefix_cache_l3_errors_total") == 0
        assert _metric(metrics, "jkv_prefix_cache_writeback_dropped_total", {"tier": "remote"}) == 0
    finally:
        _finish(b)


def test_redis_killed_or_stopped_mid_run_means_recompute_within_the_op_timeout_then_recovery(
        model, reference, redis_server, caplog):
    metrics = ServerMetrics()
    b = _start(model, metrics, prefix_cache_l3=redis_server.url, prefix_cache_l3_timeout=TIMEOUT, **POOL)
    waits = []  # seconds from each L3 read's start until the engine had its answer (or gave up)
    collect_real = b.kv.remote.collect

    def timed_collect(pre):
        out = collect_real(pre)
        if out is not None and not getattr(pre, "timed", False):
            pre.timed = True
            waits.append(time.monotonic() - (pre.deadline - TIMEOUT))
        return out

    b.kv.remote.collect = timed_collect
    rng = np.random.default_rng(11)

    def run_concurrently_through(outage):
        """Fresh prompts (L3 is asked for every one of them) sent while `outage` happens."""
        prompts = [SYSTEMS[i % 3][:2 * PAGE] + _prompt(rng, 2 * PAGE + 1) for i in range(4)]
        queues = [submit(b, f"o{i}", p, _greedy(MAX_TOKENS), logprobs=1) for i, p in enumerate(prompts[:2])]
        outage()
        queues += [submit(b, f"o{i}", p, _greedy(MAX_TOKENS), logprobs=1) for i, p in enumerate(prompts[2:], 2)]
        cancelled = submit(b, "gone", SYSTEMS[0][:PAGE] + _prompt(rng, 3 * PAGE), _greedy(MAX_TOKENS))
        b.cancel("gone")  # queued, maybe with its L3 read in flight: it ends and holds nothing
        for i, (p, q) in enumerate(zip(prompts, queues)):
            _assert_same(_answer(collect(q)), reference(p, MAX_TOKENS), f"request {i} during the outage")
        assert collect(cancelled)[-1].finish_reason in ("cancelled", "length")
        _idle_and_leak_free(b)

    def recovered(tag):
        """Requests until pages come back from Redis again (it restarted empty or was stopped: the
        tier first waits out its retry pause, then writes evicted pages and reads them back)."""
        before = _remote_hits(metrics)
        deadline = time.monotonic() + 60
        while _remote_hits(metrics) == before:
            assert time.monotonic() < deadline, f"L3 hits did not resume after {tag}"
            _rounds(b, reference, tag, n=1)

    try:
        _rounds(b, reference, "w")
        assert _remote_hits(metrics) > 0 and _metric(metrics, "jkv_prefix_cache_l3_errors_total") == 0
        with caplog.at_level(logging.WARNING, logger="jkv"):
            run_concurrently_through(redis_server.stop)  # killed
        errors = _metric(metrics, "jkv_prefix_cache_l3_errors_total")
        assert errors > 0
        assert _warned(caplog), "no warning about L3"
        redis_server.start()  # the same port, empty
        recovered("the restart")

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jkv"):
            run_concurrently_through(lambda: stop_process(redis_server.proc.pid))  # stopped: answers never come
        assert _metric(metrics, "jkv_prefix_cache_l3_errors_total") > errors
        assert _warned(caplog)  # the tier's own warning is rate-limited (30 s); the pool's says it went away
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        recovered("SIGCONT")
        assert waits and max(waits) < TIMEOUT + 0.5, f"a request waited {max(waits):.2f} s for L3 (timeout {TIMEOUT})"
    finally:
        _finish(b)


def test_l3_through_http_role_all_gives_llm_generate_answers_and_remote_hits(tiny_dir, cache_env, tiny_llm,
                                                                             redis_server):
    """`jkv serve --prefix-cache-l3 redis://...` on a pool of 10 usable pages: three system prompts asked
    twice; the second round's prefixes were evicted from the device, and come back from Redis."""
    server = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", "--max-slots", "2",
                            "--max-model-len", "128", "--num-pages", "11", "--prefix-cache-l3", redis_server.url,
                            "--prefix-cache-l3-timeout", "1"], env=cache_env)
    try:
        # 67 tokens each with the chat template: 4 full pages of 16 and 5 pages with the answer, so the
        # third system prompt evicts the first one's pages
        systems = [f"S{i}: the quick brown fox jumps over the lazy dog; a stitch in time saves nine" for i in range(3)]
        for turn in range(2):
            for system in systems:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {turn}?"}]
                r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=dict(
                    model="tiny", messages=messages, max_tokens=8, temperature=0))
                assert r.status_code == 200, r.text
                want = tiny_llm.generate(messages, SamplingParams(max_tokens=8))[0].text
                assert r.json()["choices"][0]["message"]["content"] == want
                time.sleep(0.2)  # the write-back of what this request evicted
        assert metric(server.url, "jkv_prefix_cache_hit_tokens_total", {"tier": "remote"}) > 0
        assert metric(server.url, "jkv_prefix_cache_l3_errors_total") == 0
        assert wait_idle(server.url) == (0, 0)
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
