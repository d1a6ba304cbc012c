"""The serialized baseline's measured capacity and whether it sustains a load (experiments/calvo.py).

CALVO's goals are stated "at the highest load the baseline sustains" (§4: Figs. 7, 8 sweep QPS
up to where vLLM + LMCache saturates). A load defined from the *modelled* capacity (1 / mean
modelled service time) left the baseline far from saturation on this box (the cost model is
profiled on the pipelined engine and over-predicts the baseline's real service time), so the
benchmark measures the baseline instead, in the same run as the comparison:

* `probe_baseline`: every request of the workload served back to back, alone, on the serialized
  baseline. Completed requests per second is the baseline's capacity; each request's own
  service time is its interference-free TTFT, the paper's SLO base (§4: "scaling its TTFT
  measured under interference-free conditions with a factor ... {2x, 4x, 8x}").
* `sustain_check`: whether one real-time baseline run kept its queue bounded. Operationally:
  (a) throughput: it finished the run at >= `min_throughput` (0.9) of the offered rate, i.e.
  arrival span / (last completion - first arrival) >= 0.9 (a growing backlog drains after the
  last arrival and stretches the denominator), and (b) no trend: the mean TTFT of the last
  quarter of arrivals is <= `max_trend` (2.0) x that of the first quarter (an unbounded queue
  makes TTFT grow with arrival index; the first quarter starts on an empty queue, hence some
  slack). Both must hold; `highest_sustained_load` is the highest swept load at which every
  seed's baseline run passes.

No threads, no model: pure functions of timings (the caller serves the requests).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

MIN_THROUGHPUT = 0.9
MAX_TREND = 2.0


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


@dataclasses.dataclass(frozen=True)
class SustainCheck:
    """throughput_ratio: arrival span / (last completion - first arrival) (1.0: kept up);
    trend: last-quarter mean TTFT / first-quarter mean TTFT; sustained: both within limits."""

    throughput_ratio: float
    trend: float
    sustained: bool

    def as_row(self) -> dict:
        return {"baseline_throughput_ratio": self.throughput_ratio,
                "baseline_ttft_trend": self.trend, "baseline_sustained": int(self.sustained)}


def sustain_check(arrival_s: Sequence[float], ttft_s: Sequence[float],
                  min_throughput: float = MIN_THROUGHPUT,
                  max_trend: float = MAX_TREND) -> SustainCheck:
    """arrival_s, ttft_s: f[n] per request (same order, any order of arrivals); n >= 8."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    ttft = np.asarray(ttft_s, dtype=np.float64)
    if arrival.shape != ttft.shape or arrival.ndim != 1 or arrival.size < 8:
        raise ValueError(f"need matching 1-D arrivals and TTFTs of >= 8 requests (quarters of "
                         f">= 2), got {arrival.shape} and {ttft.shape}")
    order = np.argsort(arrival, kind="stable")
    arrival, ttft = arrival[order], ttft[order]
    span = arrival[-1] - arrival[0]
    busy = (arrival + ttft).max() - arrival[0]
    ratio = float(span / busy) if busy > 0 else 1.0
    q = arrival.size // 4
    first, last = ttft[:q].mean(), ttft[-q:].mean()
    trend = float(last / first) if first > 0 else float("inf")
    return SustainCheck(ratio, trend, ratio >= min_throughput and trend <= max_trend)


def highest_sustained_load(rows: Sequence[dict], scenario: str,
                           baseline: str = "serialized-fifo") -> float | None:
    """The highest load of `scenario` at which every seed's baseline row has
    baseline_sustained == 1 (None: no swept load qualifies, or no row carries the check)."""
    by_load: dict = {}
    for r in rows:
        if (r["scenario"] == scenario and r["policy"] == baseline
                and r.get("baseline_sustained", "") != ""):
            by_load.setdefault(float(r["load"]), []).append(int(r["baseline_sustained"]))
    ok = [load for load, flags in by_load.items() if flags and all(flags)]
    return max(ok) if ok else None
