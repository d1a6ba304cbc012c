"""Prometheus metrics for `jkv serve`, one `CollectorRegistry` per server (never the global one).

Every metric here is updated by the code that owns the event (DESIGN.md "Metrics"): the engine
thread observes TTFT / TTST / TBT / e2e and sets the queue, running and slot gauges (the paged
KV cache's page and byte gauges read the cache's counters at scrape time); the HTTP
layer counts requests per role and endpoint; the router counts proxied requests per upstream
and sets upstream health / in-flight gauges. prometheus-client metrics are thread-safe, so
the engine thread and the event loop update them without further locking.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; spans sub-millisecond CPU decode steps to multi-second queued prefills.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """Metrics of one `--role all` server (engine + HTTP front end)."""

    def __init__(self, role: str = "all", kv_transfer: bool = False):
        self.role = role
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("jkv_time_to_first_token_seconds", "arrival -> first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttst = Histogram("jkv_time_to_second_token_seconds",
                              "arrival -> second token (includes any prefill->decode stall)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("jkv_time_between_tokens_seconds",
                             "gap between consecutive tokens after the second (SmartGen's TBT)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jkv_e2e_request_latency_seconds", "arrival -> request finished",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_len = Gauge("jkv_num_requests_waiting", "requests queued for a decode slot", registry=r)
        self.running = Gauge("jkv_num_requests_running", "requests holding a decode slot", registry=r)
        self.slots_allocated = Gauge("jkv_kv_slots_allocated", "decode KV-cache slots in use", registry=r)
        self.slots_total = Gauge("jkv_kv_slots_total", "decode KV-cache slots", registry=r)
        self.finished = Counter("jkv_engine_requests_finished", "engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.generated_tokens = Counter("jkv_generation_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("jkv_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.requests = Counter("jkv_http_requests", "HTTP API requests by role, endpoint and status code",
                                ["role", "endpoint", "status"], registry=r)
        self.kv = DecodeKVMetrics(r) if kv_transfer else None  # the decode side of a disaggregated engine
        self.transfers = TransferHistograms(r, "decode") if kv_transfer else None

    # engine thread
    def set_engine_state(self, waiting: int, running: int, slots: int):
        self.queue_len.set(waiting)
        self.running.set(running)
        self.slots_allocated.set(running)
        self.slots_total.set(slots)

    def watch_kv_cache(self, cache):
        """Page gauges of a paged KV cache, read at scrape time from `cache.pages_in_use`,
        `.pages_free` and `.bytes_in_use` (the `PagedBatcher`, which follows its current cache);
        registered only by a paged engine, so a slot-layout server shows no page counts."""
        r = self.registry
        gauges = (("jkv_kv_pages_in_use", "KV cache pages held by requests (0 when idle: the leak check)",
                   lambda: cache.pages_in_use),
                  ("jkv_kv_pages_free", "KV cache pages free for new requests", lambda: cache.pages_free),
                  ("jkv_kv_device_bytes_in_use", "bytes of device KV memory in the pages held by requests",
                   lambda: cache.bytes_in_use))
        for name, help_, read in gauges:
            Gauge(name, help_, registry=r).set_function(read)
        # Cumulative, by cause (`cache.h2d_bytes`, jkv.kvcache.H2D_CAUSES): a disaggregated decode worker's landing of rows
        # that arrived or were fetched; a paged engine's prefix pages loaded back from L2 / L3 ("fetched").
        g = Gauge("jkv_kv_host_to_device_bytes", "KV bytes copied from host memory into device pages since "
                  "start, by cause", ["cause"], registry=r)
        for cause in cache.h2d_bytes:
            g.labels(cause).set_function(lambda c=cause: cache.h2d_bytes[c])

    def watch_prefix_cache(self, read_stats, read_prefill=None):
        """Prefix-cache metrics of a paged engine, read at scrape time from `read_stats()` (a
        `PagedKVCache.stats()` dict). Registered only when prefix caching is on. Tier "device" is
        L1 (the paged cache's own pages), "host" L2 and "remote" L3 when configured. read_prefill:
        the local prefill workers' own caches (`jkv.disagg.cluster.PrefillCacheStats`; --role all
        --disaggregation), shown as tier "prefill" and jkv_prefill_computed_tokens_total."""
        self.registry.register(_PrefixCacheCollector(read_stats, read_prefill))

    def observe_token(self, token_times: list[float]):
        """token_times[i]: seconds from arrival to token i; called once per new token."""
        n = len(token_times)
        self.generated_tokens.inc()
        if n == 1:
            self.ttft.observe(token_times[0])
        elif n == 2:
            self.ttst.observe(token_times[1])
        else:
            self.tbt.observe(token_times[-1] - token_times[-2])

    def observe_prefill(self, prompt_tokens: int):
        self.prompt_tokens.inc(prompt_tokens)

    def observe_finished(self, reason: str, token_times: list[float]):
        self.finished.labels(reason).inc()
        if token_times:
            self.e2e.observe(token_times[-1])

    # event loop
    def count_request(self, endpoint: str, status: int):
        self.requests.labels(self.role, endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """Counters and gauges of the prefix cache, from one stats read per scrape (so the device
    tiers' hits never exceed queries in one scrape; tier "prefill" counts the prefill workers'
    own lookups, which the query count leaves out)."""

    def __init__(self, read_stats, read_prefill=None):
        self.read_stats, self.read_prefill = read_stats, read_prefill

    def describe(self):
        return []  # the values need a started engine; describe nothing so registration never reads them

    def collect(self):
        stats = self.read_stats()
        prefill = self.read_prefill() if self.read_prefill is not None else None
        hits = {"device": stats["prefix_hit_tokens"]}
        if "prefix_hit_tokens_host" in stats:  # the host tier (L2) is configured
            hits["host"] = stats["prefix_hit_tokens_host"]
        if "prefix_hit_tokens_remote" in stats:  # the remote tier (L3) is configured
            hits["remote"] = stats["prefix_hit_tokens_remote"]
        evictions, cached = {"device": stats["prefix_evictions"]}, {"device": stats["prefix_cached_pages"]}
        if "prefix_host_pages" in stats:
            evictions["host"], cached["host"] = stats["prefix_host_evictions"], stats["prefix_host_pages"]
        out = _prefill_computed(prefill) if prefill else []
        if prefill:  # the local prefill workers' own caches (their lookups are not in the query count)
            hits["prefill"] = prefill["prefill_prefix_hit_tokens"]
            evictions["prefill"] = prefill["prefill_prefix_evictions"]
            cached["prefill"] = prefill["prefill_prefix_cached_pages"]
        out += _tiered_families(stats["prefix_query_tokens"], hits, evictions, cached) + [
            _family(GaugeMetricFamily, "jkv_prefix_cache_evictable_pages", "cached prefix pages no request holds: "
                    "counted as free (jkv_kv_pages_free), evicted least recently used first",
                    stats["prefix_evictable_pages"]),
        ]
        if "prefix_host_pages" in stats:
            out += [_family(CounterMetricFamily, "jkv_prefix_cache_host_writes", "cached prefix pages evicted from "
                            "the device and written to the host tier", stats["prefix_host_writes"]),
                    _family(GaugeMetricFamily, "jkv_prefix_cache_host_bytes", "bytes of KV pages held by the host "
                            "tier", stats["prefix_host_bytes"])]
        if "prefix_l3_errors" in stats:
            out += [_family(CounterMetricFamily, "jkv_prefix_cache_l3_errors", "remote tier (L3) operations that "
                            "failed or timed out, and pages read from it that failed verification: each made "
                            "requests recompute instead of load", stats["prefix_l3_errors"]),
                    _family(CounterMetricFamily, "jkv_prefix_cache_remote_writes", "cached prefix pages written to "
                            "the remote tier (evicted from the device, or of finished requests)",
                            stats["prefix_remote_writes"]),
                    _family(CounterMetricFamily, "jkv_prefix_cache_finished_writes", "pages of finished requests "
                            "queued for the remote tier (cached, and not known to be there): the write-back that "
                            "lets other servers sharing the pool hit them", stats["prefix_finished_writes"]),
                    _family(CounterMetricFamily, "jkv_prefix_cache_remote_lookups", "L3 reads started (one per "
                            "loading chunk whose pages L1 and L2 lack)", stats["prefix_remote_lookups"])]
        if "prefix_writeback_pending_pages" in stats:
            dropped = {"host": stats["prefix_writeback_dropped_host"],
                       "remote": stats["prefix_writeback_dropped_remote"]}
            out += [_family(GaugeMetricFamily, "jkv_prefix_cache_writeback_pending_pages", "evicted and finished "
                            "requests' pages queued for or being written to the host and remote tiers",
                            stats["prefix_writeback_pending_pages"]),
                    _family(CounterMetricFamily, "jkv_prefix_cache_writeback_dropped", "evicted or finished "
                            "requests' pages not written back, by tier: its queue was full, or the remote tier "
                            "unreachable", dropped)]
        return out


def _tiered_families(query_tokens, hits: dict, evictions: dict, cached: dict) -> list:
    """The prefix-cache families every role shows (the prefill role's under tier "prefill")."""
    return [
        _family(CounterMetricFamily, "jkv_prefix_cache_query_tokens", "prompt tokens looked up in the prefix "
                "cache (every full page but the one holding the last prompt token)", query_tokens),
        _family(CounterMetricFamily, "jkv_prefix_cache_hit_tokens", "prompt tokens whose KV came from the prefix "
                "cache instead of prefill, by tier", hits),
        _family(CounterMetricFamily, "jkv_prefix_cache_evictions", "cached prefix pages evicted to make room "
                "for new pages, by tier", evictions),
        _family(GaugeMetricFamily, "jkv_prefix_cache_pages", "KV pages holding a cached prefix (shared by running "
                "requests or kept evictable), by tier", cached),
    ]


def _prefill_computed(s: dict) -> list:
    return [_family(CounterMetricFamily, "jkv_prefill_computed_tokens", "prompt tokens the prefill workers' "
                    "prefills computed (tokens whose KV came from their prefix cache are not)",
                    s["prefill_computed_tokens"])]


def _family(kind, name: str, documentation: str, value):
    """A Counter/GaugeMetricFamily `kind` with one sample: `value`, or {tier: value} (a "tier" label)."""
    if isinstance(value, dict):
        family = kind(name, documentation, labels=["tier"])
        for tier, v in value.items():
            family.add_metric([tier], v)
    else:
        family = kind(name, documentation)
        family.add_metric([], value)
    return family


KV_PATHS = ("proactive", "speculative", "on_demand", "metadata")
_RATIO_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


class KVTransferMetrics:
    """SmartGen KV-transfer metrics (DESIGN.md "Metrics"), on the registry of a decode server (from
    each request's RequestOutput.metrics.extra) or of a prefill server (from its worker's
    per-request byte counts when it frees the request, its lease thread and its RPC failures)."""

    def __init__(self, registry: CollectorRegistry, role: str):
        r = self._registry = registry
        self.bytes = Counter("jkv_kv_transfer_bytes", "KV bytes moved prefill -> decode, by path "
                             "(proactive / speculative / on_demand / metadata)", ["role", "path"], registry=r)
        for path in KV_PATHS:
            self.bytes.labels(role, path)
        self.role = role
        self.failures = Counter("jkv_kv_transfer_failures", "requests or transfers that failed because a peer "
                                "died or answered with an error", ["role"], registry=r)
        self.failures.labels(role)
        self.host_bytes = Gauge("jkv_kv_host_bytes_in_use", "bytes of request KV held in this process' host "
                                "pool (0 when idle: the leak check)", registry=r)
        self.host_requests = Gauge("jkv_kv_host_requests", "requests holding KV in this process' host pool",
                                   registry=r)
        self.late_writes = Gauge("jkv_kv_host_late_writes_dropped", "writes (fetch replies, compressed frames) "
                                 "that arrived for host KV already freed: dropped, never written", registry=r)

    def watch_pool(self, pool):
        """Gauges read the KVBufferPool at scrape time (a decode worker frees a request's staging as
        soon as all its rows are in the device pages, so the bytes fall before it finishes)."""
        self.host_bytes.set_function(lambda: pool.bytes_in_use)
        self.host_requests.set_function(lambda: len(pool.live()))
        self.late_writes.set_function(lambda: pool.late_writes_dropped)

    def add_bytes(self, by_path: dict):
        for path, n in (by_path or {}).items():
            if path in KV_PATHS and n:
                self.bytes.labels(self.role, path).inc(n)

    def failed(self, n: int = 1):
        self.failures.labels(self.role).inc(n)


class DecodeKVMetrics(KVTransferMetrics):
    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry, "decode")
        r = registry
        self.on_demand_ratio = Histogram("jkv_kv_on_demand_ratio", "per request: selected KV entries fetched on "
                                         "demand / all selected (SmartGen §4.2)", buckets=_RATIO_BUCKETS, registry=r)
        self.recomputed = Counter("jkv_kv_recomputed_requests", "requests whose prompt KV was recomputed on the "
                                  "decode side after their prefill worker failed", registry=r)
        self.by_owner = Counter("jkv_decode_requests_by_prefill_worker", "finished requests by the prefill worker "
                                "that owned their KV", ["owner"], registry=r)
        self.batches = Counter("jkv_decode_batches", "groups of requests admitted to the running decode batch",
                               registry=r)
        self.step_h2d = Histogram("jkv_kv_host_to_device_step_bytes", "per decode step: KV bytes copied from "
                                  "host staging into device pages, by cause", ["cause"], buckets=_STEP_BYTES_BUCKETS,
                                  registry=r)

    def watch_steps(self, phases, causes):
        """Observe every decode step of the worker's `phases` (StepPhases: its `on_end` hook, engine
        thread): the step's host->device KV bytes per cause in `causes` ("arrived": pushed blocks and
        "ckv" frames, "fetched": on-demand and lookahead replies, "other": recomputed prompts); a
        step with everything local observes 0 for each."""
        causes = tuple(causes)
        for cause in causes:
            self.step_h2d.labels(cause)

        def observe(step: dict):
            for cause in causes:
                self.step_h2d.labels(cause).observe(step.get(f"h2d_{cause}_bytes_n", 0))
        phases.on_end = observe

    def observe_output(self, extra: dict):
        self.add_bytes(extra.get("bytes"))
        if "on_demand_ratio" in extra:
            self.on_demand_ratio.observe(float(extra["on_demand_ratio"]))
        if extra.get("recomputed"):
            self.recomputed.inc()
        if extra.get("owner"):
            self.by_owner.labels(str(extra["owner"])).inc()


class PrefillMetrics:
    """Metrics of a `--role prefill` server (its SmartGen prefill worker + the small HTTP app)."""

    def __init__(self):
        self.role = "prefill"
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jkv_http_requests", "HTTP API requests by role, endpoint and status code",
                                ["role", "endpoint", "status"], registry=r)
        self.prefilled = Counter("jkv_prefill_requests", "requests handed to this worker by outcome "
                                 "(prefilled / failed)", ["outcome"], registry=r)
        for outcome in ("prefilled", "failed"):
            self.prefilled.labels(outcome)
        self.prompt_tokens = Counter("jkv_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.prefill_time = Histogram("jkv_prefill_batch_seconds", "wall time of one prefill batch",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.freed = Counter("jkv_kv_freed_requests", "requests whose KV this worker freed, by why (decode = the "
                             "decode worker holds everything / finished / cancelled)",
                             ["reason"], registry=r)
        for reason in ("decode", "lease_expired", "failed", "shutdown"):
            self.freed.labels(reason)
        self.expired = Counter("jkv_kv_expired_leases", "requests freed because their lease expired or their "
                               "decode worker disconnected", registry=r)
        self.inflight_tokens = Gauge("jkv_prefill_inflight_tokens", "prompt tokens queued or held here",
                                     registry=r)
        self.inflight_requests = Gauge("jkv_prefill_inflight_requests", "requests queued or holding KV here",
                                       registry=r)
        self.kv = KVTransferMetrics(r, "prefill")
        self.transfers = TransferHistograms(r, "prefill")

    def count_request(self, endpoint: str, status: int):
        self.requests.labels(self.role, endpoint, str(status)).inc()

    def watch_prefix_cache(self, read_stats) -> None:
        """Export the worker's own prefix cache (`PrefillPrefixCache.stats`, read once per scrape)."""
        self.registry.register(_PrefillCacheCollector(read_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefillCacheCollector:
    """The prefill role's prefix cache under the decode role's metric names, tier="prefill", plus
    the prompt tokens its prefills computed (a hit's tokens are not)."""

    def __init__(self, read_stats):
        self.read_stats = read_stats

    def describe(self):
        return []

    def collect(self):
        s = self.read_stats()
        tier = lambda v: {"prefill": v}  # noqa: E731
        return _prefill_computed(s) + _tiered_families(
            s["prefill_prefix_query_tokens"], tier(s["prefill_prefix_hit_tokens"]),
            tier(s["prefill_prefix_evictions"]), tier(s["prefill_prefix_cached_pages"]))


class RouterMetrics:
    """Metrics of a `--role router` process."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jkv_http_requests", "HTTP API requests by role, endpoint and status code",
                                ["role", "endpoint", "status"], registry=r)
        self.proxied = Counter("jkv_router_upstream_requests", "requests sent to each upstream by outcome",
                               ["upstream", "kind", "outcome"], registry=r)
        self.healthy = Gauge("jkv_router_upstream_healthy", "1 if the upstream passed its last health check",
                             ["upstream", "kind"], registry=r)
        self.inflight_tokens = Gauge("jkv_router_upstream_inflight_tokens",
                                     "estimated prompt+max tokens of requests in flight per upstream",
                                     ["upstream", "kind"], registry=r)
        self.ttft = Histogram("jkv_router_time_to_first_byte_seconds", "request -> first upstream response byte",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.routed = Counter("jkv_router_routed", "upstream choices per pool by what decided them: prefix (the "
                              "longest cached prefix), cache_size (a new prefix: the emptiest record), load (least "
                              "in-flight tokens: no prefix to go by, every upstream holds the same, the balance "
                              "threshold, or --routing least-load)", ["kind", "by"], registry=r)
        self.record_chunks = Gauge("jkv_router_prefix_record_chunks", "prefix chunk keys the router remembers "
                                   "sending to each upstream (cache-aware routing)", ["upstream", "kind"], registry=r)
        self.record_evictions = Counter("jkv_router_prefix_record_evictions", "chunk keys dropped from an upstream's "
                                        "record (LRU, --routing-record-chunks)", ["upstream", "kind"], registry=r)

    def count_request(self, endpoint: str, status: int):
        self.requests.labels("router", endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------- transfer histograms ([compose] item 5)
# Kept apart from the metrics above: fed by the transport's transfer observer (Endpoint.observe_transfers,
# any transport thread) and by each finished request's RequestOutput.metrics.extra (engine thread).
_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 32, 2))  # 1 KiB .. 1 GiB, x4
_STEP_BYTES_BUCKETS = (0.0, *_BYTES_BUCKETS)  # 0: a step that moved nothing (everything local)
UNCOMPRESSED_CODEC = "off"  # codec label of a request whose KV moved as plain float32 rows


class TransferHistograms:
    """Histograms of KV movement for one role's registry.

    Per transport operation (write / call / notify / reply) this process started: the time it waited
    behind earlier operations on its connection (queue: submitted -> first byte on the wire) and its
    wire time (first byte -> acknowledged, or the reply landed), and for on-demand "fetch" calls the
    round trip (submitted -> reply landed, SmartGen §4.2). Per finished request (decode side): the bytes
    it moved per path and codec, its encode (prefill side) and decode (here) seconds per codec, and the
    compression choice as counters labelled by pipeline and reason (KVServe §6: greedy / explore /
    fallback; "fixed" for a configured pipeline; codec "off" with compression disabled) and by path
    (the codec each of push / on_demand / metadata used, `jkv.compression.paths`)."""

    def __init__(self, registry: CollectorRegistry, role: str):
        r, self.role = registry, role
        self.queue = Histogram("jkv_transfer_queue_seconds", "transport operation: submitted -> first byte on the "
                               "wire (queueing behind earlier operations)", ["role", "kind"],
                               buckets=_TRANSFER_BUCKETS, registry=r)
        self.wire = Histogram("jkv_transfer_wire_seconds", "transport operation: first byte on the wire -> "
                              "acknowledged or replied", ["role", "kind"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.fetch_round_trip = Histogram("jkv_kv_fetch_round_trip_seconds", "on-demand KV row fetch: request "
                                          "submitted -> reply landed", ["role"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.request_bytes = Histogram("jkv_kv_request_path_bytes", "KV bytes one request moved, by path and codec",
                                       ["role", "path", "codec"], buckets=_BYTES_BUCKETS, registry=r)
        self.codec_time = Histogram("jkv_kv_codec_seconds", "per request: KV encode (prefill side) or decode "
                                    "(decode side) seconds, by codec", ["op", "codec"], buckets=_TRANSFER_BUCKETS,
                                    registry=r)
        self.choice = Counter("jkv_compression_choice", "compression pipeline chosen per request, by reason",
                              ["codec", "reason"], registry=r)
        self.path_choice = Counter("jkv_compression_path_choice", "per request and KV path (push / on_demand / "
                                   "metadata): the codec chosen (jkv.compression.paths)", ["path", "codec"],
                                   registry=r)

    def observe_transfer(self, t) -> None:
        """Endpoint.observe_transfers callback (a transport thread): one finished operation."""
        if t.error is not None or t.started_at is None or t.finished_at is None:
            return
        self.queue.labels(self.role, t.kind).observe(t.started_at - t.created_at)
        self.wire.labels(self.role, t.kind).observe(t.finished_at - t.started_at)
        if t.kind == "call" and t.method == "fetch":
            self.fetch_round_trip.labels(self.role).observe(t.finished_at - t.created_at)

    def observe_request(self, extra: dict) -> None:
        """Engine thread: a finished request's RequestOutput.metrics.extra."""
        codec = extra.get("compression") or UNCOMPRESSED_CODEC
        for path, n in (extra.get("bytes") or {}).items():
            if path in KV_PATHS:
                self.request_bytes.labels(self.role, path, codec).observe(n)
        self.choice.labels(codec, extra.get("compression_reason", "off" if codec == UNCOMPRESSED_CODEC
                                            else "fixed")).inc()
        for path, label in (extra.get("compression_paths") or {}).items():
            self.path_choice.labels(path, label).inc()
        for op in ("encode", "decode"):
            if f"{op}_s" in extra:
                self.codec_time.labels(op, codec).observe(float(extra[f"{op}_s"]))
