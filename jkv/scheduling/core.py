"""Pure bookkeeping of CALVO's three-stage loading pipeline (§3.1): who may do what next.

No threads and no clock: `next_task(stage)` answers a stage dispatcher's question "what should my
executor do now?" (reserving the space the task needs) and `complete(task, ...)` records what an
executor finished. The threaded engine (`pipeline.py`) and the discrete-event simulator
(`simulator.py`) both drive this one state machine, so the simulator schedules exactly like the
engine. Callers serialise access (the engine holds its lock around every call).

Per request (a `Job`), chunk i of its cached prefix moves L3 -> L2 (FETCH) -> L1 (UPLOAD); the
request is computed once every still-valid chunk is in L1 (COMPUTE). Rules:

* Each stage serves the highest-priority request that has work ready for it and whose
  destination space can be had (§3.1: data ready + space allocated); it skips requests that
  cannot proceed rather than block on them.
* FETCH proactively reserves the request's whole L1 need (prefix chunks + compute slots) when
  it first dispatches for it (§3.1: "submit a GPU memory allocation request"); if L1 is short,
  the request proceeds in *reactive* mode and UPLOAD (or COMPUTE, for a request that loads
  nothing) allocates L1 when it first needs it (§3.1 footnote 2).
* L1 is reserved all-or-nothing per request, so no request holds part of L1 while waiting for
  more (no hold-and-wait, no deadlock). L2 chunks of reactive requests may fill L2 only up to
  `capacity - host_reserve`: the reserve keeps L2 moving for requests that own L1, whose L2
  chunks always drain, so L2 can never fill with chunks that wait for L1 held by requests that
  wait for L2.
* Per-chunk signals: a chunk becomes uploadable the moment its fetch completes.
* A fetch that misses (pool evicted the chunk or died) truncates the request's valid prefix at
  that chunk; later chunks are dropped and the compute stage recomputes them (never a wrong hit).
* A job's slots are released only when none of its tasks is in flight, so an executor never
  writes into a slot that already belongs to another request.
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Hashable
from typing import Any

from jkv.scheduling.policies import RequestInfo
from jkv.scheduling.space import SlotPool


class Stage(enum.Enum):
    FETCH = "l3_to_l2"
    UPLOAD = "l2_to_l1"
    COMPUTE = "compute"


@dataclasses.dataclass(frozen=True)
class PipelineRequest:
    """A request as the pipeline sees it.

    num_chunks: cached chunks to load from the pool (the longest prefix match).
    compute_slots: extra L1 slots the compute stage needs (e.g. the suffix's KV), >= 0.
    payload: opaque to the pipeline; handed to the stage functions (tokens, pool keys, ...).
    """

    info: RequestInfo
    num_chunks: int
    compute_slots: int = 0
    payload: Any = None

    def __post_init__(self):
        if self.num_chunks < 0 or self.compute_slots < 0:
            raise ValueError(f"{self.num_chunks=} and {self.compute_slots=} must be >= 0")

    @property
    def request_id(self) -> Hashable:
        return self.info.request_id

    @property
    def device_need(self) -> int:
        return self.num_chunks + self.compute_slots


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of executor work. FETCH/UPLOAD move `chunk`; COMPUTE gets `loaded_chunks` (the
    valid prefix now in L1) and all the request's L1 slots (`device_slots[i]` holds chunk i)."""

    stage: Stage
    request: PipelineRequest
    chunk: int = -1
    host_slot: int = -1
    device_slot: int = -1
    loaded_chunks: int = 0
    device_slots: tuple[int, ...] = ()


@dataclasses.dataclass(eq=False)
class Job:
    request: PipelineRequest
    sort_key: tuple
    valid_chunks: int
    next_fetch: int = 0
    host_slots: dict[int, int] = dataclasses.field(default_factory=dict)  # chunk -> L2 slot
    in_l2: list[int] = dataclasses.field(default_factory=list)           # fetched, not uploading
    uploaded: set[int] = dataclasses.field(default_factory=set)          # chunks in L1
    device_slots: list[int] | None = None
    proactive: bool = False
    inflight: int = 0
    computing: bool = False
    dropped: bool = False      # cancelled or failed: release when nothing is in flight


@dataclasses.dataclass
class CoreStats:
    proactive_allocations: int = 0
    reactive_allocations: int = 0
    fetch_misses: int = 0
    completed: int = 0
    dropped: int = 0


class PipelineCore:
    """State machine over L2 (`host_slots`) and L1 (`device_slots`) capacities, in chunks.

    proactive: reserve L1 at the first fetch (CALVO); False reserves it only when needed.
    host_reserve: L2 slots that requests without L1 may never take (>= 1: avoids deadlock).
    """

    def __init__(self, host_slots: int, device_slots: int, *, proactive: bool = True,
                 host_reserve: int = 1, progress_key=None, clock=None):
        if host_slots < 2 or device_slots < 1:
            raise ValueError(f"{host_slots=} must be >= 2 and {device_slots=} >= 1 chunk slots")
        if not 1 <= host_reserve < host_slots:
            # 0 would let requests without L1 fill L2 and deadlock against requests holding L1.
            raise ValueError(f"{host_reserve=} must be in [1, host_slots={host_slots})")
        self.host = SlotPool("L2 host", host_slots)
        self.device = SlotPool("L1 device", device_slots)
        self.proactive = proactive
        self.host_reserve = host_reserve
        self.stats = CoreStats()
        # Optional dynamic priority (info, prefix tokens not yet in L1, now) -> key, re-evaluated
        # on every dispatch (LSTF's remaining slack); None keeps the admission-time order.
        # clock() gives `now` on the requests' clock (arrival_s / deadline_s).
        if progress_key is not None and clock is None:
            raise ValueError("a progress_key needs clock= (now on the requests' arrival clock)")
        self.progress_key = progress_key
        self.clock = clock
        self._jobs: dict[Hashable, Job] = {}
        self._order: list[tuple[tuple, Hashable]] = []   # (sort_key, request_id), ascending
        self._seq = 0

    # -- admission and removal ----------------------------------------------------------------
    def add(self, request: PipelineRequest, priority: tuple) -> None:
        self.check(request)
        rid = request.request_id
        sort_key = (tuple(priority), self._seq)
        self._seq += 1
        self._jobs[rid] = Job(request, sort_key, valid_chunks=request.num_chunks)
        bisect.insort(self._order, (sort_key, rid))

    def check(self, request: PipelineRequest) -> None:
        """ValueError unless `request` can be added (unique id, fits in L1)."""
        rid = request.request_id
        if rid in self._jobs:
            raise ValueError(f"request id {rid!r} is already in the pipeline")
        if request.device_need > self.device.capacity:
            raise ValueError(f"request {rid!r} needs {request.device_need} L1 slots "
                             f"({request.num_chunks} chunks + {request.compute_slots} compute) but "
                             f"L1 holds {self.device.capacity}; raise device capacity or load a "
                             "shorter prefix")

    def drop(self, request_id: Hashable) -> bool:
        """Cancel or fail a request: no new tasks; its slots come back once nothing is in flight.
        False if unknown or already computing/finished."""
        job = self._jobs.get(request_id)
        if job is None or job.dropped or job.computing:
            return False
        job.dropped = True
        self.stats.dropped += 1
        self._release_if_idle(job)
        return True

    def is_dropped(self, request_id: Hashable) -> bool:
        job = self._jobs.get(request_id)
        return job is not None and job.dropped

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._jobs

    @property
    def active(self) -> int:
        return len(self._jobs)

    def request_ids(self) -> list[Hashable]:
        return [rid for _, rid in self._order]

    # -- dispatch --------------------------------------------------------------------------------
    def next_task(self, stage: Stage) -> Task | None:
        """Reserve space for and return the next task for `stage`'s executor, or None."""
        pick = {Stage.FETCH: self._next_fetch, Stage.UPLOAD: self._next_upload,
                Stage.COMPUTE: self._next_compute}[stage]
        for _, rid in self._dispatch_order():
            job = self._jobs[rid]
            if job.dropped or job.computing:
                continue
            task = pick(job)
            if task is not None:
                job.inflight += 1
                return task
        return None

    def _dispatch_order(self) -> list[tuple[tuple, Hashable]]:
        if self.progress_key is None:
            return self._order
        now = self.clock()
        return sorted(self._order, key=lambda entry: (
            tuple(self.progress_key(self._jobs[entry[1]].request.info,
                                    self.remaining_load_tokens(self._jobs[entry[1]]), now)),
            entry[0][1]))

    @staticmethod
    def remaining_load_tokens(job: Job) -> float:
        """Prefix tokens of `job` still to reach L1 (cached_tokens pro rata per chunk)."""
        request = job.request
        if request.num_chunks == 0:
            return 0.0
        left = max(0, job.valid_chunks - len(job.uploaded))
        return request.info.cached_tokens * left / request.num_chunks

    def _next_fetch(self, job: Job) -> Task | None:
        if job.next_fetch >= job.valid_chunks:
            return None
        if job.device_slots is None and self.proactive:
            self._try_device(job, proactive=True)
        owns_l1 = job.device_slots is not None
        if not owns_l1 and self.host.free <= self.host_reserve:
            return None
        slot = self.host.allocate(job.request.request_id, 1)
        if slot is None:
            return None
        chunk = job.next_fetch
        job.next_fetch += 1
        job.host_slots[chunk] = slot[0]
        return Task(Stage.FETCH, job.request, chunk=chunk, host_slot=slot[0])

    def _next_upload(self, job: Job) -> Task | None:
        if not job.in_l2:
            return None
        if job.device_slots is None and not self._try_device(job, proactive=False):
            return None
        chunk = job.in_l2.pop(0)
        return Task(Stage.UPLOAD, job.request, chunk=chunk, host_slot=job.host_slots[chunk],
                    device_slot=job.device_slots[chunk])

    def _next_compute(self, job: Job) -> Task | None:
        if job.inflight or sum(c < job.valid_chunks for c in job.uploaded) < job.valid_chunks:
            return None
        if job.device_slots is None and not self._try_device(job, proactive=False):
            return None
        job.computing = True
        return Task(Stage.COMPUTE, job.request, loaded_chunks=job.valid_chunks,
                    device_slots=tuple(job.device_slots))

    def _try_device(self, job: Job, proactive: bool) -> bool:
        slots = self.device.allocate(job.request.request_id, job.request.device_need)
        if slots is None:
            return False
        job.device_slots = slots
        job.proactive = proactive
        if proactive:
            self.stats.proactive_allocations += 1
        else:
            self.stats.reactive_allocations += 1
        return True

    # -- completion ------------------------------------------------------------------------------
    def complete(self, task: Task, ok: bool = True) -> Job | None:
        """Record a finished task. For FETCH, ok=False means the pool missed that chunk.
        Returns the job when a COMPUTE task finished it (its slots are released), else None."""
        job = self._jobs[task.request.request_id]
        job.inflight -= 1
        if task.stage is Stage.FETCH:
            if job.dropped:
                self._free_l2(job, task.chunk)
            elif not ok:
                self.stats.fetch_misses += 1
                job.valid_chunks = min(job.valid_chunks, task.chunk)
                self._free_l2(job, task.chunk)
                for chunk in [c for c in job.in_l2 if c >= job.valid_chunks]:
                    job.in_l2.remove(chunk)
                    self._free_l2(job, chunk)
            elif task.chunk >= job.valid_chunks:
                self._free_l2(job, task.chunk)
            else:
                bisect.insort(job.in_l2, task.chunk)
        elif task.stage is Stage.UPLOAD:
            self._free_l2(job, task.chunk)
            job.uploaded.add(task.chunk)
        else:
            job.computing = False
            self.stats.completed += 1
            self._remove(job)
            return job
        self._release_if_idle(job)
        return None

    def fail(self, task: Task) -> None:
        """An executor raised: the request is dropped (COMPUTE failures release it at once)."""
        job = self._jobs[task.request.request_id]
        if task.stage is Stage.COMPUTE:
            job.computing = False
        if task.stage is Stage.FETCH or task.stage is Stage.UPLOAD:
            self._free_l2(job, task.chunk)
        job.inflight -= 1
        if not job.dropped:
            job.dropped = True
            self.stats.dropped += 1
        self._release_if_idle(job)

    def _free_l2(self, job: Job, chunk: int) -> None:
        slot = job.host_slots.pop(chunk, None)
        if slot is None:
            return
        self.host.release(job.request.request_id, [slot])

    def _release_if_idle(self, job: Job) -> None:
        if not job.dropped or job.inflight:
            return
        for chunk in list(job.host_slots):
            self._free_l2(job, chunk)
        job.in_l2.clear()
        self._remove(job)

    def _remove(self, job: Job) -> None:
        rid = job.request.request_id
        if job.device_slots is not None:
            self.device.release(rid, job.device_slots)
            job.device_slots = None
        assert not job.host_slots, f"request {rid!r} finished holding L2 slots {job.host_slots}"
        del self._jobs[rid]
        self._order.remove((job.sort_key, rid))

    def slots_in_use(self) -> dict[str, int]:
        """L2/L1 slots held; both 0 whenever no request is in the pipeline (the leak check)."""
        return {"host": self.host.used, "device": self.device.used}
