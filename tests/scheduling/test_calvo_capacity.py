"""experiments/calvo_capacity.py: the baseline's measured capacity, its interference-free TTFTs
and the operational "sustains this load" check (fake clocks and synthetic queues, no model)."""
import numpy as np
import pytest

from experiments.calvo_capacity import (highest_sustained_load, probe_baseline,
                                        sustain_check)


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


@pytest.mark.parametrize("rho, sustained", [(0.5, True), (1.6, False)])
def test_sustain_check_separates_a_bounded_queue_from_a_growing_one(rho, sustained):
    rng = np.random.default_rng(0)
    n, service = 96, 0.3
    arrivals = np.cumsum(rng.exponential(service / rho, n))
    ttft = fifo_queue(arrivals, np.full(n, service))
    check = sustain_check(arrivals, ttft)
    assert check.sustained is sustained
    if sustained:
        assert check.throughput_ratio > 0.95 and check.trend < 2.0
    else:   # backlog grows linearly: drains long after the last arrival, TTFT climbs
        assert check.throughput_ratio < 0.9 and check.trend > 2.0
    assert check.as_row()["baseline_sustained"] == int(sustained)


def test_sustain_check_sorts_by_arrival_and_needs_enough_requests():
    arrivals = np.arange(8.0)
    ttft = np.array([1.0, 1, 1, 1, 1, 1, 9, 9])          # last quarter 9x the first: a trend
    shuffled = np.random.default_rng(1).permutation(8)
    check = sustain_check(arrivals[shuffled], ttft[shuffled])
    assert check.trend == pytest.approx(9.0) and not check.sustained
    with pytest.raises(ValueError, match=">= 8 requests"):
        sustain_check([0.0, 1.0], [1.0, 1.0])


def test_highest_sustained_load_needs_every_seed():
    rows = [dict(scenario="full-hit", load=load, seed=seed, policy="serialized-fifo",
                 baseline_sustained=flag)
            for load, flags in ((0.7, (1, 1)), (0.85, (1, 1)), (0.95, (1, 0)))
            for seed, flag in enumerate(flags)]
    rows.append(dict(scenario="full-hit", load=0.95, seed=0, policy="sjf"))
    assert highest_sustained_load(rows, "full-hit") == 0.85
    assert highest_sustained_load(rows, "mixed-hit") is None
