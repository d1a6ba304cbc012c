"""Decode worker: receives prefilled requests and decodes them with selective KV transfer.

    worker = DecodeWorker(model, selector, TransferConfig(mode="smartgen"), secret=...)
    worker.connect(["127.0.0.1:PORT", ...])            # one or more prefill workers
    outputs = worker.generate(requests)                  # static batch, like DenseEngine

    worker.submit(request, on_token=..., on_done=...)    # continuous admission (a server):
    while serving: worker.step(wait=0.5)                 # the engine thread drives the batch

Per request (SmartGen §4; DESIGN.md "SmartGen transfer"):

  1. plan: a host pool `f32[2, L, H_kv, N_cap, D]` plus its KV mask `i8[L, N_cap]` (REMOTE over
     the prompt, PAD after) registered as regions "kv/<rid>", "mask/<rid>"; the block order of
     the proactive strategy and Kr (Eq. 2 from the profile's Tp and the link estimate); an owner
     prefill worker (round robin over live workers). "prefill" goes out (one notify per owner
     for the requests planned together).
  2. its "handoff" (first token) arrives. Prefill writes land in the pool and flip mask bytes to
     LOCAL behind our back (transport reader threads); a LOCAL byte is always safe.
  3. at the next step boundary it joins the running set; every decode step, per layer (with
     lookahead, layer l+1's hinted remote rows are already on the wire, see lookahead.py): q, k, v →
     the new k, v go into the pool (LOCAL) → select → `split_reorder` against a snapshot of the
     mask → the remote lane (one "fetch" RPC per owner with the remote-first prefix of each row)
     and the local lane (numpy gather of the pool) run concurrently (serially in
     `partial`/`+profile`) → remote rows are scattered into their canonical slots → attention over
     the selected entries in selection order, so the output never depends on which lane supplied
     a row (the mode invariant). With speculation a "spec" trigger goes to every owner at the
     start of each layer, for requests past their first step.
  4. when its mask is all LOCAL, decode calls "free" on its owner; when it finishes (or fails, or
     is cancelled) it leaves the running set at the step boundary, its regions are unregistered
     and its pool freed.

The running set: requests keep their own pool (N_cap = prompt + max_tokens rounded up to
CAPACITY_BUCKET); the batch's N_cap is the largest member's. The selector metadata of the
running set is one batched pytree per layer (leading axis B, updated by `append` each step); when
membership changes each staying member's rows go back to its `_Live.meta` and the batch is
re-stacked (`_restack`). `generate()` is a static batch on the same step code: one shared N_cap,
every hand-off awaited, then `_decode_step` until its requests are done.

A dead owner fails its requests with RequestFailed's message (or, with on_failure="recompute",
their prompt KV is recomputed locally) and the other requests continue.

Threads. One engine thread drives the worker: `generate` or `step` (never both at once, never
two threads); it runs planning, hand-in, admission, the decode steps and the `on_token` /
`on_done` callbacks. `submit` (any thread) only puts the request on a `queue.SimpleQueue` that
the engine thread drains at the start of each `step` (and between `generate`'s steps).
`cancel` (any thread) frees a planned request's KV at once (an RPC to its owner, then the
regions and pool here; the engine thread keeps its own references to the buffers, so a step in
flight reads valid memory) and flags it, so the engine thread stops fetching for it and retires
it at the next step boundary; a queued one is dropped when drained. `_live`, `_queued` and
`_cancelled` are guarded by `_lock`. The transport's notify thread runs the "meta", "handoff",
"ckv" and "failed" handlers, which only store into per-request state and set events. With layer
lookahead (TransferConfig.lookahead, on in smartgen mode) one helper thread computes layer l+1's
hint selection and sends its prefetch while the engine thread runs layer l; it reads only layer
l+1's mask, fetched rows and metadata, and the engine thread joins it before touching them
(jkv/disagg/lookahead.py).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv.disagg import protocol as proto
from jkv.disagg.hint import make_hint as make_set_hint
from jkv.disagg.lookahead import LayerLookahead
from jkv.disagg.selectors import needs_metadata
from jkv.engine import Request, _StopChecker, check_context
from jkv.kvcache.geometry import LOCAL, PAD, REMOTE, BlockGeometry
from jkv.kvcache.pool import HostKVPool
from jkv.outputs import RequestMetrics, RequestOutput
from jkv.sampling import sample_tokens
from jkv.transfer.plan import TransferConfig, proactive_order
from pallas_kernels import dispatch
from transport import Endpoint, RemoteError, TransportError

log = logging.getLogger(__name__)

CAPACITY_BUCKET = 256


def _bucket(tokens: int) -> int:
    """A pool capacity N_cap for `tokens` tokens: a CAPACITY_BUCKET multiple (bounds the recompiles)."""
    return -(-tokens // CAPACITY_BUCKET) * CAPACITY_BUCKET


def _error_output(req: Request, error: str) -> RequestOutput:
    m = RequestMetrics(prompt_tokens=len(req.prompt_token_ids), extra=dict(error=error))
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), "", [], "error", m)


# Rows carry their own mask (token mask + rows this worker already fetched): one row per "batch".
# One module-level jit, so every DecodeWorker (a benchmark makes one per run) shares its compiled
# programs: a per-instance jit recompiled on each run's first step (0.6-1.2 s of its TTST).
_split_rows = jax.jit(functools.partial(dispatch.split_reorder, heads_per_batch=1))


class RequestFailed(RuntimeError):
    pass


class _Phases:
    """Per-step wall-clock split of the decode loop (seconds): where a step's time goes.
    Phases: qkv, select, split, remote_issue, local, remote_wait, scatter, attend, spec, logits.
    `remote_wait` is the time the step blocked on on-demand replies after the local lane.
    Counters (ints, keys ending in "_n"): od_bytes_n (on-demand reply bytes), selected_n,
    remote_n (selected entries, all requests), fetches_n (fetch RPCs), cpu_us_n (process CPU)."""

    def __init__(self, probe=None):
        self.probe = probe  # optional: () -> CPU seconds of other processes (a benchmark's prefill workers)
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

    def count(self, key: str, n: int) -> None:
        if self.steps:
            self.steps[-1][key] = self.steps[-1].get(key, 0) + int(n)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if self.steps:
            cur = self.steps[-1]
            cur[phase] = cur.get(phase, 0.0) + now - self._t
        self._t = now


class _OwnerDown(Exception):
    def __init__(self, owner: str, error: Exception):
        super().__init__(f"prefill worker {owner!r} failed: {error}")
        self.owner, self.error = owner, error


@dataclasses.dataclass(frozen=True)
class _Submission:
    req: Request
    on_token: object  # (request_id, token_id) -> None, or None
    on_done: object  # (RequestOutput) -> None, or None
    owner: str | None
    t0: float


@dataclasses.dataclass(eq=False)
class _Live:
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
    compression: object = None  # compression.policy.Choice, fixed for the request's KV movement (KVServe §6)
    t_hand_in: float = 0.0
    cancelled: bool = False
    # Decode state (engine thread): set when the request joins the running set.
    t0: float = 0.0
    on_token: object = None
    on_done: object = None
    checker: object = None  # engine._StopChecker
    current: int = 0  # the last sampled token (the next step's input)
    position: int = 0  # the slot the next token's KV is written to
    steps: int = 0  # decode steps run (the sampler's per-request step counter)
    gen: list = dataclasses.field(default_factory=list)
    times: list = dataclasses.field(default_factory=list)
    step_phases: list = dataclasses.field(default_factory=list)  # the _Phases dicts of its steps
    completed: bool = False  # its output went to on_done; its KV is freed
    free_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)  # release, then unregister

    @property
    def active(self) -> bool:
        return self.error is None and not self.finished


class DecodeWorker:
    def __init__(self, model, selector, transfer: TransferConfig, *, secret: str, backend: str = "tcp",
                 profile=None, oracle_profile=None, on_failure: str = "fail", timeout: float = 5.0,
                 name: str = "decode-0", compression=None):
        if on_failure not in ("fail", "recompute"):
            raise ValueError(f"{on_failure=} must be 'fail' or 'recompute'")
        self.model, self.selector, self.transfer = model, selector, transfer
        self.profile, self.oracle_profile, self.on_failure = profile, oracle_profile, on_failure
        if transfer.needs_profile and transfer.kr_fraction is None and profile is None:
            raise ValueError(f"mode {transfer.mode!r} with strategy {transfer.strategy!r} needs an importance "
                             "profile: create one with `jkv profile` and pass it")
        cfg = model.cfg
        self.pool = HostKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.endpoint = Endpoint(name, backend, secret=secret, timeout=timeout, op_timeout=None,
                                 max_message=1 << 30)
        self.endpoint.on_notify("meta", self._on_meta)
        self.endpoint.on_notify("handoff", self._on_handoff)
        self.endpoint.on_notify("failed", self._on_failed)
        self.compression = compression  # jkv.compression.policy.CompressionPolicy or None ("off")
        self.endpoint.on_notify("ckv", self._on_compressed)
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self.owners: list[str] = []
        self._main_of: dict[str, str] = {}  # owner -> its main transport address
        self._bulk_of: dict[str, str] = {}  # owner -> the peer name of its bulk connection
        self.phases = _Phases()
        self._split = _split_rows
        self._lookahead = LayerLookahead(self.endpoint, cfg.num_kv_heads, cfg.head_dim)
        self._hint = (make_set_hint(selector, transfer.hint_margin)  # None: the hint calls select
                      if transfer.layer_lookahead and transfer.hint_margin is not None else None)
        # Continuous admission: submissions and cancels of queued ones cross threads via these;
        # everything below them is engine-thread state.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: dict[str, int] = {}  # request_id -> submissions not yet drained (under _lock)
        self._cancelled: set[str] = set()  # queued request ids cancelled before planning (under _lock)
        self._pending: list[_Live] = []  # handed in, hand-off not yet admitted
        self._running: list[_Live] = []  # the decode batch, in metadata row order
        self._batch_meta: list | None = None  # per layer: selector metadata of _running, [B, ...]
        self._next_owner = 0

    # ---------------------------------------------------------------- wiring
    def connect(self, addresses) -> list[str]:
        """addresses: what each prefill worker's listen() returned ("main|bulk")."""
        for address in addresses:
            self.connect_one(address)
        return list(self.owners)

    def connect_one(self, address: str, connect_timeout: float | None = None) -> str:
        """Connect to one prefill worker ("main|bulk", or a restarted one: its lost connections
        are replaced) and return its name. Raises TransportError when it cannot be reached."""
        main, _, bulk = str(address).partition("|")
        kw = {} if connect_timeout is None else dict(connect_timeout=connect_timeout)
        peers = self.endpoint.peers
        name = next((o for o in self.owners if self._main_of.get(o) == main and o in peers and peers[o].alive), None)
        if name is None:
            name = self.endpoint.connect(main, **kw).name
            self._main_of[name] = main
        if bulk and not (self._bulk_of.get(name) in peers and peers[self._bulk_of[name]].alive):
            self._bulk_of[name] = self.endpoint.connect(bulk, **kw).name
        if name not in self.owners:
            self.owners.append(name)
        return name

    def close(self) -> None:
        self.endpoint.close()
        self._lookahead.close()

    def _alive_owners(self) -> list[str]:
        return [o for o in self.owners if self._owner_alive(o)]

    def _owner_alive(self, owner) -> bool:
        """Both of its connections are up: its hand-offs, metadata and pushes travel on the bulk
        one, so a worker whose bulk connection died can no longer complete a request's hand-off."""
        peers = self.endpoint.peers
        p = peers.get(owner)
        if p is None or not p.alive:
            return False
        bulk = self._bulk_of.get(owner)
        return bulk is None or (bulk in peers and peers[bulk].alive)

    # ---------------------------------------------------------------- notifications
    def _get(self, rid):
        with self._lock:
            return self._live.get(rid)

    def _on_meta(self, note):
        header, payload = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is not None:
            lv.meta[int(header["layer"])] = proto.unpack_leaves(header, payload)
            lv.bytes["metadata"] = lv.bytes.get("metadata", 0) + len(note.payload)

    def _on_handoff(self, note):
        header, _ = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is not None:
            lv.first_token, lv.t_first, lv.prefill_s = header["first_token"], header["t_first"], header["prefill_s"]
            lv.bytes["proactive"] = header["bytes"]["proactive"]
            if "link" in header and self.compression is not None:
                self.compression.observe_link(header["link"]["bytes"], header["link"]["busy_s"])
                self.compression.observe(lv.compression, time.time() - lv.t_hand_in)
            lv.handoff.set()

    def _on_compressed(self, note):
        """Compressed KV chunks: decode into the pool, then flip their mask bytes (kv_transfer)."""
        from jkv.compression.kv_transfer import apply_frame

        header, payload = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is None or lv.error is not None:
            return
        try:
            apply_frame(header, payload, lv.kv.kv, lv.kv.mask)
        except ValueError as e:
            lv.error = f"request {lv.req.request_id}: bad compressed KV from {note.peer!r}: {e}"
            lv.handoff.set()

    def _on_failed(self, note):
        header, _ = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is not None:
            lv.error = f"request {lv.req.request_id}: {header['error']}"
            lv.handoff.set()

    # ---------------------------------------------------------------- planning
    def _plan(self, req: Request, rid: str, capacity: int, owner: str | None) -> _Live:
        cfg = self.model.cfg
        n = len(req.prompt_token_ids)
        geometry = BlockGeometry(n, cfg.num_layers, self.transfer.max_blocks)
        strategy = self.transfer.effective_strategy
        importance = None
        if strategy in ("profile", "oracle") and self.transfer.mode != "full":
            prof = self.oracle_profile if strategy == "oracle" else self.profile
            if prof is None:
                raise ValueError(f"strategy {strategy!r} needs a profile")
            importance = prof.importance_for(geometry)
        order = proactive_order(strategy if self.transfer.mode != "full" else "sequential", geometry, importance,
                                self.transfer.seed)
        request_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * n * cfg.head_dim * 4
        tp = self.profile.prefill_time(n) if self.profile is not None else None
        kr = min(len(order), self.transfer.kr(geometry, tp, request_bytes, self._metadata_bytes(n)))
        choice = self.compression.choose(request_bytes, tp or 0.0) if self.compression is not None else None
        kv = self.pool.allocate(rid, n, capacity)
        self.endpoint.register(proto.kv_region(rid), kv.kv)
        self.endpoint.register(proto.mask_region(rid), kv.mask)
        return _Live(req, rid, kv, geometry, owner, order, kr,
                     fetched=np.zeros((cfg.num_layers, cfg.num_kv_heads, capacity), bool), compression=choice)

    def _metadata_bytes(self, n: int) -> int:
        """Bytes of selector metadata the prefill worker ships for an n-token prompt (all layers)."""
        sel, cfg = self.selector, self.model.cfg
        return sum(sel.metadata_nbytes(layer, cfg.num_kv_heads, cfg.head_dim, n)
                   for layer in range(sel.config.dense_layers, cfg.num_layers))

    # ---------------------------------------------------------------- static batch
    def generate(self, requests: list[Request], t0: float | None = None, on_token=None,
                 owner_of=None) -> list[RequestOutput]:
        """Decode a static batch; returns one output per request (finish_reason "error" with
        metrics.extra["error"] for a request whose prefill worker failed).

        Every request is planned with one shared capacity and handed in at once, and decoding
        starts when every hand-off has arrived; the steps are the ones `step()` runs. Requests
        `submit`ted meanwhile join the running set and may outlive this call (drive them with `step`).

        Serving hooks: `on_token(request_id, token_id)` is called on this thread for every
        generated token as it is sampled (streaming); `owner_of(request)` may name the live
        prefill worker that should own a request's KV (None or a dead one: round robin)."""
        t0 = time.time() if t0 is None else t0
        for r in requests:
            check_context(self.model, r)
        capacity = _bucket(max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests))
        owners = self._alive_owners()
        if not owners and self.on_failure != "recompute":
            raise RequestFailed("no live prefill worker is connected; start `jkv prefill-worker` processes "
                                "or use on_failure='recompute'")
        outputs: dict[int, RequestOutput] = {}
        lives = []
        try:
            for b, r in enumerate(requests):
                want = owner_of(r) if owner_of is not None else None
                lv = self._plan(r, self._rid(r), capacity,
                                want if want in owners else owners[b % len(owners)] if owners else None)
                lv.t0, lv.on_token, lv.on_done = t0, on_token, functools.partial(outputs.__setitem__, b)
                with self._lock:
                    self._live[lv.rid] = lv
                lives.append(lv)
            self._pending.extend(lives)
            self._hand_in(lives)
            self._await_handoffs(lives)
            self._admit(lives)
            while len(outputs) < len(lives):
                assert self._running, "requests of this batch left the running set without an output"
                self._decode_step()
                self._drain(0.0)
            return [outputs[b] for b in range(len(lives))]
        finally:
            for lv in lives:
                if not lv.completed:
                    self._finish_request(lv, unregister=True)
                    self._forget(lv)

    # ---------------------------------------------------------------- continuous admission
    def submit(self, request: Request, *, on_token=None, on_done=None, owner: str | None = None,
               t0: float | None = None) -> None:
        """Queue a request for the running set (any thread). The engine thread plans it and hands
        it to a prefill worker at its next `step`, and it joins the decode batch at the first step
        boundary after its hand-off. `on_token(request_id, token_id)` and `on_done(RequestOutput)`
        run on the engine thread; `on_done` is called exactly once (also for errors and cancels).
        `owner` names the prefill worker that should own its KV (unknown or dead: round robin).
        Raises PromptTooLongError (a ValueError) at once when the request does not fit the model's context."""
        check_context(self.model, request)
        with self._lock:
            self._queued[request.request_id] = self._queued.get(request.request_id, 0) + 1
        self._inbox.put(_Submission(request, on_token, on_done, owner, time.time() if t0 is None else t0))

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet done (queued, awaiting their hand-off, or decoding)."""
        with self._lock:
            return sum(self._queued.values()) + len(self._live)

    def step(self, wait: float = 0.0) -> bool:
        """Engine thread: admit what arrived, then run one decode step of the running set.

        Idle (nothing pending or running), it blocks up to `wait` seconds for a submission.
        Returns whether requests remain in flight. An engine error fails every request in flight
        (their `on_done` gets finish_reason "error") and is logged, not raised."""
        try:
            self._drain(0.0 if self._pending or self._running else wait)
            self._poll_handoffs()
            arrived = [lv for lv in self._pending if lv.handoff.is_set()]
            if arrived:
                self._admit(arrived)
            if self._running:
                self._decode_step()
            elif self._pending:
                self._pending[0].handoff.wait(0.01)
        except Exception as e:  # noqa: BLE001 - every request in flight is failed with the reason
            log.exception("decode step failed; failing %d requests", len(self._running) + len(self._pending))
            for lv in self._running + self._pending:
                lv.error = lv.error or f"request {lv.req.request_id}: engine error: {e}"
                self._complete(lv, ("error", [], ""))
            self._running, self._pending, self._batch_meta = [], [], None
        return bool(self._running or self._pending or not self._inbox.empty())

    def _rid(self, r: Request) -> str:
        return f"{r.request_id}.{id(self)}.{time.monotonic_ns()}"

    def _drain(self, wait: float) -> None:
        """Plan and hand in the queued submissions; a queued one cancelled meanwhile is dropped."""
        subs = []
        try:
            item = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            while True:
                subs.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        if not subs:
            return
        owners = self._alive_owners()
        lives = []
        for s in subs:
            rid = s.req.request_id
            with self._lock:
                self._queued[rid] -= 1
                if not self._queued[rid]:
                    del self._queued[rid]
                cancelled = rid in self._cancelled
                self._cancelled.discard(rid)
            error = f"request {rid}: cancelled" if cancelled else None
            if error is None and not owners and self.on_failure != "recompute":
                error = (f"request {rid}: no live prefill worker is connected; start `jkv prefill-worker` "
                         "processes or use on_failure='recompute'")
            if error is None:
                owner = s.owner if s.owner in owners else owners[self._next_owner % len(owners)] if owners else None
                self._next_owner += 1
                try:
                    capacity = _bucket(len(s.req.prompt_token_ids) + s.req.params.max_tokens)
                    lv = self._plan(s.req, self._rid(s.req), capacity, owner)
                except Exception as e:  # noqa: BLE001 - a request that cannot be planned fails alone
                    error = f"request {rid}: {e}"
            if error is not None:
                if s.on_done is not None:
                    s.on_done(_error_output(s.req, error))
                continue
            lv.t0, lv.on_token, lv.on_done = s.t0, s.on_token, s.on_done
            with self._lock:
                self._live[lv.rid] = lv
            lives.append(lv)
        self._pending.extend(lives)
        self._hand_in(lives)

    def _poll_handoffs(self) -> None:
        """Non-blocking `_await_handoffs`: a request whose owner died before its hand-off fails or
        is recomputed (on_failure)."""
        for lv in list(self._pending):
            if not lv.handoff.is_set() and (lv.owner is None or not self._owner_alive(lv.owner)):
                self._owner_failed(lv.owner, TransportError("connection lost before the hand-off"), self._pending)
                lv.handoff.set()  # an owner of None (recompute) is handled by `_admit`

    def _admit(self, arrived) -> None:
        """Step boundary: requests whose hand-off arrived join the running set (their first token
        is the one prefill sampled); failed ones complete with an error."""
        joined = []
        for lv in arrived:
            self._pending.remove(lv)
            if not lv.cancelled and not lv.recomputed and (
                    lv.owner is None or (lv.error is not None and self.on_failure == "recompute")):
                self._recompute(lv, before_handoff=True)
            if lv.error is not None:
                self._complete(lv, ("error", [], ""))
                continue
            lv.checker = _StopChecker(self.model.tokenizer, lv.req.params, self.model.cfg.eos_token_ids)
            lv.current, lv.position = lv.first_token, lv.geometry.num_tokens
            lv.gen, lv.times = [lv.first_token], [(lv.t_first or time.time()) - lv.t0]
            joined.append(lv)
        if not joined:
            return
        if not self._running:
            self.phases = _Phases(self.phases.probe)
        self._restack(self._running + joined)
        for lv in joined:
            self._maybe_release(lv)
        for lv in joined:
            if lv.on_token is not None:
                lv.on_token(lv.req.request_id, lv.gen[0])
            reason, ids, text = lv.checker.finish(lv.gen)
            if reason:
                self._complete(lv, (reason, ids, text))
        self._leave()

    def _leave(self) -> None:
        """Step boundary: completed requests leave the running set (metadata is re-stacked)."""
        if any(lv.completed for lv in self._running):
            self._restack([lv for lv in self._running if not lv.completed])

    def _complete(self, lv, done) -> None:
        """A request is done: free its KV on both sides and hand its output to `on_done`."""
        lv.finished = done[0] != "error"
        lv.completed = True
        self._finish_request(lv, unregister=True)
        self._forget(lv)
        if lv.on_done is not None:
            lv.on_done(self._output(lv, done))

    def _forget(self, lv) -> None:
        with self._lock:
            self._live.pop(lv.rid, None)
        if lv in self._pending:
            self._pending.remove(lv)

    def _hand_in(self, lives):
        by_owner: dict[str, list] = {}
        spec_fraction = self.transfer.spec_ratio / (self.model.cfg.num_layers if self.transfer.spec_every_layer else 1)
        for lv in lives:
            if lv.owner is None:
                continue
            p = lv.req.params
            by_owner.setdefault(lv.owner, []).append(dict(
                rid=lv.rid, tokens=list(lv.req.prompt_token_ids), capacity=lv.kv.capacity,
                order=lv.order.tolist(), kr=lv.kr, max_blocks=self.transfer.max_blocks,
                spec_cap=max(1, int(np.ceil(spec_fraction * lv.geometry.num_blocks))),
                sampling=dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                              seed=p.seed if p.seed is not None else int(np.random.randint(0, 2**31)))))
            if lv.compression is not None:
                by_owner[lv.owner][-1]["compression"] = lv.compression.spec_id
                lv.t_hand_in = time.time()
        for owner, batch in by_owner.items():
            try:
                self.endpoint.peer(owner).notify("prefill", proto.pack(dict(requests=batch))).wait()
            except (KeyError, TransportError) as e:
                self._owner_failed(owner, e, lives)

    def _await_handoffs(self, lives):
        for lv in lives:
            while not lv.handoff.wait(0.05):
                if lv.owner is None or not self._owner_alive(lv.owner):
                    self._owner_failed(lv.owner, TransportError("connection lost before the hand-off"), lives)
                    break

    def _owner_failed(self, owner, error, lives):
        for lv in lives:
            if lv.owner != owner or not lv.active or lv.released:
                continue
            if self.on_failure == "recompute":
                log.warning("prefill worker %r failed (%s): recomputing request %s locally", owner, error,
                            lv.req.request_id)
                self._recompute(lv, before_handoff=not lv.handoff.is_set() or lv.first_token is None)
            else:
                lv.error = (f"request {lv.req.request_id}: prefill worker {owner!r} failed while it held this "
                            f"request's KV ({error}); retry the request or use on_failure='recompute'")
                lv.handoff.set()

    def _recompute(self, lv, before_handoff: bool):
        """Recompute the prompt KV on the decode side (on_failure="recompute")."""
        n = lv.geometry.num_tokens
        tokens = np.asarray([lv.req.prompt_token_ids], np.int32)
        t = time.time()

        def keep(layer, K, V):
            lv.kv.kv[0, layer, :, :n] = np.asarray(K, np.float32)[0, :, :n]
            lv.kv.kv[1, layer, :, :n] = np.asarray(V, np.float32)[0, :, :n]

        logits, _ = self.model.prefill(tokens, np.asarray([n], np.int32), on_layer=keep)
        lv.kv.mask[:, :n] = LOCAL
        lv.recomputed, lv.error, lv.owner, lv.released = True, None, None, True
        if before_handoff:
            lv.meta = {}
            lv.first_token = int(np.asarray(logits).argmax(-1)[0])
            lv.t_first, lv.prefill_s = time.time(), time.time() - t
            lv.handoff.set()

    # ---------------------------------------------------------------- metadata
    def _metadata(self, lives, capacity):
        cfg, sel = self.model.cfg, self.selector
        B, H, D = len(lives), cfg.num_kv_heads, cfg.head_dim
        lengths = jnp.asarray([lv.geometry.num_tokens for lv in lives], jnp.int32)
        dense_below = cfg.num_layers if sel.is_dense else sel.config.dense_layers
        out = []
        for layer in range(cfg.num_layers):
            if layer < dense_below:
                out.append(None)
                continue
            if not needs_metadata(sel):
                out.append(sel.prepare(layer, jnp.zeros((B, H, capacity, D), jnp.float32), lengths))
                continue
            spec = jax.ShapeDtypeStruct((B, H, capacity, D), jnp.float32)
            target = jax.eval_shape(functools.partial(sel.prepare, layer), spec, lengths)
            leaves_t, treedef = jax.tree_util.tree_flatten(target)
            leaves = [np.zeros(t.shape, t.dtype) for t in leaves_t]
            for b, lv in enumerate(lives):
                if lv.recomputed and layer not in lv.meta:
                    K = jnp.asarray(lv.kv.kv[0][layer][None])
                    lv.meta[layer] = [np.asarray(x) for x in
                                      jax.tree_util.tree_leaves(sel.prepare(layer, K, lengths[b:b + 1]))]
                got = lv.meta.get(layer)
                if got is None:
                    if lv.active:
                        raise RuntimeError(f"request {lv.req.request_id}: no selector metadata for layer {layer}")
                    continue
                for dst, src in zip(leaves, got):
                    region = tuple(slice(0, min(a, s)) for a, s in zip(dst.shape[1:], src.shape[1:]))
                    dst[b][region] = src[0][region]
            out.append(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves]))
        return out

    # ---------------------------------------------------------------- the decode step
    def _restack(self, members) -> None:
        """Membership change at a step boundary: each current member's rows of the batched selector
        metadata go back into its `lv.meta`, then the batch is rebuilt for `members` with
        N_cap = the largest member capacity (each a CAPACITY_BUCKET multiple)."""
        if self._batch_meta is not None and needs_metadata(self.selector):
            keep = {id(lv) for lv in members}
            for b, lv in enumerate(self._running):
                if id(lv) not in keep:
                    continue
                for layer, meta in enumerate(self._batch_meta):
                    if meta is not None:
                        lv.meta[layer] = [np.asarray(x[b:b + 1]) for x in jax.tree_util.tree_leaves(meta)]
        self._running = list(members)
        self._batch_meta = self._metadata(self._running, max(lv.kv.capacity for lv in members)) if members else None

    def _decode_step(self) -> None:
        """One decode step of the running set (one token per request), then the step boundary:
        finished requests complete and leave."""
        model, cfg, sel = self.model, self.model.cfg, self.selector
        lives, metadata = self._running, self._batch_meta
        B, H, L = len(lives), cfg.num_kv_heads, cfg.num_layers
        capacity = max(lv.kv.capacity for lv in lives)
        dense_below = L if sel.is_dense else sel.config.dense_layers
        params = [lv.req.params for lv in lives]
        temperature = np.asarray([p.temperature for p in params], np.float32)
        positions = np.asarray([lv.position for lv in lives], np.int32)
        clock = self.phases
        clock.new_step()
        for lv in lives:
            lv.step_phases.append(clock.steps[-1])
        # Speculation starts after a request's first decode step: that step's on-demand rows are the
        # stage-transition stall (TTST) and get the whole link (SmartGen §4.3 uses idle link).
        speculating = [lv for lv in lives if lv.steps > 0] if self.transfer.speculative else []
        pos = jnp.asarray(positions)
        now_cached = positions + 1
        x = model.embed(jnp.asarray([lv.current for lv in lives], jnp.int32))
        x_prev = x
        step_remote = np.zeros(B, np.int64)
        step_selected = np.zeros(B, np.int64)
        lookahead = self._lookahead if self.transfer.layer_lookahead and not sel.is_dense else None
        hint_q: dict[int, object] = {}  # layer -> its speculative query, from the previous layer's input
        self._lookahead.clear()
        # Gate the prefetches only in a request's first step: there a layer's prefetch is large
        # (a whole layer's selection, ~0.6 s of link at 4 x 2K), and a row the hint missed would wait
        # behind it. Later a prefetch is small and the hint misses ~0 rows (its margin): holding it
        # until the select of the layer before has run would leave the link idle meanwhile.
        self._lookahead.gated = self.transfer.lookahead_gate == "always" or any(lv.steps == 0 for lv in lives)
        # The hint selects with this step's lengths (current token included) although the metadata
        # lacks that token's key: budget k and the always-kept sink/recent tokens then match the real
        # selection's exactly (with the shorter length a kept-recent boundary token shifts and ~12%
        # of the real selection's remote rows missed the hint); the current row is never fetched.
        lengths_now = jnp.asarray(now_cached)
        for layer in range(L):
            if speculating and (layer == 0 or self.transfer.spec_every_layer):
                self._trigger_speculation(speculating)
                clock.lap("spec")
            if lookahead is not None and layer + 1 < L:
                # Layer lookahead: select layer+1 now from this layer's input and put its remote
                # rows on the wire while this layer computes (jkv/disagg/lookahead.py). A dense
                # layer's hint is exact: every cached token.
                nxt = layer + 1
                if nxt < dense_below:
                    grid = np.arange(capacity, dtype=np.int32)[None, :]
                    hint = np.where(grid < np.repeat(positions, H)[:, None], grid, -1)
                    lookahead.start(lives, nxt, lambda h=hint: (h, None), clock)
                else:
                    def make_hint(nxt=nxt, x_in=x, meta=metadata[nxt]):
                        q_hint = model.qkv(nxt, x_in, pos)[0]
                        if self._hint is not None:  # the selected set only, no ordered top-k (hint.py)
                            return self._hint(nxt, q_hint, meta, lengths_now), q_hint
                        return np.asarray(sel.select(nxt, q_hint, meta, lengths_now)), q_hint
                    hint_q[nxt] = lookahead.start(lives, nxt, make_hint, clock)
                clock.lap("lookahead")
            q, k, v = model.qkv(layer, x, pos)
            kn, vn = np.asarray(k, np.float32), np.asarray(v, np.float32)
            clock.lap("qkv")
            for b, lv in enumerate(lives):
                lv.kv.kv[0, layer, :, positions[b]] = kn[b]
                lv.kv.kv[1, layer, :, positions[b]] = vn[b]
                lv.kv.mask[layer, positions[b]] = LOCAL
            if layer < dense_below:
                grid = np.arange(capacity, dtype=np.int32)[None, :]
                kv_index = np.where(grid < np.repeat(now_cached, H)[:, None], grid, -1).astype(np.int32)
            else:
                metadata[layer] = sel.append(layer, metadata[layer], k, pos)
                x_in_prev, cached = x_prev, hint_q.pop(layer, None)  # cached: the same qkv of the same input
                query = sel.decode_query(layer, q, cached if cached is not None
                                         else (lambda: model.qkv(layer, x_in_prev, pos)[0]))
                kv_index = np.asarray(sel.select(layer, query, metadata[layer], jnp.asarray(now_cached)))
            clock.lap("select")
            delivered = self._lookahead.complete(lives, layer, capacity, clock)
            if delivered is not None:
                clock.lap("prefetch_wait")
            K_sel, V_sel, remote_rows = self._gather(lives, layer, kv_index, capacity)
            if delivered is not None:  # selected rows the prefetch supplied are on-demand rows too
                hit = LayerLookahead.hits(delivered, kv_index)
                remote_rows = remote_rows + hit
                clock.count("prefetch_hit_n", hit.sum())
            valid = (kv_index >= 0).sum(axis=1).reshape(B, H).astype(np.int32)
            step_selected += valid.sum(axis=1)
            step_remote += remote_rows.reshape(B, H).sum(axis=1)
            clock.count("selected_n", valid.sum())
            clock.count("remote_n", remote_rows.sum())
            x_prev = x
            x = model.attend_and_mlp(layer, x, q, jnp.asarray(K_sel), jnp.asarray(V_sel), jnp.asarray(valid))
            x.block_until_ready()
            clock.lap("attend")
        logits = model.logits(x)
        steps = np.asarray([lv.steps + 1 for lv in lives], np.int32)
        if bool((temperature > 0).any()):
            current = np.asarray(sample_tokens(
                logits, temperature, np.asarray([p.top_k for p in params], np.int32),
                np.asarray([p.top_p for p in params], np.float32),
                np.asarray([p.seed if p.seed is not None else 0 for p in params], np.uint32), steps))
        else:
            current = np.asarray(jnp.argmax(logits, -1), np.int32)
        clock.lap("logits")
        clock.end_step()
        for b, lv in enumerate(lives):
            lv.steps, lv.current = int(steps[b]), int(current[b])
            lv.position = min(lv.position + 1, lv.kv.capacity - 1)
            lv.selected += int(step_selected[b])
            lv.remote += int(step_remote[b])
            lv.step_selected.append(int(step_selected[b]))
            lv.step_remote.append(int(step_remote[b]))
            if lv.error is not None:
                self._complete(lv, ("error", [], ""))
                continue
            lv.gen.append(lv.current)
            lv.times.append(time.time() - lv.t0)
            if lv.on_token is not None:
                lv.on_token(lv.req.request_id, lv.current)
            reason, ids, text = lv.checker.finish(lv.gen)
            if reason:
                self._complete(lv, (reason, ids, text))
            else:
                self._maybe_release(lv)
        self._leave()

    def _output(self, lv, done):
        reason, ids, text = done
        if reason == "error":
            return _error_output(lv.req, lv.error)
        bytes_ = dict(proactive=0, speculative=0, on_demand=0, metadata=0)
        bytes_.update({k: v for k, v in lv.bytes.items() if k in bytes_})
        bytes_["on_demand"] = max(bytes_["on_demand"], lv.fetch_bytes)
        m = RequestMetrics.from_token_times(
            lv.geometry.num_tokens, lv.times, on_demand_ratio=lv.remote / lv.selected if lv.selected else 0.0,
            step_on_demand_ratio=[r / s if s else 0.0 for r, s in zip(lv.step_remote, lv.step_selected)],
            bytes=bytes_, kr=lv.kr, blocks=int(len(lv.order)), prefill_s=lv.prefill_s, owner=lv.owner,
            recomputed=lv.recomputed, mode=self.transfer.mode, step_phases=lv.step_phases,
            **({} if lv.compression is None else dict(compression=lv.compression.spec_id)))
        return RequestOutput(lv.req.request_id, lv.req.prompt, list(lv.req.prompt_token_ids), text, ids, reason, m)

    # ---------------------------------------------------------------- lanes
    def _gather(self, lives, layer, kv_index, capacity):
        """kv_index: i32[B*H, k] -> K_sel, V_sel: f32[B, H, k, D] in selection order, remote: i32[B*H].
        capacity: the batch N_cap (>= every member's own pool capacity)."""
        while True:
            fetchable = {id(lv) for lv in lives if lv.active and not lv.released}
            try:
                return self._gather_once(lives, layer, kv_index, capacity)
            except _OwnerDown as e:
                # A request cancelled (or freed) while its rows were being fetched makes the owner
                # refuse the whole RPC; the owner is alive: fetch again without that request.
                gone = [lv for lv in lives if lv.owner == e.owner and id(lv) in fetchable
                        and not (lv.active and not lv.released)]
                if isinstance(e.error, RemoteError) and gone:
                    continue
                self._owner_failed(e.owner, e.error, lives + self._pending)

    def _gather_once(self, lives, layer, kv_index, capacity):
        B, H = len(lives), self.model.cfg.num_kv_heads
        k = kv_index.shape[1]
        # One snapshot of the mask per row (request, KV head): [B*H_kv, N_cap]. Rows fetched on
        # demand earlier are kept in the pool (KV reuse, DESIGN.md) and count as local here; the
        # shared token mask itself still only turns 1 when a block lands.
        # Members with a smaller pool than the batch N_cap are padded with PAD (never selected).
        token_mask = np.full((len(lives), capacity), PAD, np.int8)
        for b, lv in enumerate(lives):
            token_mask[b, :lv.kv.capacity] = lv.kv.mask[layer]
        mask = np.repeat(token_mask, H, axis=0)
        for b, lv in enumerate(lives):
            rows = mask[b * H:(b + 1) * H, :lv.kv.capacity]
            if not lv.active or lv.released:  # nothing remote to fetch (inactive rows are ignored)
                rows[rows == REMOTE] = LOCAL
            else:
                rows[lv.fetched[layer] & (rows == REMOTE)] = LOCAL
        reordered, remote_count, _ = self._split(jnp.asarray(kv_index), jnp.asarray(mask))
        reordered, remote_count = np.asarray(reordered), np.asarray(remote_count)
        self.phases.lap("split")
        safe = np.maximum(kv_index, 0)
        is_remote = (kv_index >= 0) & (np.take_along_axis(mask, safe, axis=1) == REMOTE)
        assert (is_remote.sum(1) == remote_count).all(), "split_reorder disagrees with the mask snapshot"
        # Remote lane: one RPC per owner with each row's remote-first prefix (Algorithm 1).
        calls = []
        for owner in {lv.owner for lv in lives if lv.owner is not None}:
            items, parts, row_ids = [], [], []
            for b, lv in enumerate(lives):
                if lv.owner != owner:
                    continue
                counts = remote_count[b * H:(b + 1) * H]
                if counts.sum() == 0:
                    continue
                items.append([lv.rid, counts.tolist()])
                for h in range(H):
                    r = b * H + h
                    parts.append(reordered[r, :counts[h]])
                    row_ids.append(r)
            if items:
                payload = proto.pack(dict(layer=layer, items=items), np.concatenate(parts).astype(np.int32))
                calls.append((owner, row_ids, payload))
        pending = []
        if self.transfer.parallel_lanes:
            pending = [(o, rows, self._call(o, p)) for o, rows, p in calls]
        else:  # serial lanes: remote first, then local
            pending = [(o, rows, self._call(o, p)) for o, rows, p in calls]
            for _, _, t in pending:
                self._wait(t)
        self.phases.lap("remote_issue")
        self._lookahead.release(layer + 1)  # the next layer's prefetch queues behind this fetch
        # Local lane: gather every selected slot from the pool (remote slots are overwritten below).
        heads = np.arange(H)[:, None]
        K_sel = np.stack([lv.kv.kv[0, layer][heads, safe[b * H:(b + 1) * H]] for b, lv in enumerate(lives)])
        V_sel = np.stack([lv.kv.kv[1, layer][heads, safe[b * H:(b + 1) * H]] for b, lv in enumerate(lives)])
        D = K_sel.shape[-1]
        self.phases.lap("local")
        for owner, row_ids, t in pending:
            data = self._wait(t)
            self.phases.lap("remote_wait")
            reply = np.frombuffer(data, np.float32)
            total = int(sum(remote_count[r] for r in row_ids))
            if reply.size != 2 * total * D:
                raise RuntimeError(f"fetch reply from {owner!r} has {reply.size} floats, expected {2 * total * D}")
            reply = reply.reshape(2, total, D)
            pos = 0
            for r in row_ids:
                c = int(remote_count[r])
                slots = np.nonzero(is_remote[r])[0]
                b, h = divmod(r, H)
                K_sel[b, h, slots] = reply[0, pos:pos + c]
                V_sel[b, h, slots] = reply[1, pos:pos + c]
                positions = reordered[r, :c]
                lv = lives[b]  # keep the rows: identical bytes to what a later block write brings
                lv.kv.kv[0, layer, h, positions] = reply[0, pos:pos + c]
                lv.kv.kv[1, layer, h, positions] = reply[1, pos:pos + c]
                lv.fetched[layer, h, positions] = True
                lv.fetch_bytes += 2 * c * D * 4
                pos += c
            self.phases.count("od_bytes_n", reply.nbytes)
            self.phases.count("fetches_n", 1)
            self.phases.lap("scatter")
        return K_sel, V_sel, is_remote.sum(1)

    def _call(self, owner, payload):
        try:
            return self.endpoint.peer(owner).call_async("fetch", payload)
        except (KeyError, TransportError) as e:
            raise _OwnerDown(owner, e) from e

    @staticmethod
    def _wait(transfer):
        try:
            return transfer.result()
        except TransportError as e:
            raise _OwnerDown(transfer.peer, e) from e

    def _trigger_speculation(self, lives):
        by_owner: dict[str, list] = {}
        for lv in lives:
            if lv.active and not lv.released and lv.owner is not None:
                by_owner.setdefault(lv.owner, []).append(lv.rid)
        for owner, rids in by_owner.items():
            try:
                self.endpoint.peer(owner).notify("spec", proto.pack(dict(rids=rids)))
            except (KeyError, TransportError):
                pass  # a dead owner surfaces in the next fetch

    # ---------------------------------------------------------------- release
    def _maybe_release(self, lv):
        if not lv.released and lv.active and lv.kv.all_local():
            self._release_remote(lv)

    def _release_remote(self, lv):
        """Tell the owner to drop the request's KV; idempotent. Holds lv.free_lock for the RPC, so a
        concurrent `_finish_request` (cancel on another thread) unregisters the regions only after
        the owner has stopped writing into them."""
        with lv.free_lock:
            if lv.released:
                return
            lv.released = True
            self._free_on_owner(lv)

    def _free_on_owner(self, lv):
        main = self.endpoint.peers.get(lv.owner) if lv.owner is not None else None
        if main is None or not main.alive:  # "free" is an RPC on the main connection
            return
        try:
            header, _ = proto.unpack(self.endpoint.peer(lv.owner).call("free", proto.pack(dict(rid=lv.rid)),
                                                                        timeout=60))
            if header.get("bytes"):
                for key, v in header["bytes"].items():
                    lv.bytes[key] = max(lv.bytes.get(key, 0), v)
        except (KeyError, TransportError) as e:
            log.warning("freeing request %s on %r failed: %s", lv.req.request_id, lv.owner, e)

    def _finish_request(self, lv, unregister: bool = False):
        with lv.free_lock:
            self._release_remote(lv)
            if unregister:
                self._unregister(lv)

    def _unregister(self, lv):
        if self.pool.get(lv.rid) is not None:
            for name in (proto.kv_region(lv.rid), proto.mask_region(lv.rid)):
                try:
                    self.endpoint.unregister(name)
                except KeyError:
                    pass
            self.pool.free(lv.rid)

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request (any thread); False if none is in flight.

        A planned request's KV is freed before this returns: its prefill worker drops it (an RPC),
        then its regions here are unregistered and its pool freed; decode stops fetching for it at
        once and it leaves the running set at the next step boundary, completing with finish_reason
        "error" ("cancelled"). A queued one is dropped when the engine thread drains the queue."""
        with self._lock:
            lives = [lv for lv in self._live.values() if lv.req.request_id == request_id and not lv.completed]
            queued = request_id in self._queued
            if queued:
                self._cancelled.add(request_id)
        for lv in lives:
            lv.cancelled = True
            lv.error = f"request {request_id}: cancelled"
            lv.handoff.set()
            self._release_remote(lv)
            self._finish_request(lv, unregister=True)  # prefill has dropped it: no more writes land
        return bool(lives) or queued
