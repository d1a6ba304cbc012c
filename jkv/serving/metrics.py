"""Prometheus metrics for `jkv serve`, one `CollectorRegistry` per server (never the global one).

Every metric here is updated by the code that owns the event (DESIGN.md "Metrics"): the engine
thread observes TTFT / TTST / TBT / e2e and sets the queue, running and slot gauges; the HTTP
layer counts requests per role and endpoint; the router counts proxied requests per upstream
and sets upstream health / in-flight gauges. prometheus-client metrics are thread-safe, so
the engine thread and the event loop update them without further locking.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; spans sub-millisecond CPU decode steps to multi-second queued prefills.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """Metrics of one `--role all` server (engine + HTTP front end)."""

    def __init__(self, role: str = "all"):
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

    # engine thread
    def set_engine_state(self, waiting: int, running: int, slots: int):
        self.queue_len.set(waiting)
        self.running.set(running)
        self.slots_allocated.set(running)
        self.slots_total.set(slots)

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

    def count_request(self, endpoint: str, status: int):
        self.requests.labels("router", endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
