"""Discrete-event simulation of the CALVO pipeline on modelled stage times (no model needed).

The simulator drives the *same* `PipelineCore` as the threaded engine: at every event (arrival
or task completion) each idle stage asks the core for its next task, and the task finishes
after its modelled duration. So policy and space decisions are exactly the engine's; only the
stage functions are replaced by `StageTimes`. Each stage is one executor (one network link,
one PCIe path, one device), as in the engine.

The serialized baseline (vLLM + LMCache-like, §2.3.1) admits one request at a time in FIFO
order and runs its fetch, upload and compute back to back with no overlap.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

from jkv.scheduling.core import PipelineCore, PipelineRequest, Stage, Task
from jkv.scheduling.cost_model import CostModel
from jkv.scheduling.policies import Policy, RequestInfo, fifo


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Modelled service times of one deployment, in seconds.

    fetch: chunk_tokens * fetch_s_per_token + fetch_chunk_latency_s per chunk (L3 -> L2 link).
    upload: chunk_tokens * upload_s_per_token per chunk (L2 -> L1, PCIe).
    compute: compute_overhead_s + compute_s_per_token * q + attention_s_per_pair * q * (n + q/2)
             for q computed tokens attending to n cached tokens and (causally) to each other.
    """

    chunk_tokens: int
    fetch_s_per_token: float
    upload_s_per_token: float
    compute_s_per_token: float
    compute_overhead_s: float
    fetch_chunk_latency_s: float = 0.0
    attention_s_per_pair: float = 0.0

    def __post_init__(self):
        if self.chunk_tokens < 1:
            raise ValueError(f"{self.chunk_tokens=} must be >= 1")
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"{field.name}={getattr(self, field.name)} must be >= 0")

    @classmethod
    def paper_like(cls, chunk_tokens: int = 256, link_gbps: float = 400.0) -> "StageTimes":
        """Scaled to CALVO's testbed (§2.3.2, §4.1: Llama-3.1-8B, 400 Gbps RDMA, one 80 GB GPU):
        ~0.36 s to load 28K cached tokens and ~20 ms to prefill a 28-token query (§2.3.2's R1);
        dense prefill at ~16 GFLOP/token and attention at ~0.5 MFLOP per (query, key) pair
        (causal: half) on ~300 TFLOP/s effective. `link_gbps` scales the L3 -> L2 time from the
        paper's 400 Gbps (e.g. 25 for the thin links jkv targets)."""
        if link_gbps <= 0:
            raise ValueError(f"{link_gbps=} must be > 0")
        return cls(chunk_tokens=chunk_tokens, fetch_s_per_token=11e-6 * 400.0 / link_gbps,
                   upload_s_per_token=3e-6,
                   compute_s_per_token=6e-5, compute_overhead_s=0.017,
                   fetch_chunk_latency_s=2e-4, attention_s_per_pair=1e-9)

    def fetch_s(self) -> float:
        return self.chunk_tokens * self.fetch_s_per_token + self.fetch_chunk_latency_s

    def upload_s(self) -> float:
        return self.chunk_tokens * self.upload_s_per_token

    def compute_s(self, compute_tokens: int, cached_tokens: int) -> float:
        q = compute_tokens
        return (self.compute_overhead_s + self.compute_s_per_token * q
                + self.attention_s_per_pair * q * (cached_tokens + q / 2))


@dataclasses.dataclass(frozen=True)
class SimRecord:
    """Per-request outcome; times on the workload's clock (seconds)."""

    request_id: object
    arrival_s: float
    loaded_s: float          # last chunk resident in L1 (arrival_s if nothing to load)
    compute_start_s: float
    finish_s: float

    @property
    def ttft_s(self) -> float:
        return self.finish_s - self.arrival_s


def to_pipeline_request(info: RequestInfo, chunk_tokens: int) -> PipelineRequest:
    if info.cached_tokens % chunk_tokens:
        raise ValueError(f"request {info.request_id!r}: {info.cached_tokens=} must be a multiple "
                         f"of {chunk_tokens=} (only full chunks are cached)")
    return PipelineRequest(info, info.cached_tokens // chunk_tokens,
                           compute_slots=max(1, math.ceil(info.compute_tokens / chunk_tokens)))


def _duration(task: Task, times: StageTimes) -> float:
    if task.stage is Stage.FETCH:
        return times.fetch_s()
    if task.stage is Stage.UPLOAD:
        return times.upload_s()
    info = task.request.info
    recomputed = (task.request.num_chunks - task.loaded_chunks) * times.chunk_tokens
    return times.compute_s(info.compute_tokens + recomputed,
                           task.loaded_chunks * times.chunk_tokens)


def simulate_pipelined(requests: Sequence[RequestInfo], times: StageTimes, policy: Policy, *,
                       host_slots: int = 256, device_slots: int = 1024,
                       proactive: bool = True) -> list[SimRecord]:
    """Run `requests` through the CALVO pipeline; records in the input order."""
    clock = [0.0]
    core = PipelineCore(host_slots, device_slots, proactive=proactive,
                        progress_key=policy.progress_key, clock=lambda: clock[0])
    events: list[tuple[float, int, int, object]] = []
    seq = 0
    for info in requests:
        heapq.heappush(events, (info.arrival_s, 1, seq, info))
        seq += 1
    busy = {stage: False for stage in Stage}
    loaded: dict = {}
    started: dict = {}
    records: dict = {}
    while events:
        now, kind, _, item = heapq.heappop(events)
        clock[0] = now
        if kind == 1:
            request = to_pipeline_request(item, times.chunk_tokens)
            core.add(request, policy.key(item))
            loaded[item.request_id] = item.arrival_s
        else:
            task = item
            busy[task.stage] = False
            rid = task.request.request_id
            if task.stage is Stage.UPLOAD:
                loaded[rid] = now
            done = core.complete(task)
            if done is not None:
                info = task.request.info
                records[rid] = SimRecord(rid, info.arrival_s, loaded[rid], started[rid], now)
        # Drain same-instant events first so a burst of arrivals is ordered by priority.
        if events and events[0][0] == now:
            continue
        for stage in Stage:
            if busy[stage]:
                continue
            task = core.next_task(stage)
            if task is None:
                continue
            busy[stage] = True
            if stage is Stage.COMPUTE:
                started[task.request.request_id] = now
            heapq.heappush(events, (now + _duration(task, times), 0, seq, task))
            seq += 1
    assert core.active == 0 and core.slots_in_use() == {"host": 0, "device": 0}
    return [records[info.request_id] for info in requests]


def simulate_serialized(requests: Sequence[RequestInfo], times: StageTimes) -> list[SimRecord]:
    """The baseline: FIFO, one request at a time, load everything, then compute."""
    free_at = -math.inf
    records = {}
    for info in sorted(requests, key=lambda r: r.arrival_s):
        start = max(info.arrival_s, free_at)
        chunks = info.cached_tokens // times.chunk_tokens
        loaded = start + chunks * (times.fetch_s() + times.upload_s())
        finish = loaded + times.compute_s(info.compute_tokens, info.cached_tokens)
        records[info.request_id] = SimRecord(info.request_id, info.arrival_s, loaded, loaded,
                                             finish)
        free_at = finish
    return [records[info.request_id] for info in requests]


def isolated_ttft_s(info: RequestInfo, times: StageTimes, pipelined: bool) -> float:
    """Interference-free TTFT of one request on the pipelined engine or the baseline."""
    alone = dataclasses.replace(info, arrival_s=0.0)
    if pipelined:
        return simulate_pipelined([alone], times, fifo())[0].ttft_s
    return simulate_serialized([alone], times)[0].ttft_s


def profile_cost_model(times: StageTimes, ctx_tokens: Sequence[int], query_tokens: Sequence[int],
                       deployment: str = "simulated") -> CostModel:
    """Fit CALVO's cost model the way a deployment would: time requests in isolation on the
    pipelined engine (T_load until the prefix is in L1, T_comp the prefill) and least-squares."""
    ctx_s, query_s, load_s, comp_s = [], [], [], []
    for ctx in ctx_tokens:
        for query in query_tokens:
            info = RequestInfo(("profile", ctx, query), 0.0, int(ctx), int(query))
            record = simulate_pipelined([info], times, fifo())[0]
            ctx_s.append(ctx)
            query_s.append(query)
            load_s.append(record.loaded_s - record.arrival_s)
            comp_s.append(record.finish_s - record.compute_start_s)
    return CostModel.fit(ctx_s, query_s, load_s, comp_s, deployment=deployment)
