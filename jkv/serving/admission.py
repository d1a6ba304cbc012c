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

L3 reads and admission are two queues, as CALVO's loading and compute stages are (§3.1, §3.2:
each stage's dispatcher takes the highest-priority request that is ready for it). The engine
keeps one L3 read in flight (the link carries one request's pages at a time; a second read would
only share its bandwidth): `next_read` gives the request whose read starts next, the policy's
pick among the waiting requests that still have one to do; once started, the read is never
abandoned for a request that arrives later (its bytes are on the wire: a restart would send them
twice). `pick(ready=...)` gives the request admitted next, the policy's pick among the *ready*
ones: those with nothing to read from L3 and the one whose read has answered. So a short request
is admitted while a long one's prefix crosses the link, under every policy (fifo too: the
oldest ready request, CALVO's FIFO variant); what the policies change is only the order of each
queue. The next read starts when the previous request is admitted, not when its read answers
(the read's pages wait with their request; one read's buffers at a time). Whether a request has
a read to do is decided once, when it is first seen, like its cost: one whose prefix was all in
L1/L2 then and was evicted before its admission recomputes those pages.

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
        self._reads: dict[int, bool] = {}  # id(EngineRequest) -> it has pages to read from L3, while it waits

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

    def needs_read(self, req, remote_tokens) -> bool:
        """Whether `req` has shareable prompt pages beyond L1 and L2 (an L3 read to do), asked once
        per request as its cost is: remote_tokens(req) -> tokens of them."""
        need = self._reads.get(id(req))
        if need is None:
            need = self._reads[id(req)] = remote_tokens(req) > 0
        return need

    def pick(self, waiting, estimate, loaded, now: float, ready=None):
        """The waiting request to admit next, or None when no waiting request is ready. waiting:
        EngineRequests in arrival order; loaded(req): True when its L3 pages have arrived (no load
        left for srpt/lstf); now: the arrival clock; ready(req): False while req waits for its L3
        read (None: every request is ready)."""
        if ready is not None:
            waiting = [r for r in waiting if ready(r)]
            if not waiting:
                return None
        if self.name == "fifo":
            return waiting[0]
        policy = self.policy

        def key(req):
            info = self.info(req, estimate)
            if policy.progress_key is None:
                return policy.key(info)
            return policy.progress_key(info, 0.0 if loaded(req) else float(info.cached_tokens), now)

        return min(waiting, key=key)  # min keeps the first of equal keys: arrival order breaks ties

    def next_read(self, waiting, estimate, needs_read, now: float):
        """The waiting request whose L3 read starts next (the link is free): the policy's pick among
        those with one to do (needs_read(req)), None when none has."""
        want = [r for r in waiting if needs_read(r)]
        return self.pick(want, estimate, lambda r: False, now) if want else None

    def forget(self, req):
        """The request left the queue (admitted, cancelled, failed)."""
        self._infos.pop(id(req), None)
        self._reads.pop(id(req), None)


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
