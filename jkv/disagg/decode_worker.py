"""Decode worker: receives prefilled requests and decodes them with selective KV transfer.

    worker = DecodeWorker(model, selector, TransferConfig(mode="smartgen"), secret=...)
    worker.connect(["127.0.0.1:PORT", ...])            # one or more prefill workers
    outputs = worker.generate(requests)                  # static batch, like DenseEngine

Per batch (SmartGen §4; DESIGN.md "SmartGen transfer"):

  1. plan: per request a host pool `f32[2, L, H_kv, N_cap, D]` plus its KV mask `i8[L, N_cap]`
     (REMOTE over the prompt, PAD after) registered as regions "kv/<rid>", "mask/<rid>"; the
     block order of the proactive strategy and Kr (Eq. 2 from the profile's Tp and the link
     estimate); an owner prefill worker (round robin over live workers). "prefill" goes out.
  2. wait for every "handoff" (first token). Prefill writes land in the pool and flip mask
     bytes to LOCAL behind our back (transport reader threads); a LOCAL byte is always safe.
  3. decode steps; per layer: q, k, v → the new k, v go into the pool (LOCAL) → select →
     `split_reorder` against a snapshot of the mask → the remote lane (one "fetch" RPC per
     owner with the remote-first prefix of each row) and the local lane (numpy gather of the
     pool) run concurrently (serially in `partial`/`+profile`) → remote rows are scattered
     into their canonical slots → attention over the selected entries in selection order, so
     the output never depends on which lane supplied a row (the mode invariant). With
     speculation a "spec" trigger goes to every owner at the start of each layer.
  4. when a request's mask is all LOCAL (or it finishes / fails) decode calls "free" on its
     owner; at the end of the batch its regions are unregistered and its pool freed.

A dead owner fails its requests with RequestFailed's message (or, with on_failure="recompute",
their prompt KV is recomputed locally) and the other requests continue.

Threads: `generate` runs on the caller's thread. The transport's notify thread runs the "meta",
"handoff" and "failed" handlers, which only store into per-request state and set events.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv.disagg import protocol as proto
from jkv.disagg.selectors import needs_metadata
from jkv.engine import Request, _StopChecker, check_context
from jkv.kvcache.geometry import LOCAL, REMOTE, BlockGeometry
from jkv.kvcache.pool import HostKVPool
from jkv.outputs import RequestMetrics, RequestOutput
from jkv.sampling import sample_tokens
from jkv.transfer.plan import TransferConfig, proactive_order
from pallas_kernels import dispatch
from transport import Endpoint, TransportError

log = logging.getLogger(__name__)

CAPACITY_BUCKET = 256


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
    remote_n (selected entries, all requests), fetches_n (fetch RPCs)."""

    def __init__(self):
        self.steps: list[dict] = []
        self._t = time.perf_counter()

    def new_step(self) -> None:
        self.steps.append({})
        self._t = time.perf_counter()

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


@dataclasses.dataclass
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
        self.phases = _Phases()
        self._split = _split_rows

    # ---------------------------------------------------------------- wiring
    def connect(self, addresses) -> list[str]:
        """addresses: what each prefill worker's listen() returned ("main|bulk")."""
        for address in addresses:
            main, _, bulk = str(address).partition("|")
            self.owners.append(self.endpoint.connect(main).name)
            if bulk:
                self.endpoint.connect(bulk)
        return list(self.owners)

    def close(self) -> None:
        self.endpoint.close()

    def _alive_owners(self) -> list[str]:
        peers = self.endpoint.peers
        return [o for o in self.owners if o in peers and peers[o].alive]

    def _owner_alive(self, owner) -> bool:
        p = self.endpoint.peers.get(owner)
        return p is not None and p.alive

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
        if not needs_metadata(sel):
            return 0
        spec = jax.ShapeDtypeStruct((1, cfg.num_kv_heads, n, cfg.head_dim), jnp.float32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        total = 0
        for layer in range(sel.config.dense_layers, cfg.num_layers):
            out = jax.eval_shape(functools.partial(sel.prepare, layer), spec, lengths)
            total += sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(out))
        return total

    # ---------------------------------------------------------------- generate
    def generate(self, requests: list[Request], t0: float | None = None, on_token=None,
                 owner_of=None) -> list[RequestOutput]:
        """Decode a static batch; returns one output per request (finish_reason "error" with
        metrics.extra["error"] for a request whose prefill worker failed).

        Serving hooks: `on_token(request_id, token_id)` is called on this thread for every
        generated token as it is sampled (streaming); `owner_of(request)` may name the live
        prefill worker that should own a request's KV (None or a dead one: round robin)."""
        t0 = time.time() if t0 is None else t0
        for r in requests:
            check_context(self.model, r)
        cfg = self.model.cfg
        B, H = len(requests), cfg.num_kv_heads
        capacity = -(-max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)
                     // CAPACITY_BUCKET) * CAPACITY_BUCKET
        owners = self._alive_owners()
        if not owners and self.on_failure != "recompute":
            raise RequestFailed("no live prefill worker is connected; start `jkv prefill-worker` processes "
                                "or use on_failure='recompute'")
        lives = []
        try:
            for b, r in enumerate(requests):
                want = owner_of(r) if owner_of is not None else None
                lv = self._plan(r, f"{r.request_id}.{id(self)}.{time.monotonic_ns()}", capacity,
                                want if want in owners else owners[b % len(owners)] if owners else None)
                with self._lock:
                    self._live[lv.rid] = lv
                lives.append(lv)
            self._hand_in(lives)
            self._await_handoffs(lives)
            return self._decode(lives, capacity, t0, on_token)
        finally:
            for lv in lives:
                self._finish_request(lv, unregister=True)
            with self._lock:
                for lv in lives:
                    self._live.pop(lv.rid, None)

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
        for lv in lives:
            if lv.owner is None or (lv.error is not None and self.on_failure == "recompute"):
                self._recompute(lv, before_handoff=True)

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

    # ---------------------------------------------------------------- the decode loop
    def _decode(self, lives, capacity, t0, on_token=None):
        model, cfg, sel = self.model, self.model.cfg, self.selector
        B, H, L = len(lives), cfg.num_kv_heads, cfg.num_layers
        dense_below = L if sel.is_dense else sel.config.dense_layers
        metadata = self._metadata(lives, capacity)
        for lv in lives:
            self._maybe_release(lv)
        params = [lv.req.params for lv in lives]
        temperature = np.asarray([p.temperature for p in params], np.float32)
        any_sampled = bool((temperature > 0).any())
        top_k = np.asarray([p.top_k for p in params], np.int32)
        top_p = np.asarray([p.top_p for p in params], np.float32)
        seeds = np.asarray([p.seed if p.seed is not None else 0 for p in params], np.uint32)
        checkers = [_StopChecker(model.tokenizer, p, cfg.eos_token_ids) for p in params]
        current = np.asarray([lv.first_token if lv.first_token is not None else 0 for lv in lives], np.int32)
        gen = [[int(current[b])] for b in range(B)]
        times = [[(lv.t_first or time.time()) - t0] for lv in lives]
        done = [None] * B
        for b, lv in enumerate(lives):
            if lv.error is not None:
                done[b] = ("error", [], "")
                continue
            if on_token is not None:
                on_token(lv.req.request_id, gen[b][0])
            reason, ids, text = checkers[b].finish(gen[b])
            if reason:
                done[b] = (reason, ids, text)
                lv.finished = True
                self._finish_request(lv)
        positions = np.asarray([lv.geometry.num_tokens for lv in lives], np.int32)
        steps = np.zeros(B, np.int32)
        clock = self.phases = _Phases()
        while not all(done):
            clock.new_step()
            pos = jnp.asarray(positions)
            now_cached = positions + 1
            x = model.embed(jnp.asarray(current))
            x_prev = x
            step_remote = np.zeros(B, np.int64)
            step_selected = np.zeros(B, np.int64)
            for layer in range(L):
                # Speculation starts after the first decode step: that step's on-demand rows are the
                # stage-transition stall (TTST) and get the whole link (SmartGen §4.3 uses idle link).
                if self.transfer.speculative and len(clock.steps) > 1 and (layer == 0 or self.transfer.spec_every_layer):
                    self._trigger_speculation(lives)
                    clock.lap("spec")
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
                    x_in_prev = x_prev
                    query = sel.decode_query(layer, q, lambda: model.qkv(layer, x_in_prev, pos)[0])
                    kv_index = np.asarray(sel.select(layer, query, metadata[layer], jnp.asarray(now_cached)))
                clock.lap("select")
                K_sel, V_sel, remote_rows = self._gather(lives, layer, kv_index)
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
            steps = steps + 1
            if any_sampled:
                current = np.asarray(sample_tokens(logits, temperature, top_k, top_p, seeds, steps))
            else:
                current = np.asarray(jnp.argmax(logits, -1), np.int32)
            clock.lap("logits")
            now = time.time() - t0
            positions = np.minimum(positions + 1, capacity - 1)
            for b, lv in enumerate(lives):
                if done[b]:
                    continue
                lv.selected += int(step_selected[b])
                lv.remote += int(step_remote[b])
                lv.step_selected.append(int(step_selected[b]))
                lv.step_remote.append(int(step_remote[b]))
                if lv.error is not None:
                    done[b] = ("error", [], "")
                    continue
                gen[b].append(int(current[b]))
                times[b].append(now)
                if on_token is not None:
                    on_token(lv.req.request_id, gen[b][-1])
                reason, ids, text = checkers[b].finish(gen[b])
                if reason:
                    done[b] = (reason, ids, text)
                    lv.finished = True
                    self._finish_request(lv)
                else:
                    self._maybe_release(lv)
        return [self._output(lv, done[b], times[b]) for b, lv in enumerate(lives)]

    def _output(self, lv, done, times):
        reason, ids, text = done
        if reason == "error":
            m = RequestMetrics(prompt_tokens=lv.geometry.num_tokens, extra=dict(error=lv.error))
            return RequestOutput(lv.req.request_id, lv.req.prompt, list(lv.req.prompt_token_ids), "", [], "error", m)
        bytes_ = dict(proactive=0, speculative=0, on_demand=0, metadata=0)
        bytes_.update({k: v for k, v in lv.bytes.items() if k in bytes_})
        bytes_["on_demand"] = max(bytes_["on_demand"], lv.fetch_bytes)
        m = RequestMetrics.from_token_times(
            lv.geometry.num_tokens, times, on_demand_ratio=lv.remote / lv.selected if lv.selected else 0.0,
            step_on_demand_ratio=[r / s if s else 0.0 for r, s in zip(lv.step_remote, lv.step_selected)],
            bytes=bytes_, kr=lv.kr, blocks=int(len(lv.order)), prefill_s=lv.prefill_s, owner=lv.owner,
            recomputed=lv.recomputed, mode=self.transfer.mode, step_phases=self.phases.steps,
            **({} if lv.compression is None else dict(compression=lv.compression.spec_id)))
        return RequestOutput(lv.req.request_id, lv.req.prompt, list(lv.req.prompt_token_ids), text, ids, reason, m)

    # ---------------------------------------------------------------- lanes
    def _gather(self, lives, layer, kv_index):
        """kv_index: i32[B*H, k] -> K_sel, V_sel: f32[B, H, k, D] in selection order, remote: i32[B*H]."""
        B, H = len(lives), self.model.cfg.num_kv_heads
        while True:
            try:
                return self._gather_once(lives, layer, kv_index)
            except _OwnerDown as e:
                self._owner_failed(e.owner, e.error, lives)

    def _gather_once(self, lives, layer, kv_index):
        B, H = len(lives), self.model.cfg.num_kv_heads
        k = kv_index.shape[1]
        # One snapshot of the mask per row (request, KV head): [B*H_kv, N_cap]. Rows fetched on
        # demand earlier are kept in the pool (KV reuse, DESIGN.md) and count as local here; the
        # shared token mask itself still only turns 1 when a block lands.
        mask = np.repeat(np.stack([lv.kv.mask[layer] for lv in lives]), H, axis=0)
        for b, lv in enumerate(lives):
            rows = mask[b * H:(b + 1) * H]
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
        lv.released = True
        if lv.owner is None or not self._owner_alive(lv.owner):
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
        if not lv.released:
            self._release_remote(lv)
        if unregister and self.pool.get(lv.rid) is not None:
            for name in (proto.kv_region(lv.rid), proto.mask_region(lv.rid)):
                try:
                    self.endpoint.unregister(name)
                except KeyError:
                    pass
            self.pool.free(lv.rid)

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request: its prefill worker frees its KV; decode stops fetching for it."""
        with self._lock:
            lives = [lv for lv in self._live.values() if lv.req.request_id == request_id]
        for lv in lives:
            lv.error = f"request {request_id}: cancelled"
            lv.handoff.set()
            self._release_remote(lv)
            self._finish_request(lv, unregister=True)  # prefill has dropped it: no more writes land
        return bool(lives)
