"""The decode worker's side of its prefill workers ("owners"): the connector control plane.

What crosses to an owner, in a request's order (jkv/disagg/protocol.py has the messages):

    connect      `connect_one`: main + bulk connection to each prefill worker
    plan         `_plan`: device pages, staging pool + mask regions registered, block order, Kr
                 (Eq. 2), compression
    hand-in      `_hand_in`: one "prefill" notify per owner for the requests planned together
    arrivals     notify handlers (transport notify thread): "meta", "handoff", "ckv", "failed"
    speculation  `_trigger_speculation`: "spec" to every owner at the start of a layer
    release      `_release_remote`: "free" once a request is all LOCAL, finished or cancelled,
                 then its regions are unregistered and its pool freed (`_finish_request`), or
                 earlier, once every row is in the device pages too (`_free_staging`)
    failure      `_owner_failed`: fail an owner's requests, or `_recompute` their prompt KV here

`OwnerSide` is a mixin of `DecodeWorker`: it reads the worker's `model`, `selector`,
`transfer`, `profile`, `oracle_profile`, `compression`, `on_failure`, `endpoint`, `pool`,
`pages`, `owners`, `_running`, `_warm_up` and `_live` (under `_lock`).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from jkv.compression.dropping import apply_dropping_frame, unpack_keep
from jkv.compression.kv_transfer import apply_frame
from jkv.compression.paths import unpack_metadata
from jkv.compression.policy import WARM_RECEIVE_TOKENS

WARM_TIMEOUT_S = 600.0  # a prefill worker compiling its codec (~5 s a pipeline on 2 cores) before it replies
from jkv.disagg import protocol as proto
from jkv.disagg.decode_state import LiveRequest
from jkv.disagg.prefix_split import handin_prefix, mark_cached, prefix_eligible, uncached_blocks, uncached_kr
from jkv.disagg.selectors import needs_metadata
from jkv.engine import Request
from jkv.kvbuffers.geometry import LOCAL, BlockGeometry
from jkv.selection.base import dense_layer_count
from jkv.transfer.plan import proactive_order
from transport import TransportError

log = logging.getLogger(__name__)


class OwnerSide:
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
            lane = self.endpoint.connect(bulk, **kw)
            # The handshake returns before the prefill worker's bulk endpoint has adopted the connection
            # (or replaced this worker's dead one): a hand-in arriving on the main connection meanwhile
            # finds no live bulk peer and is dropped, and its request would wait for a hand-off forever
            # (a reconnect right after the prefill worker resumed, test_disagg_reconnect.py). The far
            # reader starts only once adopted, so one round trip on the lane proves it is usable.
            lane.regions(refresh=True, timeout=connect_timeout or self.endpoint.timeout)
            self._bulk_of[name] = lane.name
        if name not in self.owners:
            self.owners.append(name)
            pipelines = self.compression.pipelines() if self.compression is not None else []
            if pipelines:
                # the prefill side compiles its codec for every pipeline this worker may choose
                # before this worker sends it a request (first use compiled inside a prefill)
                self.endpoint.peers[name].call("warm_codec", proto.pack(dict(
                    pipelines=pipelines, max_tokens=WARM_RECEIVE_TOKENS)), timeout=WARM_TIMEOUT_S)
        return name

    def alive_owners(self) -> list[str]:
        """The connected prefill workers whose connections are both up."""
        return [o for o in self.owners if self.owner_alive(o)]

    def owner_alive(self, owner) -> bool:
        """Both of its connections are up: its hand-offs, metadata and pushes travel on the bulk
        one, so a worker whose bulk connection died can no longer complete a request's hand-off."""
        peers = self.endpoint.peers
        p = peers.get(owner)
        if p is None or not p.alive:
            return False
        bulk = self._bulk_of.get(owner)
        return bulk is None or (bulk in peers and peers[bulk].alive)

    # ---------------------------------------------------------------- notifications (notify thread)
    def _get(self, rid):
        with self._lock:
            return self._live.get(rid)

    def _on_meta(self, note):
        header, payload = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is None or lv.error is not None:
            return
        if header.get("cmeta"):  # a compressed request's metadata: one checksummed container
            try:
                leaves = unpack_metadata(payload)
            except ValueError as e:
                lv.error = f"request {lv.req.request_id}: bad compressed metadata from {note.peer!r}: {e}"
                lv.handoff.set()
                return
        else:
            leaves = proto.unpack_leaves(header, payload)
        lv.meta[int(header["layer"])] = leaves
        lv.bytes["metadata"] = lv.bytes.get("metadata", 0) + len(note.payload)

    def _on_handoff(self, note):
        header, payload = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is not None:
            if "keep" in header:  # a token-dropping profile's keep table (jkv/compression/dropping.py)
                try:
                    keep = unpack_keep(payload, header["keep"], header.get("keep_crc"))
                    want = lv.on_device.shape
                    if keep.shape != want:
                        raise ValueError(f"keep table {keep.shape} for a request of [L, H_kv, N] = {want}")
                except ValueError as e:
                    lv.error = f"request {lv.req.request_id}: bad keep table from {note.peer!r}: {e}"
                    lv.handoff.set()
                    return
                lv.keep = keep
                lv.bytes["metadata"] = lv.bytes.get("metadata", 0) + len(payload)
            lv.first_token, lv.t_first, lv.prefill_s = header["first_token"], header["t_first"], header["prefill_s"]
            lv.bytes["proactive"] = header["bytes"]["proactive"]
            if "encode_s" in header:
                lv.codec_s["encode"] = float(header["encode_s"])
            if "compression" in header and self.compression is not None:
                if "link" in header:
                    self.compression.observe_link(header["link"]["bytes"], header["link"]["busy_s"])
                self.compression.observe(lv.compression, time.time() - lv.t_hand_in)
            lv.handoff.set()

    def _on_link(self, note):
        """A link sample the prefill worker sent after the pushes of a batch that moved uncompressed
        were acknowledged (its hand-off did not wait for them): one observation per request."""
        header, _ = proto.unpack(note.payload)
        if self.compression is not None:
            for _rid in header["rids"]:
                self.compression.observe_link(header["bytes"], header["busy_s"])

    def _on_compressed(self, note):
        """Compressed KV chunks: decode into the pool, then flip their mask bytes (kv_transfer)."""
        header, payload = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is None or lv.error is not None:
            return
        try:
            t0 = time.perf_counter()
            with lv.staging_lock:  # the staging is not freed (nor its arrays dropped) while a frame lands
                if not lv.kv.take_write():  # freed: a late frame is dropped and counted, never written
                    return
                (apply_dropping_frame if header.get("drop") else apply_frame)(header, payload, lv.kv.kv, lv.kv.mask)
            lv.codec_s["decode"] = lv.codec_s.get("decode", 0.0) + time.perf_counter() - t0
        except ValueError as e:
            lv.error = f"request {lv.req.request_id}: bad compressed KV from {note.peer!r}: {e}"
            lv.handoff.set()

    def _on_failed(self, note):
        header, _ = proto.unpack(note.payload)
        lv = self._get(header["rid"])
        if lv is not None:
            lv.error = f"request {lv.req.request_id}: {header['error']}"
            lv.handoff.set()

    # ---------------------------------------------------------------- planning and hand-in
    def _plan(self, req: Request, rid: str, capacity: int, owner: str | None) -> LiveRequest:
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
        choice = self.compression.choose(request_bytes, tp or 0.0) if self.compression is not None else None
        wire = (self.compression.wire_bytes(choice, request_bytes, self._metadata_bytes(n)) if choice is not None
                else (request_bytes, self._metadata_bytes(n)))  # Eq. 2 on the bytes that cross (compressed)
        kr = min(len(order), self.transfer.kr(geometry, tp, *wire))
        # Device pages first (OutOfPages fails this request alone), then the host staging buffers
        # the transport lands in (decode_pages.py: staging -> pages per layer). With prefix caching
        # the cached leading pages are shared and only blocks past them are planned (prefix_split.py).
        size = self.pages.num_pages
        hit = self.pages.plan(rid, n, n + req.params.max_tokens,
                              req.prompt_token_ids if prefix_eligible(choice) else None)
        if self.pages.num_pages != size and self._running:  # an auto-sized pool grew (decode_pages.py):
            self._warm_up(self._running)  # the running set's next steps are of a new class; compile here
        order = uncached_blocks(order, geometry, hit)
        kr = uncached_kr(self.transfer, kr, len(order)) if hit else min(len(order), kr)
        try:
            kv = self.pool.allocate(rid, n, capacity)
            self.endpoint.register(proto.kv_region(rid), kv.kv)
            self.endpoint.register(proto.mask_region(rid), kv.mask)
        except Exception:
            self.pages.free(rid)
            for name in (proto.kv_region(rid), proto.mask_region(rid)):
                if self.endpoint.regions.by_name(name) is not None:
                    self.endpoint.unregister(name)
            self.pool.free(rid)
            raise
        L, H = cfg.num_layers, cfg.num_kv_heads
        lv = LiveRequest(req, rid, kv, geometry, owner, order, kr, fetched=np.zeros((L, H, capacity), bool),
                         on_device=np.zeros((L, H, n), bool), landed=np.zeros(L, bool), compression=choice,
                         kept_fetches=set() if self.transfer.speculative else None)  # no "spec" carries them
        mark_cached(lv, hit)
        return lv

    def _metadata_bytes(self, n: int) -> int:
        """Bytes of selector metadata the prefill worker ships for an n-token prompt (all layers)."""
        sel, cfg = self.selector, self.model.cfg
        return sum(sel.metadata_nbytes(layer, cfg.num_kv_heads, cfg.head_dim, n)
                   for layer in range(sel.config.dense_layers, cfg.num_layers))

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
                if lv.compression.on_demand is not None:  # jkv.compression.paths: the other paths' choice
                    by_owner[lv.owner][-1]["on_demand"] = lv.compression.on_demand
                if lv.compression.metadata is not None:
                    by_owner[lv.owner][-1]["meta_codec"] = lv.compression.metadata
                lv.t_hand_in = time.time()
            if lv.prefix_hit:  # the leading rows this side holds: no mode moves them (prefix_split.py)
                by_owner[lv.owner][-1]["prefix"] = handin_prefix(self.pages, lv)
        for owner, batch in by_owner.items():
            try:
                self.endpoint.peer(owner).notify("prefill", proto.pack(dict(requests=batch))).wait()
            except (KeyError, TransportError) as e:
                self._owner_failed(owner, e, lives)

    def _await_handoffs(self, lives):
        for lv in lives:
            while not lv.handoff.wait(0.05):
                if lv.owner is None or not self.owner_alive(lv.owner):
                    self._owner_failed(lv.owner, TransportError("connection lost before the hand-off"), lives)
                    break

    def _poll_handoffs(self) -> None:
        """Non-blocking `_await_handoffs`: a request whose owner died before its hand-off fails or
        is recomputed (on_failure)."""
        for lv in list(self._pending):
            if not lv.handoff.is_set() and (lv.owner is None or not self.owner_alive(lv.owner)):
                self._owner_failed(lv.owner, TransportError("connection lost before the hand-off"), self._pending)
                lv.handoff.set()  # an owner of None (recompute) is handled by `_admit`

    def _trigger_speculation(self, lives):
        """"spec" to each owner with its requests, and the fetch replies each request kept since its
        last "spec" ("kept": the owner then pushes none of their rows; jkv/disagg/served_rows.py)."""
        by_owner: dict[str, list] = {}
        for lv in lives:
            if lv.fetchable and lv.owner is not None:
                by_owner.setdefault(lv.owner, []).append(lv)
        for owner, group in by_owner.items():
            kept = {lv.rid: sorted(lv.kept_fetches) for lv in group if lv.kept_fetches}
            try:
                self.endpoint.peer(owner).notify("spec", proto.pack(dict(rids=[lv.rid for lv in group], kept=kept)))
            except (KeyError, TransportError):
                continue  # a dead owner surfaces in the next fetch
            for lv in group:
                if lv.kept_fetches:
                    lv.kept_fetches.clear()

    # ---------------------------------------------------------------- release
    def _maybe_release(self, lv):
        """Step boundary (engine thread): once every prompt row is in staging the owner drops the
        request ("free"); once they are all in the device pages too, the staging goes."""
        if lv.fetchable and lv.kv.all_local():
            self._release_remote(lv)
        if lv.released and lv.active and lv.landed.all():
            self._free_staging(lv)

    def _free_staging(self, lv):
        """Free a request's host staging before it finishes: every row of every layer is on the
        device (mask 1) and nothing more can arrive (its owner returned from "free", or it was
        recomputed here). Its regions are unregistered and the arrays dropped at once (engine
        thread: no step reads them now; a "ckv" frame lands under lv.staging_lock). A late write (a
        frame still queued) is dropped and counted by the pool (RequestKV.take_write). A
        recomputed request keeps it until its selector metadata was built from it."""
        if lv.recomputed and needs_metadata(self.selector) and any(
                layer not in lv.meta for layer in range(dense_layer_count(self.selector, len(lv.landed)),
                                                        len(lv.landed))):
            return
        with lv.free_lock, lv.staging_lock:
            self._unregister(lv, drop_buffers=True)

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

    def _unregister(self, lv, drop_buffers: bool = False):
        if self.pool.get(lv.rid) is not None:
            for name in (proto.kv_region(lv.rid), proto.mask_region(lv.rid)):
                try:
                    self.endpoint.unregister(name)
                except KeyError:
                    pass
            self.pool.free(lv.rid, drop_buffers=drop_buffers)

    # ---------------------------------------------------------------- failure
    def _owner_failed(self, owner, error, lives):
        for lv in lives:
            if lv.owner != owner or not lv.fetchable:
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
