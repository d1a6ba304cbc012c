"""The pipeline loading from a real KV pool: hits load, holes and a dead pool recompute, and
the results always equal the serialized reference. Plus: the simulator makes the engine's
scheduling decisions."""
import numpy as np
import pytest

from jkv.kvpool import HostKVPool
from jkv.kvpool.hashing import ChunkNamespace, chunk_keys
from jkv.scheduling import (LoadingPipeline, PipelineConfig, RequestInfo, StageFunctions,
                            make_policy, run_serialized)
from jkv.scheduling.pool_stages import pool_fetch
from jkv.scheduling.simulator import StageTimes, simulate_pipelined, to_pipeline_request
from tests.kvpool.redis_server import RedisServer, needs_redis_server
from jkv.scheduling.testing import FakeStages, chunk_data, expected_value, make_request

NS = ChunkNamespace("fake-model", "int64", 4)


def pooled_request(rid, ctx, num_chunks, query):
    request = make_request(rid, ctx=ctx, num_chunks=num_chunks, query=query)
    tokens = [ctx * 100 + t for t in range(4 * num_chunks)]
    request.payload["keys"] = chunk_keys(tokens, NS)
    return request


def populate(pool, requests, skip=()):
    for request in requests:
        for i, key in enumerate(request.payload["keys"]):
            if (request.request_id, i) not in skip:
                assert pool.put(key, chunk_data(request.payload["ctx"], i))


def run_with_pool(pool, requests):
    stages = FakeStages(4, 16, fetch_s=0.001)
    fetch = pool_fetch(pool, stages.host, lambda r: r.payload["keys"])
    functions = StageFunctions(fetch, stages.upload, stages.compute)
    with LoadingPipeline(functions, PipelineConfig(4, 16)) as pipeline:
        results = [f.result(20) for f in pipeline.submit_many(requests)]
    assert pipeline.slots_in_use() == {"host": 0, "device": 0}
    serial = run_serialized(requests, functions, 16, 16)
    assert [r.value for r in results] == [s.value for s in serial]
    assert [r.value for r in results] == [
        expected_value(r.payload["ctx"], r.num_chunks, r.payload["query"]) for r in requests]
    return [r.loaded_chunks for r in results]


def test_loads_hits_and_recomputes_holes_from_a_host_pool():
    requests = [pooled_request(f"r{i}", ctx=i, num_chunks=n, query=i)
                for i, n in enumerate([3, 5, 2, 4])]
    pool = HostKVPool(1 << 20)
    populate(pool, requests, skip={("r1", 2), ("r3", 0)})
    assert run_with_pool(pool, requests) == [3, 2, 2, 0]


def test_wrong_size_chunk_is_a_miss_not_a_hit():
    (request,) = [pooled_request("r", ctx=1, num_chunks=2, query=1)]
    pool = HostKVPool(1 << 20)
    populate(pool, [request])
    pool.put(request.payload["keys"][1], np.zeros(3, np.int64))   # a different layout
    assert run_with_pool(pool, [request]) == [1]


@needs_redis_server
def test_dead_redis_pool_degrades_to_recompute(tmp_path):
    pytest.importorskip("redis", reason="the `redis` Python client is not installed")
    from jkv.kvpool.redis_pool import RedisKVPool
    server = RedisServer(tmp_path).start()
    try:
        pool = RedisKVPool(server.url, socket_timeout_s=0.5, retry_after_s=60)
        requests = [pooled_request(f"r{i}", ctx=i, num_chunks=3, query=i) for i in range(3)]
        populate(pool, requests)
        assert run_with_pool(pool, requests) == [3, 3, 3]
        server.stop()
        assert run_with_pool(pool, requests) == [0, 0, 0]
        pool.close()
    finally:
        server.stop()


def test_simulator_makes_the_engines_scheduling_decisions():
    # Well-separated stage times so thread jitter cannot reorder anything.
    times = StageTimes(chunk_tokens=4, fetch_s_per_token=0.004, upload_s_per_token=0.0005,
                       compute_s_per_token=0.002, compute_overhead_s=0.01)
    infos = [RequestInfo(f"q{i}", 0.0, cached_tokens=4 * n, compute_tokens=q)
             for i, (n, q) in enumerate([(6, 5), (1, 40), (3, 10), (0, 3), (2, 25)])]
    policy = make_policy("sjf-pt")
    simulated = simulate_pipelined(infos, times, policy, host_slots=4, device_slots=32)
    sim_order = [r.request_id for r in sorted(simulated, key=lambda r: r.compute_start_s)]

    stages = FakeStages(4, 32, fetch_s=times.fetch_s(), upload_s=times.upload_s())
    requests = []
    for info in infos:
        base = to_pipeline_request(info, times.chunk_tokens)
        request = make_request(info.request_id, ctx=0, num_chunks=base.num_chunks,
                               query=info.compute_tokens, compute_slots=base.compute_slots,
                               compute_s=times.compute_s(info.compute_tokens, info.cached_tokens))
        requests.append(type(request)(info, request.num_chunks, request.compute_slots,
                                      request.payload))
    with LoadingPipeline(stages.functions(), PipelineConfig(4, 32), policy) as pipeline:
        for future in pipeline.submit_many(requests):
            future.result(20)
    engine_order = [rid for stage, rid, *_ in sorted(stages.events, key=lambda e: e[3])
                    if stage == "compute"]
    assert engine_order == sim_order
    assert sim_order != [i.request_id for i in infos]   # the policy actually reordered


def test_write_back_stores_only_missing_chunks_and_then_they_load():
    from jkv.scheduling.pool_stages import write_back
    request = pooled_request("w", ctx=4, num_chunks=4, query=2)
    keys = request.payload["keys"]
    pool = HostKVPool(1 << 20)
    assert run_with_pool(pool, [request]) == [0]               # cold pool: full recompute
    pool.put(keys[1], chunk_data(4, 1))
    computed = np.stack([chunk_data(4, i) for i in range(4)])  # [n, WIDTH] KV rows of prefill
    assert write_back(pool, keys, computed) == 3
    assert pool.stats().puts == 4
    assert run_with_pool(pool, [request]) == [4]               # warm pool: everything loads
    with pytest.raises(ValueError, match="outside"):
        write_back(pool, keys, computed, first_chunk=1)


def test_pipeline_loads_from_the_jkv_pool_server_and_recomputes_when_it_dies():
    from jkv.kvpool.remote_pool import RemoteKVPool
    from tests.kvpool.pool_server import SECRET, PoolServerProcess
    server = PoolServerProcess().start()
    pool = RemoteKVPool(server.address, secret=SECRET, op_timeout_s=1.0, retry_after_s=60)
    try:
        requests = [pooled_request(f"r{i}", ctx=i, num_chunks=3, query=i) for i in range(3)]
        populate(pool, requests, skip={("r2", 1)})
        assert run_with_pool(pool, requests) == [3, 3, 1]
        server.stop()
        assert run_with_pool(pool, requests) == [0, 0, 0]
    finally:
        pool.close()
        server.stop()
