"""Threaded loading pipeline with instrumented fake stages: overlap, equality with the serialized
run, priority order, reactive degradation, misses, cancellation and failure without leaks."""
import concurrent.futures
import threading
import time

import pytest

from jkv.scheduling import (CostModel, LoadingPipeline, PipelineConfig, Stage, make_policy,
                            run_serialized)
from jkv.scheduling.testing import FakeStages, expected_value, make_request


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def run_all(pipeline, requests, timeout=20):
    futures = [pipeline.submit(r) for r in requests]
    return [f.result(timeout=timeout) for f in futures]


def test_request_b_loads_while_a_computes():
    stages = FakeStages(8, 16, fetch_s=0.03, upload_s=0.005)
    a = make_request("A", ctx=1, num_chunks=1, query=3, compute_s=0.4)
    b = make_request("B", ctx=2, num_chunks=4, query=5, compute_s=0.01)
    with LoadingPipeline(stages.functions(), PipelineConfig(8, 16)) as pipeline:
        ra, rb = run_all(pipeline, [a, b])
    (a_compute,) = stages.intervals("compute", "A")
    b_fetches = stages.intervals("fetch", "B")
    assert len(b_fetches) == 4
    assert any(overlaps(f, a_compute) for f in b_fetches)
    assert all(u[1] <= a_compute[1] for u in stages.intervals("upload", "B"))  # loaded during A
    assert (ra.value, rb.value) == (expected_value(1, 1, 3), expected_value(2, 4, 5))
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}


def test_upload_of_first_chunk_starts_before_last_fetch_ends():
    stages = FakeStages(8, 16, fetch_s=0.03, upload_s=0.001)
    with LoadingPipeline(stages.functions(), PipelineConfig(8, 16)) as pipeline:
        run_all(pipeline, [make_request("R", ctx=3, num_chunks=4, query=1)])
    first_upload = min(s for s, _ in stages.intervals("upload", "R"))
    last_fetch_end = max(e for _, e in stages.intervals("fetch", "R"))
    assert first_upload < last_fetch_end      # per-chunk completion signal


def mixed_requests():
    # Varying prefix lengths, a mid-prefix miss, a full miss, and a request that loads nothing.
    specs = [(0, 5, 7, ()), (1, 3, 2, ()), (2, 6, 9, (3,)), (3, 0, 4, ()), (4, 4, 1, (0,)),
             (5, 2, 8, ()), (6, 6, 3, ()), (7, 1, 6, ())]
    return [make_request(f"r{i}", ctx=ctx, num_chunks=n, query=q, arrival=float(i),
                         compute_s=0.002 * (i % 3), misses=m)
            for i, (ctx, n, q, m) in enumerate(specs)]


@pytest.mark.parametrize("proactive", [True, False])
@pytest.mark.parametrize("policy", ["fifo", "sjf-pt", "sjf", "srpt", "edf", "lstf"])
def test_results_equal_serialized_run(policy, proactive):
    requests = mixed_requests()
    serial = run_serialized(requests, FakeStages(8, 8).functions(), 8, 8)
    stages = FakeStages(4, 8, fetch_s=0.002, upload_s=0.001)
    config = PipelineConfig(host_slots=4, device_slots=8, proactive=proactive)
    cost = CostModel(1e-4, 1e-3, 1e-3, 1e-3)
    with LoadingPipeline(stages.functions(), config, make_policy(policy, cost)) as pipeline:
        results = run_all(pipeline, requests)
    assert [r.value for r in results] == [s.value for s in serial]
    assert [r.value for r in results] == [
        expected_value(r.payload["ctx"], r.num_chunks, r.payload["query"]) for r in requests]
    assert [r.loaded_chunks for r in results] == [s.loaded_chunks for s in serial] == [
        5, 3, 3, 0, 0, 2, 6, 1]
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}
    assert pipeline.stats().fetch_misses == 2


def test_compute_order_follows_policy_priority():
    stages = FakeStages(8, 16)
    stages.gates["gate"] = threading.Event()
    order_policy = make_policy("sjf-pt")
    with LoadingPipeline(stages.functions(), PipelineConfig(8, 16), order_policy) as pipeline:
        gate = pipeline.submit(make_request("gate", ctx=0, num_chunks=0, query=0))
        while "gate" not in stages.compute_started:
            time.sleep(0.005)                     # gate is now computing (and blocked)
        later = [pipeline.submit(make_request(name, ctx=1, num_chunks=0, query=q))
                 for name, q in [("long", 50), ("short", 5), ("mid", 20)]]
        time.sleep(0.05)
        stages.gates["gate"].set()
        gate.result(10)
        for f in later:
            f.result(10)
    computed = [rid for stage, rid, *_ in sorted(stages.events, key=lambda e: e[3])
                if stage == "compute"]
    assert computed == ["gate", "short", "mid", "long"]


def test_set_policy_orders_the_requests_submitted_after_it():
    """The serving engine swaps in a refitted cost model's policy (jkv/serving/prefix_loader.py)."""
    stages = FakeStages(8, 16)
    stages.gates["gate"] = threading.Event()
    with LoadingPipeline(stages.functions(), PipelineConfig(8, 16), make_policy("fifo")) as pipeline:
        gate = pipeline.submit(make_request("gate", ctx=0, num_chunks=0, query=0))
        while "gate" not in stages.compute_started:
            time.sleep(0.005)
        pipeline.set_policy(make_policy("sjf-pt"))
        later = [pipeline.submit(make_request(name, ctx=1, num_chunks=0, query=q))
                 for name, q in [("long", 50), ("short", 5), ("mid", 20)]]
        stages.gates["gate"].set()
        for f in [gate, *later]:
            f.result(10)
    computed = [rid for stage, rid, *_ in sorted(stages.events, key=lambda e: e[3]) if stage == "compute"]
    assert computed == ["gate", "short", "mid", "long"]


def test_degrades_to_reactive_allocation_when_device_is_short():
    stages = FakeStages(4, 4, fetch_s=0.02, upload_s=0.002)
    a = make_request("A", ctx=1, num_chunks=3, query=1, compute_slots=1, compute_s=0.3)
    b = make_request("B", ctx=2, num_chunks=3, query=2, compute_slots=1)
    with LoadingPipeline(stages.functions(), PipelineConfig(4, 4)) as pipeline:
        ra, rb = run_all(pipeline, [a, b])
        stats = pipeline.stats()
    assert stats.proactive_allocations >= 1 and stats.reactive_allocations >= 1
    (a_compute,) = stages.intervals("compute", "A")
    assert any(overlaps(f, a_compute) for f in stages.intervals("fetch", "B"))  # B prefetched to L2
    assert all(s >= a_compute[1] - 1e-3 for s, _ in stages.intervals("upload", "B"))  # L1 after A
    assert (ra.value, rb.value) == (expected_value(1, 3, 1), expected_value(2, 3, 2))
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}


def test_cancellations_leak_no_space():
    stages = FakeStages(4, 10, fetch_s=0.01, upload_s=0.002)
    requests = [make_request(f"r{i}", ctx=i, num_chunks=1 + i % 5, query=i, compute_s=0.005)
                for i in range(12)]
    with LoadingPipeline(stages.functions(), PipelineConfig(4, 10)) as pipeline:
        futures = {r.request_id: pipeline.submit(r) for r in requests}
        time.sleep(0.03)                          # some requests are mid-load now
        cancelled = {rid for rid in list(futures)[1::2] if pipeline.cancel(rid)}
        assert cancelled
        for rid, future in futures.items():
            if rid in cancelled:
                with pytest.raises(concurrent.futures.CancelledError):
                    future.result(10)
            else:
                request = next(r for r in requests if r.request_id == rid)
                assert future.result(10).value == expected_value(
                    request.payload["ctx"], request.num_chunks, request.payload["query"])
        assert not pipeline.cancel("r0")          # finished requests cannot be cancelled
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}


def test_close_cancels_pending_work_and_joins_threads():
    stages = FakeStages(4, 20, fetch_s=0.02)
    pipeline = LoadingPipeline(stages.functions(), PipelineConfig(4, 20))
    futures = [pipeline.submit(make_request(i, ctx=i, num_chunks=4, query=1)) for i in range(4)]
    time.sleep(0.03)
    pipeline.close()
    assert all(f.done() for f in futures)
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.submit(make_request("late", ctx=0, num_chunks=0, query=0))


def test_stage_failure_fails_only_its_request():
    stages = FakeStages(4, 8, fetch_s=0.002)
    stages.fail_compute.add("bad")
    with LoadingPipeline(stages.functions(), PipelineConfig(4, 8)) as pipeline:
        bad = pipeline.submit(make_request("bad", ctx=1, num_chunks=2, query=1))
        good = pipeline.submit(make_request("good", ctx=2, num_chunks=2, query=1))
        with pytest.raises(RuntimeError, match="injected"):
            bad.result(10)
        assert good.result(10).value == expected_value(2, 2, 1)
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}


def test_bad_requests_and_configs_raise_clear_errors():
    stages = FakeStages(4, 4)
    with LoadingPipeline(stages.functions(), PipelineConfig(4, 4)) as pipeline:
        with pytest.raises(ValueError, match="needs 5 L1 slots"):
            pipeline.submit(make_request("big", ctx=0, num_chunks=4, query=1, compute_slots=1))
        pipeline.submit(make_request("x", ctx=0, num_chunks=1, query=1)).result(10)
    with pytest.raises(ValueError, match="host_slots"):
        PipelineConfig(host_slots=1, device_slots=4)


@pytest.mark.parametrize("depth, order", [
    (1, ["long0", "short0", "long1", "long2"]),   # each chunk chosen when the link is free: SJF's short first
    (2, ["long0", "long1", "short0", "long2"]),   # long1 was handed out while long0 was on the link
])
def test_fetch_depth_decides_whether_a_short_request_takes_the_link_at_the_next_chunk(depth, order):
    """The serving loader (jkv/serving/prefix_loader.py) runs the fetch stage at depth 1 on a slow link
    so the policy orders the link chunk by chunk; depth 2 commits one chunk ahead."""
    stages = FakeStages(8, 16)
    on_link = threading.Event()
    release = threading.Event()
    fetched = []
    fetch = stages.fetch

    def gated_fetch(request, chunk, host_slot):
        fetched.append(f"{request.request_id}{chunk}")
        if len(fetched) == 1:
            on_link.set()
            assert release.wait(10), "the test never released the first fetch"
        return fetch(request, chunk, host_slot)

    functions = stages.functions()
    functions = type(functions)(gated_fetch, functions.upload, functions.compute)
    with LoadingPipeline(functions, PipelineConfig(8, 16, fetch_depth=2), make_policy("sjf-pt")) as pipeline:
        pipeline.set_depth(Stage.FETCH, depth)
        assert pipeline.depth(Stage.FETCH) == depth
        long = pipeline.submit(make_request("long", ctx=1, num_chunks=3, query=50))
        assert on_link.wait(10)
        time.sleep(0.05)  # the dispatcher hands out what its depth allows while long0 is on the link
        short = pipeline.submit(make_request("short", ctx=2, num_chunks=1, query=5))
        release.set()
        assert short.result(10).value == expected_value(2, 1, 5)
        assert long.result(10).value == expected_value(1, 3, 50)
        with pytest.raises(ValueError, match="depth=0 must be >= 1"):
            pipeline.set_depth(Stage.FETCH, 0)
    assert fetched == order
