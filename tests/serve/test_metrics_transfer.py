"""Transfer histograms on `/metrics` ([compose] item 5): a running `jkv serve --role all
--disaggregation smartgen` scraped after a request shows queueing and wire time per transport
operation, the on-demand fetch round trip, KV bytes per path and codec, and the compression choice
per request, each with non-zero counts; and the decode worker's device pages (sized by --num-pages)
with the host->device KV bytes by cause; its local prefill worker's own prefix cache after a
two-turn conversation. (Encode/decode seconds need a compressed request, which this
server's flags cannot ask for yet: `test_codec_seconds_and_choice_reach_the_histograms` covers them.)"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerProcess
from jkv.disagg import protocol as proto
from jkv.disagg.cluster import PrefillCacheStats
from jkv.serving.metrics import KV_PATHS, ServerMetrics
from transport import OpTimeout

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def count(scraped, name: str, **labels) -> float:
    return sum(v for (n, lab), v in scraped.items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


def test_role_all_smartgen_exposes_transfer_histograms(tiny_dir, cache_env):
    s = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0",
                       "--selector", "streamingllm", "--strategy", "sequential", "--kr-fraction", "0.3",
                       "--disaggregation", "smartgen", "--num-prefill-workers", "1", "--bandwidth", "1gbit",
                       "--max-model-len", "512", "--num-pages", "300", "--enable-prefix-caching", "true"],
                      env=cache_env)
    try:
        r = httpx.post(s.url + "/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=8,
                                                             temperature=0, ignore_eos=True), timeout=120)
        assert r.status_code == 200, r.text
        m = samples(s.url)
        for kind in ("call", "notify"):  # fetch / free RPCs; "prefill" and "spec" notifications
            assert count(m, "jkv_transfer_queue_seconds_count", role="decode", kind=kind) > 0, kind
            assert count(m, "jkv_transfer_wire_seconds_count", role="decode", kind=kind) > 0, kind
        assert count(m, "jkv_transfer_wire_seconds_sum", role="decode") > 0
        assert count(m, "jkv_kv_fetch_round_trip_seconds_count", role="decode") > 0  # on-demand rows were fetched
        for path in KV_PATHS:  # one observation per request and path (the warm-up request counts too)
            assert count(m, "jkv_kv_request_path_bytes_count", path=path, codec="off") >= 1, path
        assert count(m, "jkv_kv_request_path_bytes_sum", path="proactive") > 0
        assert count(m, "jkv_kv_request_path_bytes_sum", path="on_demand") > 0
        assert count(m, "jkv_compression_choice_total", codec="off", reason="off") >= 1
        # The decode KV lives in device pages sized by --num-pages; what crossed host->device, by cause.
        assert count(m, "jkv_kv_host_to_device_bytes", cause="arrived") > 0  # the proactive blocks
        assert count(m, "jkv_kv_host_to_device_bytes", cause="fetched") > 0  # the on-demand rows
        assert count(m, "jkv_kv_host_to_device_bytes", cause="other") == 0
        assert count(m, "jkv_kv_pages_in_use") == 0 and count(m, "jkv_kv_pages_free") == 299
        _pages_follow_a_request_and_steps_count_their_bytes(s.url)
        _local_prefill_cache_counters_reach_metrics(s.url)
    finally:
        assert s.stop() == 0, "".join(s.log[-30:])


def _pages_follow_a_request_and_steps_count_their_bytes(url):
    """While a long request decodes, its device pages are in use (and its staging is gone once all
    its rows are on the device); after it, every page is free again. Each decode step observed its
    host->device bytes by cause: "other" (no recompute) 0 every step."""
    before = samples(url)
    body = dict(model="tiny", prompt=PROMPT, max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    mid = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if mid is None and line.startswith("data: {"):
                mid = samples(url)  # the request is decoding: 200 tokens take many steps
    used = count(mid, "jkv_kv_pages_in_use")
    assert used >= -(-len(PROMPT.split()) // 16) and count(mid, "jkv_kv_pages_free") == 299 - used
    assert count(mid, "jkv_kv_device_bytes_in_use") > 0
    after = samples(url)
    assert count(after, "jkv_kv_pages_in_use") == 0 and count(after, "jkv_kv_pages_free") == 299
    assert count(after, "jkv_kv_device_bytes_in_use") == 0 and count(after, "jkv_kv_host_bytes_in_use") == 0
    assert count(after, "jkv_kv_host_late_writes_dropped") == 0
    steps = {c: count(after, "jkv_kv_host_to_device_step_bytes_count", cause=c)
             - count(before, "jkv_kv_host_to_device_step_bytes_count", cause=c) for c in ("arrived", "fetched", "other")}
    assert steps["arrived"] == steps["fetched"] == steps["other"] >= 150  # one observation per step and cause
    assert count(after, "jkv_kv_host_to_device_step_bytes_bucket", cause="other", le="0.0") == \
        count(after, "jkv_kv_host_to_device_step_bytes_count", cause="other")
    moved = sum(count(after, "jkv_kv_host_to_device_step_bytes_sum", cause=c) for c in ("arrived", "fetched"))
    assert moved > 0  # the first request's rows crossed in its steps


def _local_prefill_cache_counters_reach_metrics(url):
    """--enable-prefix-caching: the local prefill worker keeps its own prefix cache; after a
    two-turn conversation this server's /metrics shows its hits (tier "prefill") and that its
    prefill computed only the follow-up's tokens after turn 1's full pages."""
    turn1 = [3 + (11 * i) % 300 for i in range(150)]  # 9 full pages of 16 tokens + 6
    turn2 = turn1 + [5 + (13 * i) % 300 for i in range(40)]  # the reply and the next question
    before = samples(url)
    for prompt in (turn1, turn2):
        r = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                                         ignore_eos=True), timeout=120)
        assert r.status_code == 200, r.text
    after = samples(url)
    delta = {k: count(after, k, **lab) - count(before, k, **lab) for k, lab in (
        ("jkv_prefill_computed_tokens_total", {}), ("jkv_prefix_cache_hit_tokens_total", {"tier": "prefill"}))}
    assert delta["jkv_prefix_cache_hit_tokens_total"] == len(turn1) // 16 * 16 > 0
    assert delta["jkv_prefill_computed_tokens_total"] == len(turn1) + len(turn2) - len(turn1) // 16 * 16
    assert count(after, "jkv_prefix_cache_pages", tier="prefill") >= len(turn2) // 16
    assert count(after, "jkv_prefix_cache_evictions_total", tier="prefill") == 0
    assert count(after, "jkv_prefix_cache_hit_tokens_total", tier="device") > 0  # the decode side's own cache


def test_codec_seconds_and_choice_reach_the_histograms():
    metrics = ServerMetrics("all", kv_transfer=True)
    extra = dict(bytes=dict(proactive=1000, speculative=10, on_demand=500, metadata=40),
                 compression="hadamard+kivi4g32+zstd3", compression_reason="greedy", encode_s=0.02, decode_s=0.01)
    metrics.transfers.observe_request(extra)
    metrics.transfers.observe_request(dict(extra, compression_reason="explore"))
    get = metrics.registry.get_sample_value
    codec = extra["compression"]
    assert get("jkv_kv_codec_seconds_count", dict(op="encode", codec=codec)) == 2
    assert get("jkv_kv_codec_seconds_sum", dict(op="decode", codec=codec)) == 0.02
    assert get("jkv_compression_choice_total", dict(codec=codec, reason="greedy")) == 1
    assert get("jkv_compression_choice_total", dict(codec=codec, reason="explore")) == 1
    assert get("jkv_kv_request_path_bytes_sum", dict(role="decode", path="on_demand", codec=codec)) == 1000


def test_the_per_path_choice_reaches_its_counter():
    """jkv.compression.paths: each request counts the codec of every path (push / on_demand / metadata)."""
    metrics = ServerMetrics("all", kv_transfer=True)
    paths = dict(push="identity+tok4g32+zstd3", on_demand="identity+tok4g32+none", metadata="zstd1")
    metrics.transfers.observe_request(dict(compression=paths["push"], compression_reason="fixed",
                                           compression_paths=paths))
    metrics.transfers.observe_request(dict(compression=paths["push"], compression_reason="greedy",
                                           compression_paths=dict(paths, on_demand="none", metadata="none")))
    get = metrics.registry.get_sample_value
    assert get("jkv_compression_path_choice_total", dict(path="push", codec=paths["push"])) == 2
    assert get("jkv_compression_path_choice_total", dict(path="on_demand", codec=paths["on_demand"])) == 1
    assert get("jkv_compression_path_choice_total", dict(path="on_demand", codec="none")) == 1
    assert get("jkv_compression_path_choice_total", dict(path="metadata", codec="zstd1")) == 1


class _Peer:
    def __init__(self, workers, name):
        self.workers, self.name = workers, name

    def call_async(self, method, payload, timeout):
        assert method == "stats" and timeout == 1.0
        return self

    def result(self):
        header = self.workers.answers[self.name]
        if isinstance(header, Exception):
            raise header
        return proto.pack(header)


class _Workers:
    """A decode worker's view of its prefill workers for PrefillCacheStats: `owners` and
    `endpoint.peer(name).call_async("stats")`; answers[name] is the reply (an exception: the call
    fails; absent: the worker is not connected)."""

    def __init__(self, answers):
        self.owners, self.answers, self.endpoint = list(answers), answers, self

    def peer(self, name):
        if name not in self.answers:
            raise KeyError(name)
        return _Peer(self, name)


def _cache(hits, computed, pages=3, evictions=0):
    return dict(prefill_prefix_query_tokens=hits + 16, prefill_prefix_hit_tokens=hits, prefill_computed_tokens=computed,
                prefill_prefix_cached_pages=pages, prefill_prefix_pages_in_use=0, prefill_prefix_evictions=evictions,
                prefill_prefix_budget_tokens=4096)


def test_local_prefill_caches_are_summed_and_a_silent_worker_keeps_its_last_counters():
    """PrefillCacheStats sums the workers' "stats" answers; a worker whose call fails or that is not
    connected counts with its last answer; a role-all server's /metrics shows the sum as tier
    "prefill" next to the device tier, and no prefill tier while no worker has a cache."""
    workers = _Workers({"prefill-0": dict(prefix_cache=_cache(32, 100)),
                        "prefill-1": dict(prefix_cache=_cache(16, 50))})
    read = PrefillCacheStats(workers)
    assert read()["prefill_prefix_hit_tokens"] == 48 and read()["prefill_computed_tokens"] == 150
    workers.answers = {"prefill-0": dict(prefix_cache=_cache(64, 120, evictions=2)), "prefill-1": OpTimeout("slow")}
    s = read()
    assert (s["prefill_prefix_hit_tokens"], s["prefill_computed_tokens"], s["prefill_prefix_evictions"]) == (80, 170, 2)
    del workers.answers["prefill-0"]  # restarting: not connected
    assert read()["prefill_computed_tokens"] == 170
    assert PrefillCacheStats(_Workers({"prefill-0": dict(prefix_cache=None)}))() is None

    device = dict(prefix_cached_pages=5, prefix_evictable_pages=5, prefix_query_tokens=64, prefix_hit_tokens=32,
                  prefix_evictions=1)
    metrics = ServerMetrics("all", kv_transfer=True)
    metrics.watch_prefix_cache(lambda: device, read)
    get = metrics.registry.get_sample_value
    assert get("jkv_prefix_cache_hit_tokens_total", dict(tier="prefill")) == 80
    assert get("jkv_prefix_cache_hit_tokens_total", dict(tier="device")) == 32
    assert get("jkv_prefix_cache_evictions_total", dict(tier="prefill")) == 2
    assert get("jkv_prefix_cache_pages", dict(tier="prefill")) == 6
    assert get("jkv_prefill_computed_tokens_total") == 170
    assert get("jkv_prefix_cache_query_tokens_total") == 64  # the decode side's lookups only
    plain = ServerMetrics("all", kv_transfer=True)
    plain.watch_prefix_cache(lambda: device, PrefillCacheStats(_Workers({"prefill-0": dict(prefix_cache=None)})))
    assert plain.registry.get_sample_value("jkv_prefix_cache_hit_tokens_total", dict(tier="prefill")) is None
    assert plain.registry.get_sample_value("jkv_prefill_computed_tokens_total") is None
