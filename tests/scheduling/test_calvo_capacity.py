"""experiments/calvo_capacity.py: the baseline's measured capacity, its interference-free TTFTs
and the operational "sustains this load" check (fake clocks and synthetic queues, no model)."""
import numpy as np
import pytest

from experiments.calvo_capacity import (highest_sustained_load, pooled_throughput_ratio,
                                        probe_baseline, sustain_check)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_probe_times_each_request_and_reports_completions_per_second():
    clock = FakeClock()
    cost = {"a": 0.2, "b": 0.5, "c": 0.3}

    def serve(rid):
        clock.now += cost[rid]

    probe = probe_baseline(serve, list(cost), request_id=lambda r: r, clock=clock)
    assert probe.service_s == pytest.approx(cost)
    assert probe.capacity_qps == pytest.approx(3 / 1.0)
    assert probe.mean_service_s == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="at least one request"):
        probe_baseline(serve, [], clock=clock)


def fifo_queue(arrivals, service):
    """TTFTs of a single FIFO server (the serialized baseline) fed these arrivals."""
    free, ttft = 0.0, []
    for a, s in zip(arrivals, service):
        start = max(a, free)
        free = start + s
        ttft.append(free - a)
    return np.array(ttft)


@pytest.mark.parametrize("rho, sustained", [(0.6, True), (1.4, False)])
def test_sustain_check_separates_a_bounded_queue_from_a_growing_one(rho, sustained):
    rng = np.random.default_rng(0)
    n, service = 96, 0.3
    arrivals = np.cumsum(rng.exponential(service / rho, n))
    ttft = fifo_queue(arrivals, np.full(n, service))
    check = sustain_check(arrivals, ttft)
    assert check.arrived == n - 1 - n // 4
    assert check.sustained is sustained
    if sustained:
        assert check.throughput_ratio >= 0.95 and check.trend < 2.0
    else:   # completes ~capacity / arrival rate of what arrives, and TTFT climbs
        assert check.throughput_ratio < 0.9
        assert check.trend > 2.0
    assert check.as_row()["baseline_completed"] == check.completed


def test_sustain_check_sorts_by_arrival_and_needs_enough_requests():
    arrivals = np.arange(8.0)
    ttft = np.array([1.0, 1, 1, 1, 1, 1, 9, 9])          # last quarter 9x the first
    shuffled = np.random.default_rng(1).permutation(8)
    check = sustain_check(arrivals[shuffled], ttft[shuffled])
    assert check.trend == pytest.approx(9.0)
    # window (2, 7]: 5 arrivals; completions at 3, 4, 5, 6 (7 + 9, 8 + 9 are later)
    assert (check.completed, check.arrived) == (4, 5)
    with pytest.raises(ValueError, match=">= 8 requests"):
        sustain_check([0.0, 1.0], [1.0, 1.0])


def test_highest_sustained_load_pools_the_seeds():
    counts = {0.7: ((48, 48), (47, 48)), 0.85: ((46, 48), (46, 48)),   # pooled 0.958
              0.95: ((48, 48), (40, 48))}                               # pooled 0.917
    rows = [dict(scenario="full-hit", load=load, seed=seed, policy="serialized-fifo",
                 baseline_completed=done, baseline_arrived=came)
            for load, seeds in counts.items() for seed, (done, came) in enumerate(seeds)]
    rows.append(dict(scenario="full-hit", load=0.95, seed=0, policy="sjf"))
    assert pooled_throughput_ratio(rows[:2]) == pytest.approx(95 / 96)
    assert highest_sustained_load(rows, "full-hit") == 0.85
    assert highest_sustained_load(rows, "mixed-hit") is None
    # the benchmark's summary carries the same pooled ratio and picks the same load
    from experiments.calvo_report import aggregate, sustained_load
    full = [dict(r, qps=1.0, link="1gbit", mean_s=1.0, p50_s=1.0, p99_s=1.0,
                 slo_attainment=1.0) for r in rows if r["policy"] == "serialized-fifo"]
    assert sustained_load(aggregate(full), "full-hit") == 0.85
