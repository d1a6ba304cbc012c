"""Router selection bookkeeping (pure Python, no servers)."""
import pytest

from jkv.serving.metrics import RouterMetrics
from jkv.serving.router import NoUpstreamError, Router, Upstream, estimate_tokens, health_verdict


def make(n=3, kinds=None):
    ups = [Upstream(f"http://h{i}:1/", (kinds or ["all"] * n)[i], order=i) for i in range(n)]
    return Router(ups, RouterMetrics()), ups


def test_least_inflight_tokens_wins_then_rotation_breaks_ties():
    r, (a, b, c) = make()
    r.acquire(a, 100)
    r.acquire(b, 10)
    assert r.pick() is c
    r.acquire(c, 50)
    assert r.pick() is b
    r.release(a, 100)
    r.release(b, 10)
    r.release(c, 50)
    assert {r.pick().url for _ in range(3)} == {"http://h0:1", "http://h1:1", "http://h2:1"}


def test_unhealthy_and_excluded_upstreams_are_skipped_and_503_when_none():
    r, (a, b, c) = make()
    r.mark(a, False, "test")
    r.mark(b, False, "test")
    assert r.pick() is c
    with pytest.raises(NoUpstreamError, match="no healthy 'all' upstream.*3 configured"):
        r.pick(exclude={c.url})
    r.mark(a, True)
    assert r.pick(exclude={c.url}) is a
    assert r.metrics.healthy.labels(b.url, "all")._value.get() == 0


def test_kinds_are_separate_pools():
    r, (a, p, d) = make(kinds=["all", "prefill", "decode"])
    assert r.pick("prefill") is p and r.pick("decode") is d and r.pick("all") is a
    with pytest.raises(ValueError, match="kind 'mixed'"):
        Upstream("http://x:1", "mixed")


def test_token_estimate_counts_prompt_bytes_and_max_tokens_times_n():
    assert estimate_tokens({"max_tokens": 10, "n": 3}, raw_len=400) == 100 + 30
    assert estimate_tokens({}, raw_len=40) == 10 + 16
    assert estimate_tokens({"max_tokens": "x"}, raw_len=40) == 10


@pytest.mark.parametrize("status,body,healthy", [
    (200, {"status": "ok"}, True),
    (200, {"status": "degraded", "reason": "no live prefill worker is connected"}, False),
    (503, {"status": "unavailable"}, False),
    (200, ["not", "an", "object"], False),
])
def test_an_upstream_is_healthy_only_when_health_says_ok(status, body, healthy):
    ok, why = health_verdict(status, body)
    assert ok is healthy and bool(why) is not healthy
    if isinstance(body, dict) and body.get("reason"):
        assert body["reason"] in why  # the router's log line says why it dropped the upstream
