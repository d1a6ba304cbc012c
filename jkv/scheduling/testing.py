"""Instrumented fake stages with hand-computable outputs for the loading pipeline tests.

Shared by tests/scheduling and experiments/calvo_dispatch_cost.py (which times dispatch with
stages that only sleep), so it lives in the package rather than in either of them.

Chunk i of context `ctx` holds `chunk_data(ctx, i)`; fetch writes it into an L2 row, upload
copies L2 row -> L1 row, compute reads the loaded prefix *from L1* (so any slot mix-up changes
the result) and recomputes missed chunks directly. `expected_value` is the same sum computed
without any pipeline.
"""
import threading
import time

import numpy as np

from jkv.scheduling import PipelineRequest, RequestInfo, StageFunctions

WIDTH = 16


def chunk_data(ctx: int, chunk: int) -> np.ndarray:
    return np.arange(WIDTH, dtype=np.int64) + 1000 * ctx + 7 * chunk


def expected_value(ctx: int, num_chunks: int, query: int) -> int:
    return int(sum((i + 1) * chunk_data(ctx, i).sum() for i in range(num_chunks)) + query)


def make_request(rid, ctx: int, num_chunks: int, query: int, *, arrival=0.0, deadline=float("inf"),
                 compute_s=0.0, compute_slots=1, misses=()) -> PipelineRequest:
    info = RequestInfo(rid, arrival, cached_tokens=4 * num_chunks, compute_tokens=query,
                       deadline_s=deadline)
    return PipelineRequest(info, num_chunks, compute_slots,
                           payload=dict(ctx=ctx, query=query, compute_s=compute_s,
                                        misses=frozenset(misses)))


class FakeStages:
    def __init__(self, host_slots: int, device_slots: int, fetch_s=0.0, upload_s=0.0):
        self.host = np.full((host_slots, WIDTH), -1, dtype=np.int64)      # L2: [slots, WIDTH]
        self.device = np.full((device_slots, WIDTH), -1, dtype=np.int64)  # L1: [slots, WIDTH]
        self.fetch_s, self.upload_s = fetch_s, upload_s
        self.events: list[tuple[str, object, int, float, float]] = []
        self.gates: dict[object, threading.Event] = {}
        self.fail_compute: set = set()
        self.compute_started: list = []
        self._lock = threading.Lock()

    def functions(self) -> StageFunctions:
        return StageFunctions(self.fetch, self.upload, self.compute)

    def _record(self, stage, rid, chunk, start):
        with self._lock:
            self.events.append((stage, rid, chunk, start, time.monotonic()))

    def fetch(self, request, chunk, host_slot) -> bool:
        start = time.monotonic()
        time.sleep(self.fetch_s)
        p = request.payload
        if chunk in p["misses"]:
            self._record("fetch-miss", request.request_id, chunk, start)
            return False
        self.host[host_slot] = chunk_data(p["ctx"], chunk)
        self._record("fetch", request.request_id, chunk, start)
        return True

    def upload(self, request, chunk, host_slot, device_slot) -> None:
        start = time.monotonic()
        time.sleep(self.upload_s)
        self.device[device_slot] = self.host[host_slot]
        self.host[host_slot] = -1          # the slot may be reused right after
        self._record("upload", request.request_id, chunk, start)

    def compute(self, request, loaded_chunks, device_slots) -> int:
        start = time.monotonic()
        p = request.payload
        self.compute_started.append(request.request_id)
        gate = self.gates.get(request.request_id)
        if gate is not None:
            assert gate.wait(10), "test gate never opened"
        time.sleep(p["compute_s"])
        if request.request_id in self.fail_compute:
            raise RuntimeError(f"injected compute failure for {request.request_id}")
        rows = [self.device[device_slots[i]].copy() for i in range(loaded_chunks)]
        rows += [chunk_data(p["ctx"], i) for i in range(loaded_chunks, request.num_chunks)]
        for slot in device_slots:          # the request's L1 space is free after compute
            self.device[slot] = -1
        self._record("compute", request.request_id, loaded_chunks, start)
        return int(sum((i + 1) * row.sum() for i, row in enumerate(rows)) + p["query"])

    def intervals(self, stage, rid):
        return [(s, e) for st, r, _, s, e in self.events if st == stage and r == rid]
