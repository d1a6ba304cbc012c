"""Per-request state of the decode worker and its per-step clock (pure bookkeeping, no JAX).

`LiveRequest` is one planned request from its plan to its output: what was planned (pool,
block order, Kr, owner), what arrived from its prefill worker (first token, metadata, bytes),
what the decode loop has produced, and the flags of its lifecycle:

    planned -> handoff set -> running (joined at a step boundary) -> completed
                  |                \\-> released (owner told to drop its KV: all LOCAL, or recomputed)
                  \\-> error (owner failed, bad frame, cancelled) -> completed with "error"

Which thread writes what (jkv/disagg/decode_worker.py "Threads"): the transport's notify thread
writes the hand-off fields (`meta`, `first_token`, `t_first`, `prefill_s`, `bytes`, `error`) and
sets `handoff`; `cancel` (any thread) sets `cancelled`, `error` and `released` under `free_lock`;
everything else belongs to the engine thread.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from jkv.engine import Request
from jkv.kvbuffers.geometry import BlockGeometry
from jkv.outputs import RequestMetrics, RequestOutput

CAPACITY_BUCKET = 256


def bucket(tokens: int) -> int:
    """A pool capacity N_cap for `tokens` tokens: a CAPACITY_BUCKET multiple (bounds the recompiles)."""
    return -(-tokens // CAPACITY_BUCKET) * CAPACITY_BUCKET


def error_output(req: Request, error: str) -> RequestOutput:
    m = RequestMetrics(prompt_tokens=len(req.prompt_token_ids), extra=dict(error=error))
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), "", [], "error", m)


class RequestFailed(RuntimeError):
    pass


class OwnerDown(Exception):
    """A transport error talking to one prefill worker (the fetch lanes raise it, the step's
    failure policy decides: refetch without a cancelled request, or fail the owner's requests)."""

    def __init__(self, owner: str, error: Exception):
        super().__init__(f"prefill worker {owner!r} failed: {error}")
        self.owner, self.error = owner, error


class StepPhases:
    """Per-step wall-clock split of the decode loop (seconds): where a step's time goes.
    Phases: qkv, select, split, remote_issue, local, remote_wait, scatter, attend, spec, logits.
    `remote_wait` is the time the step blocked on on-demand replies after the local lane.
    Counters (ints, keys ending in "_n"): od_bytes_n (on-demand reply bytes), selected_n,
    remote_n (selected entries, all requests), fetches_n (fetch RPCs), cpu_us_n (process CPU)."""

    def __init__(self, probe=None, on_end=None):
        self.probe = probe  # optional: () -> CPU seconds of other processes (a benchmark's prefill workers)
        self.on_end = on_end  # optional: (the step's dict) -> None at each end_step (a server's /metrics)
        self.steps: list[dict] = []
        self._t = time.perf_counter()
        self._cpu = time.process_time()

    MAX_STEPS = 8192  # a server's running set may never empty: keep the latest steps only

    def new_step(self) -> None:
        if len(self.steps) >= self.MAX_STEPS:
            del self.steps[:self.MAX_STEPS // 2]
        self.steps.append({})
        self._t = time.perf_counter()
        self._cpu = time.process_time()
        self._engine_cpu = time.thread_time()
        self._probed = self.probe() if self.probe is not None else None

    def end_step(self) -> None:
        """cpu_us_n: CPU time of this whole process (every thread: engine, lookahead helper,
        transport, XLA) during the step, in microseconds; engine_cpu_us_n: the calling (engine)
        thread's; probe_cpu_us_n: the probe's. Called on the thread that called new_step."""
        self.count("cpu_us_n", (time.process_time() - self._cpu) * 1e6)
        self.count("engine_cpu_us_n", (time.thread_time() - self._engine_cpu) * 1e6)
        if self.probe is not None and self._probed is not None:
            self.count("probe_cpu_us_n", (self.probe() - self._probed) * 1e6)
        if self.on_end is not None and self.steps:
            self.on_end(self.steps[-1])

    def count(self, key: str, n: int) -> None:
        if self.steps:
            self.steps[-1][key] = self.steps[-1].get(key, 0) + int(n)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if self.steps:
            cur = self.steps[-1]
            cur[phase] = cur.get(phase, 0.0) + now - self._t
        self._t = now


@dataclasses.dataclass(frozen=True)
class Submission:
    req: Request
    on_token: object  # (request_id, token_id) -> None, or None
    on_done: object  # (RequestOutput) -> None, or None
    owner: str | None
    t0: float


@dataclasses.dataclass(eq=False)
class LiveRequest:
    req: Request
    rid: str
    kv: object  # RequestKV
    geometry: BlockGeometry
    owner: str | None
    order: np.ndarray
    kr: int
    meta: dict = dataclasses.field(default_factory=dict)  # layer -> list of leaves [1, ...]
    handoff: threading.Event = dataclasses.field(default_factory=threading.Event)
    first_token: int | None = None
    t_first: float | None = None
    prefill_s: float = 0.0
    error: str | None = None
    recomputed: bool = False
    released: bool = False
    finished: bool = False
    selected: int = 0
    remote: int = 0
    step_remote: list = dataclasses.field(default_factory=list)
    step_selected: list = dataclasses.field(default_factory=list)
    bytes: dict = dataclasses.field(default_factory=dict)
    fetch_bytes: int = 0
    fetched: np.ndarray | None = None  # bool[L, H_kv, N_cap]: rows already fetched on demand (KV reuse)
    # FetchCall.seq of replies kept since the last "spec", which confirms them (served_rows.py); None: no speculation
    kept_fetches: set | None = dataclasses.field(default_factory=set)
    # Landing (decode_pages.py): which prompt rows are in the device pages, and layers fully landed.
    on_device: np.ndarray | None = None  # bool[L, H_kv, N]: mirrors the device mask's 1s over the prompt
    landed: np.ndarray | None = None  # bool[L]: every prompt row of the layer is on the device
    compression: object = None  # compression.policy.Choice, fixed for the request's KV movement (KVServe §6)
    keep: np.ndarray | None = None  # bool[L, H_kv, N]: prompt rows a token-dropping profile kept (hand-off)
    prefix_hit: int = 0  # leading prompt tokens in shared cached device pages (jkv/disagg/prefix_split.py)
    codec_s: dict = dataclasses.field(default_factory=dict)  # "encode" (prefill side) / "decode" (here) seconds
    t_hand_in: float = 0.0
    cancelled: bool = False
    # Decode state (engine thread): set when the request joins the running set.
    t0: float = 0.0
    on_token: object = None
    on_done: object = None
    checker: object = None  # engine.StopChecker
    current: int = 0  # the last sampled token (the next step's input)
    position: int = 0  # the slot the next token's KV is written to
    steps: int = 0  # decode steps run (the sampler's per-request step counter)
    gen: list = dataclasses.field(default_factory=list)
    times: list = dataclasses.field(default_factory=list)
    step_phases: list = dataclasses.field(default_factory=list)  # the StepPhases dicts of its steps
    completed: bool = False  # its output went to on_done; its KV is freed
    free_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)  # release, then unregister
    staging_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # a "ckv" frame vs its free

    @property
    def active(self) -> bool:
        return self.error is None and not self.finished

    @property
    def fetchable(self) -> bool:
        """Its owner still holds KV this worker may fetch (active and not released)."""
        return self.active and not self.released

    def output(self, done, mode: str) -> RequestOutput:
        """done: (finish_reason, token ids, text) from the stop checker, or ("error", [], "")."""
        reason, ids, text = done
        if reason == "error":
            return error_output(self.req, self.error)
        bytes_ = dict(proactive=0, speculative=0, on_demand=0, metadata=0)
        bytes_.update({k: v for k, v in self.bytes.items() if k in bytes_})
        if self.compression is None or self.compression.on_demand is None:  # else: the owner's wire bytes
            bytes_["on_demand"] = max(bytes_["on_demand"], self.fetch_bytes)
        m = RequestMetrics.from_token_times(
            self.geometry.num_tokens, self.times,
            on_demand_ratio=self.remote / self.selected if self.selected else 0.0,
            step_on_demand_ratio=[r / s if s else 0.0 for r, s in zip(self.step_remote, self.step_selected)],
            bytes=bytes_, kr=self.kr, blocks=int(len(self.order)), prefill_s=self.prefill_s, owner=self.owner,
            recomputed=self.recomputed, mode=mode, step_phases=self.step_phases, prefix_hit_tokens=self.prefix_hit,
            **({} if self.compression is None else self._compression_extra()))
        return RequestOutput(self.req.request_id, self.req.prompt, list(self.req.prompt_token_ids), text, ids,
                             reason, m)

    def _compression_extra(self) -> dict:
        """The pipeline, why it was chosen (`policy.Choice.reason`) and the codec seconds of this request (encode: the prefill worker's, during the
        prefill; decode: this worker's, of every compressed frame)."""
        c = self.compression
        return dict(compression=c.spec_id, compression_reason=c.reason,
                    compression_paths=c.paths.labels() if c.paths is not None else {},
                    encode_s=float(self.codec_s.get("encode", 0.0)), decode_s=float(self.codec_s.get("decode", 0.0)))
