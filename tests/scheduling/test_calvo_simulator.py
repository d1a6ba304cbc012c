"""Discrete-event simulator: closed-form single-request times, profiling recovers the cost
model, and the scheduling effects the paper reports appear on a synthetic workload."""
import numpy as np
import pytest

from jkv.scheduling import CostModel, RequestInfo, make_policy
from jkv.scheduling.metrics import summarize
from jkv.scheduling.simulator import (StageTimes, isolated_ttft_s, profile_cost_model,
                                      simulate_pipelined, simulate_serialized)

TIMES = StageTimes(chunk_tokens=100, fetch_s_per_token=1e-4, upload_s_per_token=2e-5,
                   compute_s_per_token=1e-3, compute_overhead_s=0.05)
# per chunk: fetch 10 ms, upload 2 ms


def test_single_request_closed_form():
    info = RequestInfo("r", 1.0, cached_tokens=500, compute_tokens=20)
    (pipelined,) = simulate_pipelined([info], TIMES, make_policy("fifo"))
    (serial,) = simulate_serialized([info], TIMES)
    compute = 0.05 + 20 * 1e-3
    assert pipelined.ttft_s == pytest.approx(5 * 0.010 + 0.002 + compute)   # uploads overlap
    assert serial.ttft_s == pytest.approx(5 * 0.012 + compute)
    assert pipelined.loaded_s - 1.0 == pytest.approx(0.052)
    assert isolated_ttft_s(info, TIMES, pipelined=False) == pytest.approx(serial.ttft_s)


def test_profiling_recovers_the_stage_lines():
    model = profile_cost_model(TIMES, ctx_tokens=[100, 500, 1500, 3000], query_tokens=[1, 50, 400])
    assert model.a == pytest.approx(1e-4) and model.b == pytest.approx(0.002)
    assert model.c == pytest.approx(1e-3) and model.d == pytest.approx(0.05)


def test_paper_motivating_example_sjf_beats_fifo():
    # §2.3.2: R1 (earlier) loads 0.361 s + computes 0.019 s; R2 loads 0.199 s + computes 0.025 s.
    times = StageTimes(chunk_tokens=1, fetch_s_per_token=1e-3, upload_s_per_token=0,
                       compute_s_per_token=1e-3, compute_overhead_s=0)
    r1 = RequestInfo("R1", 0.0, cached_tokens=361, compute_tokens=19)
    r2 = RequestInfo("R2", 0.0, cached_tokens=199, compute_tokens=25)
    model = CostModel(1e-3, 0, 1e-3, 0)
    mean = {name: np.mean([r.ttft_s for r in simulate_serialized_or_pipelined(name, [r1, r2], times,
                                                                              model)])
            for name in ("fifo", "sjf-pt", "sjf")}
    assert mean["fifo"] == pytest.approx(mean["sjf-pt"])
    assert mean["sjf"] < mean["fifo"]


def simulate_serialized_or_pipelined(name, infos, times, model):
    return simulate_pipelined(infos, times, make_policy(name, model), host_slots=1000,
                              device_slots=1000)


def synthetic(num=60, qps=6.0, seed=0, hits=(1.0,)):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / qps, num))
    infos = []
    for i, t in enumerate(arrivals):
        ctx = int(np.exp(rng.uniform(np.log(1000), np.log(16000)))) // 100 * 100
        cached = int(float(rng.choice(hits)) * ctx) // 100 * 100
        query = int(rng.integers(10, 60)) + (ctx - cached)
        infos.append(RequestInfo(i, float(t), cached, query))
    return infos


def test_pipelining_and_sjf_cut_mean_ttft_and_deadline_policies_meet_more_slos():
    infos = synthetic(qps=1.2)   # the network stage (~0.6 s per request) is ~70% busy
    model = profile_cost_model(TIMES, [100, 2000, 8000], [10, 200, 2000])
    iso = [isolated_ttft_s(i, TIMES, pipelined=False) for i in infos]
    slo = [f * t for f, t in zip(np.random.default_rng(1).choice([2, 4, 8], len(infos)), iso)]
    infos = [RequestInfo(i.request_id, i.arrival_s, i.cached_tokens, i.compute_tokens,
                         i.arrival_s + s) for i, s in zip(infos, slo)]
    runs = {"serial": simulate_serialized(infos, TIMES)}
    for name in ("fifo", "sjf", "srpt", "edf", "lstf"):
        runs[name] = simulate_pipelined(infos, TIMES, make_policy(name, model))
    stats = {k: summarize([r.ttft_s for r in v], slo) for k, v in runs.items()}
    assert stats["fifo"].mean_s < stats["serial"].mean_s
    assert stats["sjf"].mean_s < stats["fifo"].mean_s
    assert stats["srpt"].mean_s < stats["fifo"].mean_s
    for name in ("edf", "lstf"):
        assert stats[name].slo_attainment > stats["fifo"].slo_attainment
        assert stats[name].slo_attainment > stats["serial"].slo_attainment + 0.4


def test_proactive_allocation_never_hurts_when_device_is_short():
    infos = synthetic(num=30, qps=8.0, seed=3)
    fifo = make_policy("fifo")
    proactive = simulate_pipelined(infos, TIMES, fifo, host_slots=64, device_slots=200)
    reactive = simulate_pipelined(infos, TIMES, fifo, host_slots=64, device_slots=200,
                                  proactive=False)
    assert all(r.finish_s > r.arrival_s for r in proactive + reactive)
    assert np.mean([r.ttft_s for r in proactive]) <= np.mean([r.ttft_s for r in reactive]) + 1e-9


def test_paper_like_link_scaling():
    fast, thin = StageTimes.paper_like(link_gbps=400), StageTimes.paper_like(link_gbps=25)
    assert thin.fetch_s_per_token == pytest.approx(16 * fast.fetch_s_per_token)
    assert thin.compute_s(100, 1000) == fast.compute_s(100, 1000)
    with pytest.raises(ValueError, match="link_gbps"):
        StageTimes.paper_like(link_gbps=0)


def test_experiment_script_runs_end_to_end(tmp_path, run_experiment):
    done = run_experiment("calvo_sim.py", "--contexts", "2", "--queries", "3", "--min-context",
                          "1024", "--max-context", "2048", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "calvo_sim.csv").stat().st_size > 0
    assert (tmp_path / "calvo_sim.png").stat().st_size > 0
    assert "pipelined SJF mean TTFT" in done.stdout
