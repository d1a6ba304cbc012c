"""Decode worker: receives prefilled requests and decodes them with selective KV transfer.

    worker = DecodeWorker(model, selector, TransferConfig(mode="smartgen"), secret=...)
    worker.connect(["127.0.0.1:PORT", ...])            # one or more prefill workers
    outputs = worker.generate(requests)                  # static batch, like DenseEngine

    worker.submit(request, on_token=..., on_done=...)    # continuous admission (a server):
    while serving: worker.step(wait=0.5)                 # the engine thread drives the batch

Per request (SmartGen §4; DESIGN.md "SmartGen transfer"):

  1. plan: device pages for prompt + max_tokens in the paged cache with its KV mask (REMOTE over
     the prompt, PAD after; jkv/disagg/decode_pages.py), and a host staging buffer
     `f32[2, L, H_kv, N_cap, D]` plus its staging mask `i8[L, N_cap]` registered as regions
     "kv/<rid>", "mask/<rid>"; the block order of the proactive strategy and Kr (Eq. 2 from the
     profile's Tp and the link estimate); an owner prefill worker (round robin over live workers).
     "prefill" goes out (one notify per owner for the requests planned together).
  2. its "handoff" (first token) arrives. Prefill writes land in staging and flip staging mask
     bytes to LOCAL behind our back (transport reader threads); a LOCAL byte is always safe.
  3. at the next step boundary it joins the running set; every decode step, per layer (with
     lookahead, layer l+1's hinted remote rows are already on the wire, see lookahead.py) one
     program: q, k, v → the new k, v into the device pages (mask 1) → landing (staging rows not yet
     on the device are scattered into their pages, their device mask flips to 1) → select →
     `split_reorder` against the device mask → every selected row gathered from the pages →
     attention over the selected entries in selection order → MLP; only a true miss (a selected
     row still remote: the lookahead missed it, or there is none) runs the remote lane (one
     "fetch" RPC per owner with the remote-first prefix of each row; serial in
     `partial`/`+profile`) and a second program that lands the replies' rows and attends, so the
     output never depends on which lane supplied a row (the mode invariant). With speculation a
     "spec" trigger goes to every owner at the start of each layer, for requests past their first
     step.
  4. when its staging mask is all LOCAL, decode calls "free" on its owner; when it finishes (or
     fails, or is cancelled) it leaves the running set at the step boundary, its regions are
     unregistered, its staging freed and (on the engine thread) its device pages.

The running set: requests keep their own staging (N_cap = prompt + max_tokens rounded up to
CAPACITY_BUCKET); the batch's N_cap is the largest member's. The selector metadata of the
running set is one batched pytree per layer (leading axis B, updated by `append` each step); when
membership changes each staying member's rows go back to its `LiveRequest.meta` and the batch is
re-stacked (`_restack`, jkv/disagg/decode_metadata.py). `generate()` is a static batch on the same step code: one shared N_cap,
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

Where the parts live (the split vLLM v1 draws for its KV connector):
  jkv/disagg/decode_state.py     per-request state (`LiveRequest`) and its lifecycle, the step clock
  jkv/disagg/decode_owners.py    the owner side: connect, notifications, plan, hand-in, speculation
                                 triggers, release, owner failure and recompute (`OwnerSide`)
  jkv/disagg/decode_lanes.py     the fetch lanes: split, local gather, remote call, wait, scatter
                                 (`FetchLanes`); the wire format is jkv/kvbuffers/fetch.py
  jkv/disagg/decode_metadata.py  batched selector metadata: stacking and restacking
  this module                    admission (`generate`, `submit`, `step`), the step loop and its
                                 failure policy, `cancel`
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time

import jax.numpy as jnp
import numpy as np

from jkv.disagg import decode_metadata, decode_program
from jkv.disagg.decode_lanes import FetchLanes
from jkv.disagg.decode_owners import OwnerSide
from jkv.disagg.decode_state import (CAPACITY_BUCKET, LiveRequest, RequestFailed, StepPhases, Submission, bucket,
                                     error_output)
from jkv.disagg.handshake import role_config
from jkv.disagg.hint import make_hint as make_set_hint
from jkv.disagg.lookahead import LayerLookahead
from jkv.engine import Request, StopChecker, check_context
from jkv.disagg.decode_pages import DecodePages
from jkv.disagg.prefix_split import keep_finished
from jkv.kvbuffers.pool import KVBufferPool
from jkv.kvcache import PageConfig, prefix_namespace
from jkv.outputs import RequestOutput
from jkv.sampling import sample_or_argmax
from jkv.selection.base import dense_layer_count
from jkv.transfer.plan import TransferConfig
from transport import Endpoint

__all__ = ["CAPACITY_BUCKET", "DecodeWorker", "RequestFailed"]

log = logging.getLogger(__name__)




@dataclasses.dataclass
class _Step:
    """What the layers of one decode step share (engine thread). B: running requests."""

    lives: list  # the running set, in metadata row order
    metadata: list  # per layer: batched selector metadata [B, ...] or None (dense)
    capacity: int  # the batch N_cap
    dense_below: int
    positions: np.ndarray  # i32[B]: the slot each request's new token's KV goes to
    pos: object  # the same, on the device
    table_np: np.ndarray  # i32[B, ceil(N_cap / P)]: each request's device pages (decode_pages.py)
    table: object  # the same, on the device
    now_cached: np.ndarray  # i32[B]: cached tokens, the current one included
    lengths_now: object  # the same, on the device (the hint's lengths)
    speculating: list  # requests past their first step (smartgen): "spec" triggers
    lookahead: LayerLookahead | None
    x: object  # the hidden state entering the current layer [B, d_model]
    x_prev: object  # the hidden state that entered the previous layer
    step_remote: np.ndarray  # i64[B]: selected entries fetched remotely this step
    step_selected: np.ndarray  # i64[B]
    selected: list = dataclasses.field(default_factory=list)  # per layer: i32[B*H_kv] selected entries (device)
    drops: bool = False  # a request of the batch has a token-dropping profile (DROPPED mask entries)


class DecodeWorker(OwnerSide, FetchLanes):
    def __init__(self, model, selector, transfer: TransferConfig, *, secret: str, backend: str = "tcp",
                 profile=None, oracle_profile=None, on_failure: str = "fail", timeout: float = 5.0,
                 name: str = "decode-0", compression=None, page_config: PageConfig | None = None,
                 prefix_caching: bool = False):
        """prefix_caching: keep finished requests' complete prompt pages and skip them in later
        requests' transfers (jkv/disagg/prefix_split.py). page_config: a fixed device pool; None sizes it to need."""
        if on_failure not in ("fail", "recompute"):
            raise ValueError(f"{on_failure=} must be 'fail' or 'recompute'")
        self.model, self.selector, self.transfer = model, selector, transfer
        self.profile, self.oracle_profile, self.on_failure = profile, oracle_profile, on_failure
        if transfer.needs_profile and transfer.kr_fraction is None and profile is None:
            raise ValueError(f"mode {transfer.mode!r} with strategy {transfer.strategy!r} needs an importance "
                             "profile: create one with `jkv profile` and pass it")
        cfg = model.cfg
        self.pool = KVBufferPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)  # host staging (L2)
        # device pages + KV mask (L1), in the model's dtype, split by KV head over the model's mesh
        self.pages = DecodePages(cfg, page_config, sharding=model.kv_sharding, prefix_namespace=prefix_namespace(
            model, cfg.dtype, (page_config or PageConfig()).page_size) if prefix_caching else None)  # None: grows
        self.programs = decode_program.programs_for(cfg, selector, model.kv_sharding)  # shared by value
        self._warmed: set = set()  # shape classes this worker's own warm-up ran (LayerPrograms.warm_up)
        # agreed with every prefill worker in the handshake, before any KV crosses (handshake.py)
        self.config = role_config(model, "decode", selector, max_blocks=transfer.max_blocks)
        self.endpoint = Endpoint(name, backend, secret=secret, timeout=timeout, op_timeout=None,
                                 max_message=1 << 30, config_check=self.config.check())
        self.endpoint.on_notify("meta", self._on_meta)
        self.endpoint.on_notify("handoff", self._on_handoff)
        self.endpoint.on_notify("failed", self._on_failed)
        self.compression = compression  # jkv.compression.policy.CompressionPolicy or None ("off")
        if compression is not None:  # "auto": charge this machine's codec speed, not the profile file's
            compression.calibrate_for(cfg)
            compression.warm_receive(cfg)  # every chunk batch a "ckv" frame can decode in, compiled now
        self.endpoint.on_notify("ckv", self._on_compressed)
        self.endpoint.on_notify("link", self._on_link)
        self._lock = threading.Lock()
        self._live: dict[str, LiveRequest] = {}
        self.owners: list[str] = []
        self._main_of: dict[str, str] = {}  # owner -> its main transport address
        self._bulk_of: dict[str, str] = {}  # owner -> the peer name of its bulk connection
        self.phases = StepPhases()
        self._lookahead = LayerLookahead(self.endpoint, cfg.num_kv_heads, cfg.head_dim)
        self._hint = (make_set_hint(selector, transfer.hint_margin)  # None: the hint calls select
                      if transfer.layer_lookahead and transfer.hint_margin is not None else None)
        # Continuous admission: submissions and cancels of queued ones cross threads via these;
        # everything below them is engine-thread state.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: dict[str, int] = {}  # request_id -> submissions not yet drained (under _lock)
        self._cancelled: set[str] = set()  # queued request ids cancelled before planning (under _lock)
        self._pending: list[LiveRequest] = []  # handed in, hand-off not yet admitted
        self._running: list[LiveRequest] = []  # the decode batch, in metadata row order
        self._batch_meta: list | None = None  # per layer: selector metadata of _running, [B, ...]
        self._next_owner = 0

    def close(self) -> None:
        self.endpoint.close()
        self._lookahead.close()

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
        capacity = bucket(max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests))
        owners = self.alive_owners()
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
            self._warm_up(self._running + lives)  # while the prompts prefill
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
        self._inbox.put(Submission(request, on_token, on_done, owner, time.time() if t0 is None else t0))

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
        owners = self.alive_owners()
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
                    capacity = bucket(len(s.req.prompt_token_ids) + s.req.params.max_tokens)
                    lv = self._plan(s.req, self._rid(s.req), capacity, owner)
                except Exception as e:  # noqa: BLE001 - a request that cannot be planned fails alone
                    error = f"request {rid}: {e}"
            if error is not None:
                if s.on_done is not None:
                    s.on_done(error_output(s.req, error))
                continue
            lv.t0, lv.on_token, lv.on_done = s.t0, s.on_token, s.on_done
            with self._lock:
                self._live[lv.rid] = lv
            lives.append(lv)
        self._pending.extend(lives)
        self._hand_in(lives)
        if lives:
            self._warm_up(self._running + self._pending)  # the batch they will likely join, while they prefill

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
            if lv.keep is not None:
                self._mark_dropped(lv)
            lv.checker = StopChecker(self.model.tokenizer, lv.req.params, self.model.cfg.eos_token_ids)
            lv.current, lv.position = lv.first_token, lv.geometry.num_tokens
            lv.gen, lv.times = [lv.first_token], [(lv.t_first or time.time()) - lv.t0]
            joined.append(lv)
        if not joined:
            return
        if not self._running:
            self.phases = StepPhases(self.phases.probe, self.phases.on_end)
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

    def _mark_dropped(self, lv) -> None:
        """A request with a token-dropping profile joins: its dropped (layer, head, token) rows
        become DROPPED in the device mask (selections skip them), and count as on the device and
        fetched, so landing and lookahead prefetches never move them (jkv/compression/dropping.py)."""
        dropped = ~lv.keep
        self.pages.mark_dropped(lv.rid, dropped)
        lv.on_device |= dropped
        lv.fetched[:, :, :dropped.shape[2]] |= dropped

    def _leave(self) -> None:
        """Step boundary: completed requests leave the running set (metadata is re-stacked)."""
        if any(lv.completed for lv in self._running):
            self._restack([lv for lv in self._running if not lv.completed])

    def _complete(self, lv, done, pull: bool | None = None) -> None:
        """A request is done: free its KV on both sides and hand its output to `on_done`. pull: see
        prefix_split.keep_finished (None: only if no other request is decoding)."""
        lv.finished = done[0] != "error"
        lv.completed = True
        # with prefix caching its complete prompt pages stay cached; missing rows are fetched for
        # that only when no other request is decoding (the fetch would stall their steps)
        if pull is None:
            pull = not any(x is not lv and not x.completed for x in self._running)
        keep_finished(self, lv, pull=pull)
        self._finish_request(lv, unregister=True)
        self._forget(lv)
        if lv.on_done is not None:
            lv.on_done(lv.output(done, self.transfer.mode))

    def _forget(self, lv) -> None:
        """Engine thread: the request leaves the worker; its device pages go back to the pool here
        (never on a cancelling thread: a step in flight may still read them)."""
        with self._lock:
            self._live.pop(lv.rid, None)
        self.pages.free(lv.rid)
        if lv in self._pending:
            self._pending.remove(lv)

    # ---------------------------------------------------------------- the decode step
    def _restack(self, members) -> None:
        """Membership change at a step boundary: each current member's rows of the batched selector
        metadata go back into its `lv.meta`, then the batch is rebuilt for `members` with
        N_cap = the largest member capacity (each a CAPACITY_BUCKET multiple)."""
        decode_metadata.unstack(self.selector, self._running, self._batch_meta, {id(lv) for lv in members})
        self._running = list(members)
        self._batch_meta = (decode_metadata.stack(self.selector, self.model.cfg, self._running,
                                                  max(lv.kv.capacity for lv in members)) if members else None)
        if members:
            self._warm_up(members)  # nothing to do unless a request joined or left unforeseen

    def _warm_up(self, lives) -> None:
        """Compile what a decode step of `lives` runs (one batch of their N_cap): the landing
        programs and the layer programs of its shape class (decode_program.py, decode_pages.py),
        so no step compiles; the three-program path only while a member may still fetch. Once per
        process and shape class; later calls only look it up."""
        self.pages.warm_up()
        self.programs.warm_up(self.model, self.pages, len(lives), max(lv.kv.capacity for lv in lives),
                              dense_layer_count(self.selector, self.model.cfg.num_layers),
                              remote=any(lv.fetchable for lv in lives), lookahead=self.transfer.layer_lookahead and not self.selector.is_dense,
                              hint=self._hint, drops=any(lv.keep is not None for lv in lives),
                              selector=self.selector, warmed=self._warmed)

    def _decode_step(self) -> None:
        """One decode step of the running set (one token per request), then the step boundary:
        finished requests complete and leave."""
        st = self._begin_step()
        for layer in range(self.model.cfg.num_layers):
            self._decode_layer(st, layer)
        steps, current = self._sample(st)
        self._end_step(st, steps, current)

    def _begin_step(self) -> _Step:
        lives = self._running
        positions = np.asarray([lv.position for lv in lives], np.int32)
        self.phases.new_step()
        for lv in lives:
            lv.step_phases.append(self.phases.steps[-1])
        x = self.model.embed(jnp.asarray([lv.current for lv in lives], jnp.int32))
        self._lookahead.clear()
        # Gate the prefetches only in a request's first step: there a layer's prefetch is large
        # (a whole layer's selection, ~0.6 s of link at 4 x 2K), and a row the hint missed would wait
        # behind it. Later a prefetch is small and the hint misses ~0 rows (its margin): holding it
        # until the select of the layer before has run would leave the link idle meanwhile.
        self._lookahead.gated = self.transfer.lookahead_gate == "always" or any(lv.steps == 0 for lv in lives)
        now_cached = positions + 1
        capacity = max(lv.kv.capacity for lv in lives)
        table = self.pages.table([lv.rid for lv in lives], capacity)
        return _Step(table_np=table, table=jnp.asarray(table),
            lives=lives, metadata=self._batch_meta, capacity=capacity,
            dense_below=dense_layer_count(self.selector, self.model.cfg.num_layers),
            positions=positions, pos=jnp.asarray(positions), now_cached=now_cached,
            # The hint selects with this step's lengths (current token included) although the metadata
            # lacks that token's key: budget k and the always-kept sink/recent tokens then match the real
            # selection's exactly (with the shorter length a kept-recent boundary token shifts and ~12%
            # of the real selection's remote rows missed the hint); the current row is never fetched.
            lengths_now=jnp.asarray(now_cached),
            # Speculation starts after a request's first decode step: that step's on-demand rows are the
            # stage-transition stall (TTST) and get the whole link (SmartGen §4.3 uses idle link).
            speculating=[lv for lv in lives if lv.steps > 0] if self.transfer.speculative else [],
            lookahead=self._lookahead if self.transfer.layer_lookahead and not self.selector.is_dense else None,
            x=x, x_prev=x, step_remote=np.zeros(len(lives), np.int64), step_selected=np.zeros(len(lives), np.int64),
            drops=any(lv.keep is not None for lv in lives))

    def _decode_layer(self, st: _Step, layer: int) -> None:
        """One layer for the running set: triggers and prefetch, then one program (q k v, the new
        KV into its page, landing, select, split, attention, MLP), unless a selected row is still
        remote (a true miss: fetched, then a second program; jkv/disagg/decode_lanes.py)."""
        model, clock, H = self.model, self.phases, self.model.cfg.num_kv_heads
        B = len(st.lives)
        if st.speculating and (layer == 0 or self.transfer.spec_every_layer):
            self._trigger_speculation(st.speculating)
            clock.lap("spec")
        if st.lookahead is not None and layer + 1 < model.cfg.num_layers:
            self._start_lookahead(st, layer + 1)
            clock.lap("lookahead")
        delivered = self._lookahead.complete(st.lives, layer, st.capacity, clock)
        if delivered is not None:
            clock.lap("prefetch_wait")
        args = self._layer_args(st, layer)  # reads st.x_prev: the previous layer's input
        st.x_prev = st.x
        st.metadata[layer], kv_index, selected, st.x, remote_rows = self._layer_programs(st, layer, args)
        if delivered is not None:  # selected rows the prefetch supplied are on-demand rows too
            hit = LayerLookahead.hits(delivered, np.asarray(kv_index))
            remote_rows = remote_rows + hit
            clock.count("prefetch_hit_n", hit.sum())
        st.selected.append(selected)
        st.step_remote += remote_rows.reshape(B, H).sum(axis=1)
        clock.count("remote_n", remote_rows.sum())
        st.x.block_until_ready()
        clock.lap("attend")

    def _layer_args(self, st: _Step, layer: int) -> dict:
        """The layer program's select arguments for `layer`; its query is projected inside the
        program from the layer's input or the previous layer's (`decode_program.query_input`)."""
        dense, sel = layer < st.dense_below, self.selector
        return dict(capacity=st.capacity, dense=dense, state=None if dense else sel.layer_state(layer),
                    meta=st.metadata[layer], x_query=decode_program.query_input(sel, layer, dense, st.x_prev),
                    pos=st.pos, now_cached=st.lengths_now, drops=st.drops)

    def _all_cached(self, st: _Step, lengths) -> np.ndarray:
        """i32[B*H_kv, N_cap]: every slot below each request's length, -1 after (a dense selection)."""
        grid = np.arange(st.capacity, dtype=np.int32)[None, :]
        return np.where(grid < np.repeat(lengths, self.model.cfg.num_kv_heads)[:, None], grid, -1)

    def _start_lookahead(self, st: _Step, nxt: int) -> None:
        """Layer lookahead: select layer `nxt` now from this layer's input and put its remote rows
        on the wire while this layer computes (jkv/disagg/lookahead.py). A dense layer's hint is
        exact: every cached token. The hint's query is its own `Model.qkv` on the helper thread (the
        layer program projects the selection's query again, so a selection never depends on
        whether a hint ran)."""
        if nxt < st.dense_below:
            hint = self._all_cached(st, st.positions)
            st.lookahead.start(st.lives, nxt, lambda h=hint: (h, None), self.phases)
            return
        model, sel = self.model, self.selector

        def make_hint(nxt=nxt, x_in=st.x, meta=st.metadata[nxt]):
            q_hint = model.qkv(nxt, x_in, st.pos)[0]
            if self._hint is not None:  # the selected set only, no ordered top-k (hint.py)
                return self._hint(nxt, q_hint, meta, st.lengths_now), None
            return np.asarray(sel.select(nxt, q_hint, meta, st.lengths_now)), None
        st.lookahead.start(st.lives, nxt, make_hint, self.phases)

    def _sample(self, st: _Step) -> tuple[np.ndarray, np.ndarray]:
        """(steps i32[B], next tokens i32[B]) from the last layer's hidden state."""
        logits = self.model.logits(st.x)
        selected = np.asarray(jnp.stack(st.selected)).sum(0).reshape(len(st.lives), -1)  # one sync a step
        st.step_selected += selected.sum(axis=1)
        self.phases.count("selected_n", selected.sum())
        params = [lv.req.params for lv in st.lives]
        steps = np.asarray([lv.steps + 1 for lv in st.lives], np.int32)
        current = sample_or_argmax(
            logits, np.asarray([p.temperature for p in params], np.float32),
            np.asarray([p.top_k for p in params], np.int32), np.asarray([p.top_p for p in params], np.float32),
            np.asarray([p.seed if p.seed is not None else 0 for p in params], np.uint32), steps)
        self.phases.lap("logits")
        self.phases.end_step()
        return steps, current

    def _end_step(self, st: _Step, steps, current) -> None:
        """The step boundary: each request takes its token; finished ones complete and leave."""
        outcomes = []
        for b, lv in enumerate(st.lives):
            lv.steps, lv.current = int(steps[b]), int(current[b])
            lv.position = min(lv.position + 1, lv.kv.capacity - 1)
            lv.selected += int(st.step_selected[b])
            lv.remote += int(st.step_remote[b])
            lv.step_selected.append(int(st.step_selected[b]))
            lv.step_remote.append(int(st.step_remote[b]))
            if lv.error is not None:
                outcomes.append((lv, ("error", [], "")))
                continue
            lv.gen.append(lv.current)
            lv.times.append(time.time() - lv.t0)
            if lv.on_token is not None:
                lv.on_token(lv.req.request_id, lv.current)
            reason, ids, text = lv.checker.finish(lv.gen)
            outcomes.append((lv, (reason, ids, text) if reason else None))
        last = all(done is not None for _, done in outcomes)  # nothing decodes after this step
        for lv, done in outcomes:
            if done is None:
                self._maybe_release(lv)
            else:
                self._complete(lv, done, pull=last)
        self._leave()

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
