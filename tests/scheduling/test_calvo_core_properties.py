"""Property test of PipelineCore: under any interleaving of arrivals, dispatches, completions,
misses and cancellations, space is never over-committed or shared, the pipeline never
deadlocks, every surviving request computes exactly its valid prefix, and nothing leaks."""
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.scheduling import PipelineCore, PipelineRequest, RequestInfo, Stage


def check_space(core: PipelineCore):
    for pool in (core.host, core.device):
        assert 0 <= pool.used <= pool.capacity
        owners = pool._owner
        assert len(owners) == pool.used and len(set(pool._free)) == pool.free
        assert not set(owners) & set(pool._free)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_core_never_overcommits_deadlocks_or_leaks(data):
    host = data.draw(st.integers(2, 5), label="host_slots")
    device = data.draw(st.integers(3, 10), label="device_slots")
    core = PipelineCore(host, device, proactive=data.draw(st.booleans(), label="proactive"))
    specs = data.draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2), st.integers(0, 9)),
                               min_size=1, max_size=8), label="requests")
    requests = [PipelineRequest(RequestInfo(i, 0.0, 4 * n, 1), min(n, device - c), c)
                for i, (n, c, _) in enumerate(specs)]
    requests = [r for r in requests if r.device_need <= device]
    pending = list(requests)
    inflight, dropped, computed, first_miss = [], set(), {}, {}

    def finish(task, ok=True):
        inflight.remove(task)
        rid = task.request.request_id
        if task.stage is Stage.FETCH and not ok:
            first_miss[rid] = min(first_miss.get(rid, task.chunk), task.chunk)
        done = core.complete(task, ok=ok)
        if task.stage is Stage.COMPUTE:
            assert done is not None
            computed[rid] = task.loaded_chunks
            # Compute sees every valid chunk in its own, distinct L1 slots.
            assert len(set(task.device_slots)) == len(task.device_slots) == task.request.device_need

    for _ in range(data.draw(st.integers(0, 60), label="steps")):
        op = data.draw(st.sampled_from(["add", "dispatch", "complete", "drop"]))
        if op == "add" and pending:
            request = pending.pop(0)
            core.add(request, (specs[request.request_id][2],))
        elif op == "dispatch":
            task = core.next_task(data.draw(st.sampled_from(list(Stage))))
            if task is not None:
                inflight.append(task)
        elif op == "complete" and inflight:
            task = data.draw(st.sampled_from(inflight))
            finish(task, ok=data.draw(st.booleans()) if task.stage is Stage.FETCH else True)
        elif op == "drop" and core.request_ids():
            rid = data.draw(st.sampled_from(core.request_ids()))
            if core.drop(rid):
                dropped.add(rid)
        check_space(core)

    for request in pending:
        core.add(request, (0,))
    while core.active:                       # drain: must always make progress
        progressed = False
        for stage in Stage:
            task = core.next_task(stage)
            if task is not None:
                inflight.append(task)
                progressed = True
        for task in list(inflight):
            finish(task)
            progressed = True
        check_space(core)
        assert progressed, f"deadlock: {core.active} requests, host {core.host}, {core.device}"

    assert core.slots_in_use() == {"host": 0, "device": 0}
    for request in requests:
        rid = request.request_id
        if rid in dropped:
            assert rid not in computed
        else:
            assert computed[rid] == min(request.num_chunks, first_miss.get(rid, request.num_chunks))
