"""The serialized baseline's measured capacity and whether it sustains a load (CALVO runs).

CALVO's goals are stated "at the highest load the baseline sustains" (§4: Figs. 7, 8 sweep QPS
up to where vLLM + LMCache saturates). A load defined from the *modelled* capacity (1 / mean
modelled service time) left the baseline far from saturation on this box (the cost model is
profiled on the pipelined engine and over-predicts the baseline's real service time), so the
benchmark measures the baseline instead, in the same run as the comparison:

* `probe_baseline`: every request of the workload served back to back, alone, on the serialized
  baseline. Completed requests per second is the baseline's capacity; each request's own
  service time is its interference-free TTFT, the paper's SLO base (§4: "scaling its TTFT
  measured under interference-free conditions with a factor ... {2x, 4x, 8x}").
* `sustain_check`: whether the baseline kept up with one real-time run at offered rate `qps`.
  "Sustains" is a steady-state notion: a single FIFO server sustains an arrival rate iff its
  utilisation rho = qps * E[S] < 1. The check measures rho *in the run*: the serialized
  baseline serves one request at a time in arrival order, so each request's in-run service time
  is completion - max(arrival, previous completion) (`in_run_service`), and
  `utilisation = qps * mean in-run service` (the probe's capacity may not hold while the run
  is timed; this catches a box that slowed down). A point (all seeds of one load) is sustained
  when its utilisation pooled over seeds is <= `MAX_UTILISATION` (0.97). Why not a queue
  statistic: the earlier rule (completions / arrivals in the window after the first quarter of
  arrivals >= 0.95) cannot tell 0.95 from 1.05 within a few hundred requests — on a simulated
  FIFO server with the full-hit probe's service times, 3 seeds x 192 requests, it passed 87% of
  points at rho 0.95, 56% at 1.0 and 37% at 1.05 (docs/calvo.md); the utilisation test says
  "no" at 1.0 unless the run's service was >= 3% faster than the probe's. Completions /
  arrivals and the TTFT trend (mean TTFT of the last quarter of arrivals / of the first) are
  still reported as diagnostics of how far the queue got.
* `mg1_mean_ttft`: the Pollaczek-Khinchine steady-state mean TTFT of a FIFO server with the
  probe's service times at `qps` (E[S] + qps E[S^2] / (2 (1 - rho))): the baseline's TTFT a run
  would reach if it were long enough; measured / predicted says how far from steady state a
  finite run is (at rho 0.95 the relaxation time is ~1 / (1 - sqrt(rho))^2 ~ 1500 services).

No threads, no model: pure functions of timings (the caller serves the requests).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

MIN_THROUGHPUT = 0.95      # diagnostic only (see the module docstring)
MAX_UTILISATION = 0.97


@dataclasses.dataclass(frozen=True)
class BaselineProbe:
    """capacity_qps: requests completed per second back to back; service_s: each request's
    interference-free TTFT on the baseline (seconds, by request id)."""

    capacity_qps: float
    service_s: dict

    @property
    def mean_service_s(self) -> float:
        return float(np.mean(list(self.service_s.values())))


def probe_baseline(serve: Callable[[object], None], requests: Sequence,
                   request_id: Callable[[object], Hashable] = lambda r: r.request_id,
                   clock: Callable[[], float] = time.monotonic) -> BaselineProbe:
    """Serve `requests` one after another with `serve(request)` (returns once the request's
    first token is out, nothing else running) and time them."""
    if not requests:
        raise ValueError("probe_baseline needs at least one request to time")
    service = {}
    t0 = clock()
    for request in requests:
        start = clock()
        serve(request)
        service[request_id(request)] = clock() - start
    total = clock() - t0
    if total <= 0:
        raise ValueError(f"probe took {total} s for {len(requests)} requests; the clock "
                         "must advance while serving")
    return BaselineProbe(len(requests) / total, service)


def mg1_mean_ttft(service_s: Sequence[float], qps: float) -> float:
    """Steady-state mean TTFT (s) of one FIFO server, Poisson arrivals at `qps`, service times
    drawn from `service_s` (f[n], seconds): Pollaczek-Khinchine, E[S] + qps E[S^2] / (2 (1 -
    rho)) with rho = qps E[S]; inf when rho >= 1 (no steady state)."""
    s = np.asarray(service_s, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or np.any(s < 0) or not qps > 0:
        raise ValueError(f"need >= 1 non-negative service times and qps > 0, got {s.shape} "
                         f"service times and qps={qps}")
    rho = qps * s.mean()
    if rho >= 1:
        return float("inf")
    return float(s.mean() + qps * np.mean(s * s) / (2 * (1 - rho)))


def in_run_service(arrival_s: Sequence[float], ttft_s: Sequence[float]) -> np.ndarray:
    """Service times f[n] (arrival order) of a single FIFO server from its run: request i starts
    at max(its arrival, the previous completion) and completes at arrival + TTFT."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    arrival = arrival[order]
    completion = arrival + np.asarray(ttft_s, dtype=np.float64)[order]
    start = np.maximum(arrival, np.concatenate([[-np.inf], completion[:-1]]))
    return completion - start


def probe_from_rows(request_rows: Sequence[dict], run_rows: Sequence[dict], scenario: str,
                    seed: int, baseline: str = "serialized-fifo") -> BaselineProbe:
    """The probe of an earlier run of (scenario, seed), rebuilt from what it wrote: the
    capacity from calvo.csv (`capacity_measured_qps` of that seed's baseline rows) and each
    request's interference-free TTFT from calvo_requests.csv (`isolated_s`, by request id).
    A later held run can then add a policy to the same paired comparison: same requests,
    same arrivals (QPS = load x the same capacity), same SLOs."""
    caps = {float(r["capacity_measured_qps"]) for r in run_rows
            if r["scenario"] == scenario and int(r["seed"]) == seed and r["policy"] == baseline
            and r.get("capacity_measured_qps", "") != ""}
    if len(caps) != 1:
        raise ValueError(f"need exactly one measured capacity for {scenario} seed {seed} in the "
                         f"earlier rows, found {sorted(caps)}; run the baseline for it first")
    service: dict = {}
    for r in request_rows:
        if r["scenario"] == scenario and int(r["seed"]) == seed and r["policy"] == baseline:
            rid = int(r["request_id"]) if str(r["request_id"]).isdigit() else r["request_id"]
            service.setdefault(rid, float(r["isolated_s"]))
    if not service:
        raise ValueError(f"no {baseline} request rows for {scenario} seed {seed} to reuse")
    return BaselineProbe(caps.pop(), service)


@dataclasses.dataclass(frozen=True)
class SustainCheck:
    """utilisation: offered QPS x mean in-run service time (the run's rho; sustained iff <=
    MAX_UTILISATION). Diagnostics: completed / arrived: requests completing / arriving in the
    window after the first quarter of arrivals up to the last one (throughput_ratio); trend:
    last-quarter mean TTFT / first-quarter mean TTFT."""

    completed: int
    arrived: int
    trend: float
    utilisation: float
    requests: int

    @property
    def throughput_ratio(self) -> float:
        return self.completed / self.arrived

    @property
    def sustained(self) -> bool:
        return self.utilisation <= MAX_UTILISATION

    def as_row(self) -> dict:
        return {"baseline_completed": self.completed, "baseline_arrived": self.arrived,
                "baseline_throughput_ratio": self.throughput_ratio,
                "baseline_ttft_trend": self.trend, "baseline_utilisation": self.utilisation}


def sustain_check(arrival_s: Sequence[float], ttft_s: Sequence[float], qps: float
                  ) -> SustainCheck:
    """arrival_s, ttft_s: f[n] per request of a serialized-FIFO run (same order, any order of
    arrivals), n >= 8; qps: the offered arrival rate the run was generated at."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    ttft = np.asarray(ttft_s, dtype=np.float64)
    if arrival.shape != ttft.shape or arrival.ndim != 1 or arrival.size < 8:
        raise ValueError(f"need matching 1-D arrivals and TTFTs of >= 8 requests (quarters of "
                         f">= 2), got {arrival.shape} and {ttft.shape}")
    if not qps > 0:
        raise ValueError(f"qps must be > 0 (the run's offered arrival rate), got {qps}")
    utilisation = float(qps * in_run_service(arrival, ttft).mean())
    order = np.argsort(arrival, kind="stable")
    arrival, ttft = arrival[order], ttft[order]
    q = arrival.size // 4
    start, end = arrival[q], arrival[-1]
    completion = arrival + ttft
    completed = int(((completion > start) & (completion <= end)).sum())
    arrived = int(((arrival > start) & (arrival <= end)).sum())
    first, last = ttft[:q].mean(), ttft[-q:].mean()
    trend = float(last / first) if first > 0 else float("inf")
    return SustainCheck(completed, max(arrived, 1), trend, utilisation, arrival.size)


def pooled_throughput_ratio(rows: Sequence[dict]) -> float | None:
    """sum(completed) / sum(arrived) over baseline rows carrying the check (None: none do)."""
    rows = [r for r in rows if r.get("baseline_arrived", "") != ""]
    if not rows:
        return None
    return (sum(int(r["baseline_completed"]) for r in rows)
            / sum(int(r["baseline_arrived"]) for r in rows))


def pooled_utilisation(rows: Sequence[dict]) -> float | None:
    """The runs' utilisation pooled over seeds (weighted by requests per run: total offered
    work / total offered time); None when no row carries it (rows from before the check)."""
    rows = [r for r in rows if r.get("baseline_utilisation", "") not in ("", None)]
    if not rows:
        return None
    n = np.array([int(r["count"]) for r in rows], dtype=np.float64)
    return float(np.sum(n * np.array([float(r["baseline_utilisation"]) for r in rows]))
                 / n.sum())


def highest_sustained_load(rows: Sequence[dict], scenario: str,
                           baseline: str = "serialized-fifo") -> float | None:
    """The highest load of `scenario` whose baseline rows' pooled utilisation is <=
    MAX_UTILISATION (None: no swept load qualifies, or no row carries the check)."""
    by_load: dict = {}
    for r in rows:
        if r["scenario"] == scenario and r["policy"] == baseline:
            by_load.setdefault(float(r["load"]), []).append(r)
    return highest_load_within({load: pooled_utilisation(mine) for load, mine in by_load.items()})


def highest_load_within(utilisation_by_load: dict) -> float | None:
    """The highest load whose pooled utilisation is known and <= MAX_UTILISATION (None: none
    is): the one "sustains" rule both the per-seed rows and the summary are read with."""
    ok = [load for load, rho in utilisation_by_load.items()
          if rho is not None and rho <= MAX_UTILISATION]
    return max(ok) if ok else None
