"""Admission order of the paged engine's queue (`jkv serve --schedule`): CALVO's policies in `jkv serve`.

The paged engine admits one waiting request at a time (its pages, and a seat or, when its prefix
sits in L2 or may sit in L3, a place in the loading stages, jkv/serving/prefix_loader.py, whose
queues the same policy orders). Which one comes next is the policy's choice
(jkv/scheduling/policies.py, the same functions the CALVO pipeline's dispatchers use):

    fifo   arrival order (the engine's behaviour before this module)
    sjf    smallest modelled cost T_load + T_comp
    srpt   smallest *remaining* modelled cost (a waiting request has loaded nothing yet; in the
           loading stages the key falls as its pages reach L1)
    edf    earliest deadline (arrival + its SLO; no SLO: last)
    lstf   least slack (deadline - now - remaining cost); hopeless requests behind the feasible ones

Loads never block admission: a request with a prefix to load takes a place in the loading stages
(pages reserved, no seat) and the engine keeps admitting others, so a short request is admitted
while a long one's prefix crosses the link, under every policy; a load once started is never
abandoned for a request that arrives later (its bytes are on the wire). What the policies change
is the order of the admission queue and of each loading stage's queue.

A request's cost comes from where its prompt's shareable pages are when it is first seen
(`PagedKVCache.tier_run`: pages in L1 cost nothing to load, the ones in L2 and the rest of the
shareable prefix when an L3 is configured are loaded, the tail is computed) and the cost model
(jkv/scheduling/cost_model.py: T_load = a * loaded tokens + b, T_comp = c * computed tokens + d).
The estimate is made once per request (CALVO computes its keys "for each incoming request"); a
prefix that is in no tier although L3 is configured is then counted as a load, the optimistic
guess (an L3 lookup per queued request would cost a round trip each).

Cost model: `--cost-model FILE` (CostModel.save's JSON), else a probe of the live engine at
start (jkv/serving/cost_probe.py: a timed prefill chunk and a timed page load). `Refit` then keeps the latest measurements (single-chunk
prefills, L2 loads, L3 reads) and refits the lines every `REFIT_EVERY` new samples, so the order
follows the deployment's real costs.

Threads: everything here runs on the engine thread, except `SchedulingMetrics`' prometheus
objects, which are thread-safe.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math

from jkv.scheduling.cost_model import CostModel, fit_line
from jkv.scheduling.policies import RequestInfo, make_policy

log = logging.getLogger(__name__)

SCHEDULES = ("fifo", "sjf", "srpt", "edf", "lstf")
SLO_HEADER = "x-jkv-slo-ms"
REFIT_EVERY = 8
_WINDOW = 64  # samples kept per line: recent enough to follow a changing link, enough to fit


def check_schedule(name: str) -> str:
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} must be one of {', '.join(SCHEDULES)} (--schedule)")
    return name


def parse_slo_ms(body_value: float | None, header: str | None) -> float | None:
    """The request's TTFT SLO in ms: the body's "slo_ms" field, else the x-jkv-slo-ms header (None:
    none). Raises ValueError naming the header when it is not a positive number."""
    if body_value is not None or header is None:
        return body_value
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise ValueError(f"header {SLO_HEADER}: {header!r} must be a positive number of milliseconds "
                         "(the request's time-to-first-token target)")
    return value


class AdmissionScheduler:
    """Picks the next waiting request to admit (engine thread).

    estimate(req) -> (loaded_tokens, computed_tokens): where the request's prompt is, asked once
    per request. The cost model may be replaced (`cost_model` attribute, e.g. by `Refit`); keys
    made before keep their values, as in the pipeline.
    """

    def __init__(self, name: str, cost_model: CostModel | None):
        self.name = check_schedule(name)
        self.cost_model = cost_model
        self.policy = make_policy(name, cost_model)
        self._infos: dict[int, RequestInfo] = {}  # id(EngineRequest) -> its RequestInfo, while it waits

    def set_cost_model(self, cost_model: CostModel):
        self.cost_model = cost_model
        self.policy = make_policy(self.name, cost_model)

    def info(self, req, estimate) -> RequestInfo:
        info = self._infos.get(id(req))
        if info is None:
            loaded, computed = estimate(req)
            slo = getattr(req, "slo_ms", None)
            deadline = req.arrival + slo / 1000.0 if slo is not None else math.inf
            info = self._infos[id(req)] = RequestInfo(req.request_id, req.arrival, loaded, computed, deadline)
        return info

    def pick(self, waiting, estimate, loaded, now: float):
        """The waiting request to admit next. waiting: EngineRequests in arrival order (at least
        one); loaded(req): True when its prefix has no load left (srpt/lstf); now: the arrival clock."""
        if self.name == "fifo":
            return waiting[0]
        policy = self.policy

        def key(req):
            info = self.info(req, estimate)
            if policy.progress_key is None:
                return policy.key(info)
            return policy.progress_key(info, 0.0 if loaded(req) else float(info.cached_tokens), now)

        return min(waiting, key=key)  # min keeps the first of equal keys: arrival order breaks ties

    def forget(self, req):
        """The request left the queue (admitted, cancelled, failed)."""
        self._infos.pop(id(req), None)


class Refit:
    """Recent measurements and the refitted cost model (engine thread).

    A line is refitted only from samples of at least two distinct sizes; a fit that fails (too few
    distinct sizes) keeps the previous model."""

    def __init__(self, model: CostModel):
        self.model = model
        self.loads = collections.deque(maxlen=_WINDOW)   # (tokens loaded, seconds)
        self.computes = collections.deque(maxlen=_WINDOW)  # (tokens computed, seconds)
        self._new = 0

    def add_load(self, tokens: int, seconds: float) -> CostModel | None:
        self.loads.append((tokens, seconds))
        return self._maybe_refit()

    def add_compute(self, tokens: int, seconds: float) -> CostModel | None:
        self.computes.append((tokens, seconds))
        return self._maybe_refit()

    def _maybe_refit(self) -> CostModel | None:
        """The refitted model every REFIT_EVERY samples (None otherwise, or when neither line has
        samples of two distinct sizes)."""
        self._new += 1
        if self._new < REFIT_EVERY:
            return None
        self._new = 0
        model = refit_lines(self.model, self.loads, self.computes)
        if model is self.model:
            return None
        self.model = model
        log.debug("cost model refitted: %s", model)
        return model


def refit_lines(model: CostModel, loads, computes) -> CostModel:
    """`model` with its load line (a, b) refitted from (tokens, seconds) `loads` and its compute line
    (c, d) from `computes`, each only when it has samples of at least two distinct sizes (else
    kept). Both fitted non-negative: a negative slope or intercept from a few noisy samples would
    order requests by nonsense."""
    fields = {}
    for samples, names, what in ((loads, "ab", "loaded tokens"), (computes, "cd", "computed tokens")):
        if len({n for n, _ in samples}) >= 2:
            n, t = zip(*samples)
            fields.update(zip(names, fit_line(n, t, what, nonneg=True)))
    return dataclasses.replace(model, **fields) if fields else model


class SchedulingMetrics:
    """Loading time per tier (with prefix caching) and queue wait / length per policy, on the
    server's registry."""

    def __init__(self, registry, policy: str, prefix_caching: bool):
        from prometheus_client import Gauge, Histogram

        from .metrics import _LATENCY_BUCKETS

        self.policy = policy
        self.load = None if not prefix_caching else Histogram("jkv_prefix_cache_load_seconds", "time to bring one request's cached prefix pages "
                              "into device pages, by the tier they came from (l2: host, l3: remote read)",
                              ["tier"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.wait = Histogram("jkv_queue_wait_seconds", "arrival -> admission (seat, pages, prefix load "
                              "dispatched), by --schedule policy", ["policy"], buckets=_LATENCY_BUCKETS,
                              registry=registry)
        self.queue = Gauge("jkv_schedule_queue_length", "requests waiting for admission, by --schedule policy",
                           ["policy"], registry=registry)

    def admitted(self, waited_s: float, queue_len: int):
        self.wait.labels(self.policy).observe(waited_s)
        self.queue.labels(self.policy).set(queue_len)

    def loaded(self, tier: str, seconds: float):
        if self.load is not None:
            self.load.labels(tier).observe(seconds)
