"""CALVO's pipelined prefill engine (§3.1): L3 -> L2, L2 -> L1 and compute as autonomous stages.

Concurrency
-----------
Three stages, each a *dispatcher* thread and an *executor* thread (6 threads, named
`calvo-<stage>-dispatcher` / `calvo-<stage>-executor`):

* A dispatcher waits on the pipeline's condition variable until its executor has room (at most
  `depth` tasks handed out and unfinished) and `PipelineCore.next_task(stage)` yields a task —
  the highest-priority request whose input is ready and whose destination space it could
  reserve. Reserving happens inside `next_task` under the lock, so the FETCH dispatcher's
  proactive L1 reservation is visible to the UPLOAD dispatcher immediately.
* An executor takes tasks from its own `queue.Queue` in order and runs the stage function
  *without* the lock (network reads, host->device copies and prefill run concurrently across
  stages), then records the result in the core under the lock and `notify_all`s. That
  notification is the per-chunk completion signal: the UPLOAD dispatcher sees chunk i in L2 as
  soon as its fetch finishes, while chunk i+1 is still on the wire.
* `submit()` and `cancel()` run on the caller's thread and only touch the core under the lock.
  Futures are completed by executor threads (compute results, stage exceptions) or by the caller
  (`cancel`). A cancelled request's slots return once its in-flight tasks finish.
* `close()` cancels everything still queued, stops the dispatchers, lets each executor finish
  the tasks already handed to it (their slots are released as they complete), and joins all
  six threads. After close, `slots_in_use()` is all zeros.

Lock order: only one lock exists (`self._cv`); stage functions are never called while holding it.

Stage functions (pluggable; the real model and pool plug in here):
    fetch(request, chunk, host_slot) -> bool        L3 -> L2; False = the pool missed the chunk
    upload(request, chunk, host_slot, device_slot)  L2 -> L1
    compute(request, loaded_chunks, device_slots) -> result
        prefill of everything after the first `loaded_chunks` chunks; device_slots[i] holds
        chunk i for i < loaded_chunks; the rest of device_slots is the compute workspace.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from jkv.scheduling.core import PipelineCore, PipelineRequest, Stage, Task
from jkv.scheduling.policies import Policy, fifo

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    fetch: Callable[[PipelineRequest, int, int], bool]
    upload: Callable[[PipelineRequest, int, int, int], None]
    compute: Callable[[PipelineRequest, int, tuple[int, ...]], Any]


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """What `submit()`'s future resolves to. Times are `time.monotonic()` seconds."""

    request_id: Hashable
    value: Any
    loaded_chunks: int
    submitted_s: float
    compute_started_s: float
    finished_s: float

    @property
    def ttft_s(self) -> float:
        return self.finished_s - self.submitted_s


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """host_slots / device_slots: L2 / L1 capacity in chunks. fetch_depth / upload_depth: tasks a
    loading dispatcher may hand out ahead (>= 2 keeps the link busy between chunks).
    proactive: reserve L1 at the first fetch (CALVO); False = reactive allocation only."""

    host_slots: int
    device_slots: int
    fetch_depth: int = 2
    upload_depth: int = 2
    proactive: bool = True
    host_reserve: int = 1

    def __post_init__(self):
        if self.host_slots < 2:
            raise ValueError(f"{self.host_slots=} must be >= 2 (one slot is kept for requests "
                             "that own L1 space)")
        if self.device_slots < 1:
            raise ValueError(f"{self.device_slots=} must be >= 1")
        if not 1 <= self.host_reserve < self.host_slots:
            raise ValueError(f"{self.host_reserve=} must be in [1, host_slots); 0 can deadlock")
        if self.fetch_depth < 1 or self.upload_depth < 1:
            raise ValueError(f"{self.fetch_depth=} and {self.upload_depth=} must be >= 1")


class LoadingPipeline:
    """Runs requests through fetch/upload/compute concurrently, in `policy` order per stage."""

    def __init__(self, stages: StageFunctions, config: PipelineConfig, policy: Policy | None = None,
                 clock=time.monotonic):
        """clock: `now` on the clock of the requests' arrival_s / deadline_s (used by policies
        with dynamic keys, e.g. LSTF's remaining slack)."""
        self._stages = stages
        self.config = config
        self.policy = policy or fifo()
        self._core = PipelineCore(config.host_slots, config.device_slots,
                                  proactive=config.proactive, host_reserve=config.host_reserve,
                                  progress_key=self.policy.progress_key, clock=clock)
        self._cv = threading.Condition()
        self._closed = False
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self._submitted: dict[Hashable, float] = {}
        self._depth = {Stage.FETCH: config.fetch_depth, Stage.UPLOAD: config.upload_depth,
                       Stage.COMPUTE: 1}
        self._outstanding = {stage: 0 for stage in Stage}
        self._queues = {stage: queue.Queue() for stage in Stage}
        self._threads: list[threading.Thread] = []
        for stage in Stage:
            for role, target in (("dispatcher", self._dispatch_loop),
                                 ("executor", self._execute_loop)):
                thread = threading.Thread(target=target, args=(stage,), daemon=True,
                                          name=f"calvo-{stage.value}-{role}")
                thread.start()
                self._threads.append(thread)

    # -- public API -----------------------------------------------------------------------------
    def submit(self, request: PipelineRequest) -> concurrent.futures.Future:
        """Admit a request; the future resolves to a PipelineResult (or raises the stage error,
        or CancelledError). Raises ValueError if it can never fit, RuntimeError if closed."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[PipelineRequest]) -> list[concurrent.futures.Future]:
        """Admit a burst of requests atomically, so dispatchers see them all before choosing
        (same-instant arrivals are ordered by policy, not by submission race)."""
        requests = list(requests)
        futures = []
        with self._cv:
            if self._closed:
                raise RuntimeError("pipeline is closed; create a new LoadingPipeline")
            ids = [r.request_id for r in requests]
            if len(set(ids)) != len(ids):
                raise ValueError(f"duplicate request ids in one burst: {ids}")
            for request in requests:
                self._core.check(request)
            now = time.monotonic()
            for request in requests:
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_running_or_notify_cancel()
                self._core.add(request, self.policy.key(request.info))
                self._futures[request.request_id] = future
                self._submitted[request.request_id] = now
                futures.append(future)
            self._cv.notify_all()
        return futures

    def cancel(self, request_id: Hashable) -> bool:
        """Stop a request that is not yet computing; its future raises CancelledError."""
        with self._cv:
            if not self._core.drop(request_id):
                return False
            future = self._futures.pop(request_id)
            self._submitted.pop(request_id)
            self._cv.notify_all()
        _cancel_future(future)
        return True

    def set_policy(self, policy: Policy) -> None:
        """Order requests submitted from now on by `policy` (e.g. a refitted cost model); the dynamic
        key (`progress_key`) of every request follows it at the next dispatch, static keys stay."""
        with self._cv:
            self.policy = policy
            self._core.progress_key = policy.progress_key
            self._cv.notify_all()

    def set_depth(self, stage: Stage, depth: int) -> None:
        """Let `stage`'s dispatcher hand out at most `depth` unfinished tasks from now on (tasks
        already handed out stay). A task handed out is committed: with depth 2 the stage's next
        task is chosen while the current one runs, so a request of higher priority that arrives
        meanwhile waits behind both; depth 1 chooses each task when the executor is free."""
        if depth < 1:
            raise ValueError(f"{depth=} must be >= 1")
        with self._cv:
            self._depth[stage] = depth
            self._cv.notify_all()

    def depth(self, stage: Stage) -> int:
        with self._cv:
            return self._depth[stage]

    def slots_in_use(self) -> dict[str, int]:
        with self._cv:
            return self._core.slots_in_use()

    def stats(self):
        with self._cv:
            return dataclasses.replace(self._core.stats)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel unfinished requests, stop all threads, wait for them (idempotent)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            dropped = [rid for rid in self._core.request_ids() if self._core.drop(rid)]
            futures = [self._futures.pop(rid) for rid in dropped]
            self._cv.notify_all()
        for future in futures:
            _cancel_future(future)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.name.endswith("dispatcher"):
                thread.join(max(0.0, deadline - time.monotonic()))
        for stage in Stage:
            self._queues[stage].put(None)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"pipeline threads still running after {timeout_s} s: {alive} "
                               "(a stage function is blocked)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- threads --------------------------------------------------------------------------------
    def _dispatch_loop(self, stage: Stage) -> None:
        while True:
            with self._cv:
                task = None
                while not self._closed:
                    if self._outstanding[stage] < self._depth[stage]:
                        task = self._core.next_task(stage)
                        if task is not None:
                            break
                    self._cv.wait()
                if task is None:
                    return
                self._outstanding[stage] += 1
                # Other dispatchers may now have work (e.g. a proactive L1 reservation).
                self._cv.notify_all()
            self._queues[stage].put(task)

    def _execute_loop(self, stage: Stage) -> None:
        work = self._queues[stage]
        while True:
            task = work.get()
            if task is None:
                return
            self._execute(task)

    def _execute(self, task: Task) -> None:
        stages, request = self._stages, task.request
        with self._cv:
            if self._core.is_dropped(request.request_id):
                # Cancelled while queued: skip the work, just give the slots back.
                self._outstanding[task.stage] -= 1
                self._core.complete(task, ok=False)
                self._cv.notify_all()
                return
        started = time.monotonic()
        try:
            if task.stage is Stage.FETCH:
                value = bool(stages.fetch(request, task.chunk, task.host_slot))
            elif task.stage is Stage.UPLOAD:
                value = stages.upload(request, task.chunk, task.host_slot, task.device_slot)
            else:
                value = stages.compute(request, task.loaded_chunks, task.device_slots)
        except Exception as exc:  # noqa: BLE001 - any stage error fails only its request
            log.exception("%s failed for request %r", task.stage.value, request.request_id)
            with self._cv:
                self._outstanding[task.stage] -= 1
                self._core.fail(task)
                future = self._futures.pop(request.request_id, None)
                self._submitted.pop(request.request_id, None)
                self._cv.notify_all()
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        finished = time.monotonic()
        with self._cv:
            self._outstanding[task.stage] -= 1
            ok = value if task.stage is Stage.FETCH else True
            done = self._core.complete(task, ok=ok)
            future = submitted = None
            if done is not None:
                future = self._futures.pop(request.request_id)
                submitted = self._submitted.pop(request.request_id)
            self._cv.notify_all()
        if future is not None:
            future.set_result(PipelineResult(request.request_id, value, task.loaded_chunks,
                                             submitted, started, finished))


def _cancel_future(future: concurrent.futures.Future) -> None:
    # A running future cannot be .cancel()ed; complete it with the same exception instead.
    if not future.done():
        future.set_exception(concurrent.futures.CancelledError())


def run_serialized(requests: Iterable[PipelineRequest], stages: StageFunctions,
                   host_slots: int, device_slots: int) -> list[PipelineResult]:
    """The non-pipelined reference (vLLM + LMCache-like): one request at a time, in the given
    order, all fetches, then all uploads, then compute — on the caller's thread.

    Uses slots 0..n-1 of each level; raises ValueError if a request does not fit.
    """
    results = []
    for request in requests:
        if request.num_chunks > host_slots or request.device_need > device_slots:
            raise ValueError(f"request {request.request_id!r} needs {request.num_chunks} L2 and "
                             f"{request.device_need} L1 slots; have {host_slots} and "
                             f"{device_slots}")
        submitted = time.monotonic()
        loaded = request.num_chunks
        for chunk in range(request.num_chunks):
            if not stages.fetch(request, chunk, chunk):
                loaded = chunk
                break
        for chunk in range(loaded):
            stages.upload(request, chunk, chunk, chunk)
        started = time.monotonic()
        value = stages.compute(request, loaded, tuple(range(request.device_need)))
        results.append(PipelineResult(request.request_id, value, loaded, submitted, started,
                                      time.monotonic()))
    return results
