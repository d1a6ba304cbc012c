"""jkv/scheduling/capacity.py: the baseline's measured capacity, its interference-free TTFTs
and the operational "sustains this load" check (fake clocks and synthetic queues, no model)."""
import numpy as np
import pytest

from jkv.scheduling.capacity import (MAX_UTILISATION, highest_sustained_load,
                                     in_run_service, mg1_mean_ttft, pooled_throughput_ratio,
                                     pooled_utilisation, probe_baseline, sustain_check)


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
    qps = rho / service
    arrivals = np.cumsum(rng.exponential(1 / qps, n))
    ttft = fifo_queue(arrivals, np.full(n, service))
    check = sustain_check(arrivals, ttft, qps)
    assert check.utilisation == pytest.approx(rho)      # qps x the in-run service time
    assert check.arrived == n - 1 - n // 4
    assert check.sustained is sustained
    if sustained:
        assert check.throughput_ratio >= 0.95 and check.trend < 2.0
    else:   # completes ~capacity / arrival rate of what arrives, and TTFT climbs
        assert check.throughput_ratio < 0.9
        assert check.trend > 2.0
    assert check.as_row()["baseline_utilisation"] == check.utilisation


def test_in_run_service_recovers_service_times_of_a_fifo_run():
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.3, 64))
    service = rng.uniform(0.15, 0.55, 64)           # utilisation ~1.2: a queue builds
    ttft = fifo_queue(arrivals, service)
    order = rng.permutation(64)
    assert in_run_service(arrivals[order], ttft[order]) == pytest.approx(service)


def test_sustain_check_is_not_fooled_at_or_past_capacity_where_the_queue_rule_was():
    """Simulated FIFO runs with the benchmark's full-hit service spread, 3 seeds x 144
    requests per point: the old completions/arrivals rule passed a large share of points at
    rho 1.0 and 1.05; the utilisation rule never does, and still passes every point at 0.9."""
    rng = np.random.default_rng(7)
    n = 144
    for rho in (0.9, 1.0, 1.05):
        queue_rule = util_rule = 0
        for _ in range(40):
            rows = []
            for seed in range(3):
                service = rng.uniform(0.15, 0.51, n)       # the probe's requests
                qps = rho / service.mean()                 # load x the probe's capacity
                arrivals = np.cumsum(rng.exponential(1 / qps, n))
                check = sustain_check(arrivals, fifo_queue(arrivals, service), qps)
                rows.append(dict(check.as_row(), count=n))
            queue_rule += pooled_throughput_ratio(rows) >= 0.95
            util_rule += pooled_utilisation(rows) <= MAX_UTILISATION
        if rho < 1:
            assert util_rule == 40
        else:
            assert util_rule == 0 and queue_rule >= 8      # the queue rule is fooled often


def test_mg1_prediction_matches_the_formula_and_a_long_simulated_queue():
    # E[S] = 0.3, E[S^2] = 0.1, qps 2: rho 0.6, T = 0.3 + 2 * 0.1 / (2 * 0.4) = 0.55
    assert mg1_mean_ttft([0.2, 0.4], 2.0) == pytest.approx(0.55)
    assert mg1_mean_ttft([0.2, 0.4], 1 / 0.3) == float("inf")
    rng = np.random.default_rng(5)
    n = 200_000
    service = rng.choice([0.2, 0.4], n)
    arrivals = np.cumsum(rng.exponential(0.5, n))
    assert fifo_queue(arrivals, service)[n // 10:].mean() == pytest.approx(0.55, rel=0.05)
    with pytest.raises(ValueError, match="qps > 0"):
        mg1_mean_ttft([0.2], 0.0)


def test_sustain_check_sorts_by_arrival_and_needs_enough_requests():
    arrivals = np.arange(8.0)
    ttft = np.array([1.0, 1, 1, 1, 1, 1, 9, 9])          # last quarter 9x the first
    shuffled = np.random.default_rng(1).permutation(8)
    check = sustain_check(arrivals[shuffled], ttft[shuffled], qps=1.0)
    assert check.trend == pytest.approx(9.0)
    # window (2, 7]: 5 arrivals; completions at 3, 4, 5, 6 (7 + 9, 8 + 9 are later)
    assert (check.completed, check.arrived) == (4, 5)
    with pytest.raises(ValueError, match=">= 8 requests"):
        sustain_check([0.0, 1.0], [1.0, 1.0], qps=1.0)
    with pytest.raises(ValueError, match="qps must be > 0"):
        sustain_check(arrivals, ttft, qps=0.0)


def test_highest_sustained_load_pools_the_seeds():
    util = {0.7: ((0.70, 48), (0.72, 48)), 0.85: ((0.99, 16), (0.95, 48)),   # pooled 0.96
            0.95: ((0.96, 48), (1.00, 48))}                                 # pooled 0.98
    rows = [dict(scenario="full-hit", load=load, seed=seed, policy="serialized-fifo",
                 baseline_utilisation=rho, count=n, baseline_completed=n, baseline_arrived=n)
            for load, seeds in util.items() for seed, (rho, n) in enumerate(seeds)]
    rows.append(dict(scenario="full-hit", load=0.95, seed=0, policy="sjf"))
    assert pooled_utilisation(rows[2:4]) == pytest.approx((0.99 * 16 + 0.95 * 48) / 64)
    assert pooled_utilisation([dict(count=4)]) is None          # rows from before the check
    assert highest_sustained_load(rows, "full-hit") == 0.85
    assert highest_sustained_load(rows, "mixed-hit") is None
    # the benchmark's summary carries the same pooled ratio and picks the same load
    from jkv.scheduling.report import aggregate, sustained_load
    full = [dict(r, qps=1.0, link="1gbit", mean_s=1.0, p50_s=1.0, p99_s=1.0,
                 slo_attainment=1.0) for r in rows if r["policy"] == "serialized-fifo"]
    assert sustained_load(aggregate(full), "full-hit") == 0.85


def test_probe_from_rows_rebuilds_an_earlier_runs_probe():
    from jkv.scheduling.capacity import probe_from_rows
    runs = [dict(scenario="full-hit", seed=1, policy="serialized-fifo", load=0.9,
                 capacity_measured_qps="2.5"),
            dict(scenario="full-hit", seed=1, policy="serialized-fifo", load=0.95,
                 capacity_measured_qps="2.5"),
            dict(scenario="full-hit", seed=1, policy="sjf", load=0.9, capacity_measured_qps="9")]
    reqs = [dict(scenario="full-hit", seed="1", policy=p, load=load, request_id=str(i),
                 isolated_s=str(0.1 * (i + 1)))
            for p in ("serialized-fifo", "sjf") for load in (0.9, 0.95) for i in range(3)]
    probe = probe_from_rows(reqs, runs, "full-hit", 1)
    assert probe.capacity_qps == 2.5
    assert probe.service_s == pytest.approx({0: 0.1, 1: 0.2, 2: 0.3})
    with pytest.raises(ValueError, match="exactly one measured capacity"):
        probe_from_rows(reqs, runs, "full-hit", 0)
    with pytest.raises(ValueError, match="exactly one measured capacity"):
        probe_from_rows(reqs, runs + [dict(runs[0], load=1.0, capacity_measured_qps="3")],
                        "full-hit", 1)
    with pytest.raises(ValueError, match="no serialized-fifo request rows"):
        probe_from_rows([], runs, "full-hit", 1)
