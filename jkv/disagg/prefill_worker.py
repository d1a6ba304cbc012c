"""Prefill worker: batched prefill, proactive + speculative push, on-demand row fetch.

    worker = PrefillWorker(model, selector, "prefill-0", secret=..., bandwidth="1gbit")
    address = worker.listen()          # the decode worker connects here
    worker.run()                       # until close(); or `python -m jkv.disagg.prefill_worker`

Hand-off, in order on the one connection to the decode worker (FIFO, so the decode side sees
every earlier write applied before a later notification; SmartGen §4.1):

  1. decode notifies "prefill" with a batch (prompt, sampling, capacity, block plan).
  2. the main thread prefills the batch; as each layer l finishes (`model.prefill(on_layer=)`)
     it copies the layer's K, V into this worker's host pool (`f32[2, L, H_kv, N, D]` per
     request) shard by shard, sends the selector metadata of layer l ("meta"), then the layer's
     blocks that are in the request's proactive set (the first `kr` of its plan), one write_many
     per KV-head slice of this worker's layout, each run's mask bytes (LOCAL) after its last
     slice — SmartGen §4.1 proactive transfer; jkv/disagg/head_slices.py.
  3. after the last layer: "handoff" with the first token. A request with a token-dropping
     profile (jkv/compression/dropping.py) pushes nothing in step 2: its keep table needs the
     prompt's last queries, so after the prefill it is decided, every layer is absorbed and the
     proactive blocks go out; its hand-off carries the keep table.
  4. decode fetches rows on demand ("fetch" RPC, §4.2; a compressed request's rows as one
     checksummed container in the encoding its on-demand path chose, jkv/compression/paths.py)
     and triggers speculation ("spec", §4.3; jkv/disagg/prefill_pushes.py):
     the next unsent blocks of the plan, at most `spec_cap` per trigger and one speculative
     write in flight per request (so an on-demand reply never queues behind more than one),
     without the rows of the fetch replies the "spec" says decode kept (served_rows.py).
  5. decode calls "free" when it holds everything, finished or cancelled; a lease (renewed by
     every fetch/spec) frees requests whose decode worker went silent or died.

Threads: the caller's thread runs `run()` (prefill jobs from a queue); transport RPC threads
run "fetch"/"free"; the transport notify thread runs "spec" and enqueues "prefill"; one lease
thread. `self._lock` guards the request table; per-request state is touched under it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv.compression.dropping import DroppingCodec, handoff_keep
from jkv.compression.kv_transfer import WIRE_DTYPE, KVCodec
from jkv.compression.paths import F16, encode_rows, pack_framed_reply, pack_metadata
from jkv.disagg import protocol as proto
from jkv.disagg.bulk_pacer import YieldToOnDemand as _YieldToOnDemand
from jkv.disagg.handshake import role_config
from jkv.disagg.head_slices import ExportCounters, export_layer, head_slices
from jkv.disagg.prefill_pushes import PushSide
from jkv.disagg.prefill_cache import PrefillPrefixCache, prefill_rows
from jkv.disagg.prefix_split import prefill_geometry
from jkv.disagg.selectors import load_selector, needs_metadata
from jkv.disagg.served_rows import ServedRows
from jkv.kvbuffers.fetch import pack_reply, parse_fetch_framed
from jkv.kvbuffers.geometry import BlockGeometry
from jkv.kvbuffers.pool import KVBufferPool
from jkv.sampling import sample_or_argmax
from jkv.selection.base import dense_layer_count
from jkv.transfer.plan import per_layer
from models import load_model_spec
from transport import Endpoint, TransportError

log = logging.getLogger(__name__)

PREFILL_BUCKET = 64
MAX_WARM_TOKENS = 32768  # a "warm_codec" notification compiles for prompts up to this at most


class DecodePeerGone(RuntimeError):
    """The decode worker that sent a prefill batch is no longer connected (it died or went away)."""


@dataclasses.dataclass
class _Held:
    rid: str
    peer: str
    kv: object  # RequestKV (K, V of the prompt: [2, L, H_kv, N, D])
    geometry: BlockGeometry
    capacity: int  # decode-side N_cap (addresses in its region)
    order: np.ndarray
    sent: np.ndarray  # bool[L * M_eff] by flat block id
    spec_cursor: int
    spec_cap: int
    lease_until: float
    inflight: list = dataclasses.field(default_factory=list)
    # Guards `released` against a push in progress: once `_release` has set it, no write is issued
    # into the decode side's region (which decode unregisters when "free" returns; a WRITE to an
    # unknown region is a protocol error that closes the whole connection).
    push_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    released: bool = False
    spec_busy: object = None
    codec: object = None  # kv_transfer.RequestCodec: this request's KV moves compressed (KVServe)
    on_demand: str | None = None  # its on-demand rows' encoding (jkv.compression.paths; None: float32)
    original: object = None  # f16[2, L, H_kv, N, D]: the rows its chunks were encoded from (row pipelines)
    meta_codec: str | None = None  # lossless codec of its selector metadata (None: plain leaves)
    bytes: dict = dataclasses.field(default_factory=lambda: dict(proactive=0, speculative=0, on_demand=0, metadata=0))
    served: ServedRows | None = None  # rows served on demand; those the decode side keeps are never pushed


class PrefillWorker(PushSide):
    def __init__(self, model, selector, name: str = "prefill-0", *, secret: str, backend: str = "tcp",
                 bandwidth=None, lease_s: float = 300.0, timeout: float = 5.0, codec=None,
                 max_blocks: int | None = None, prefix_cache_tokens: int = 0):
        """max_blocks: the M this worker declares in the handshake (None: it follows the M each
        request names, so any decode side's M is accepted). prefix_cache_tokens: budget of this
        worker's own prefix cache (jkv/disagg/prefill_cache.py; 0: none): a prompt that starts
        with cached pages is prefilled from its first uncached token."""
        self.model, self.selector = model, selector
        self.prefix_cache = PrefillPrefixCache(model, prefix_cache_tokens) if prefix_cache_tokens else None
        self.codec = codec  # jkv.compression.KVCodec; made on first use by a request that asks for compression
        cfg = model.cfg
        self.pool = KVBufferPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, with_mask=False)
        self.head_slices = head_slices(model.kv_sharding, cfg.num_kv_heads)  # one pushed block per slice
        self.kv_export = ExportCounters(self.head_slices)
        self.lease_s = lease_s
        # checked against every decode worker in the handshake, on both endpoints (handshake.py)
        self.config = role_config(model, "prefill", selector, max_blocks=max_blocks)
        self.endpoint = Endpoint(name, backend, secret=secret, bandwidth=bandwidth, timeout=timeout,
                                 op_timeout=None, max_message=1 << 30, config_check=self.config.check())
        # Bulk lane: proactive/speculative writes, metadata and hand-offs travel on a second
        # connection sharing this worker's token bucket (one paced link), so an on-demand reply
        # on the main connection never queues behind a whole layer of bulk writes (SmartGen §4.2:
        # on-demand fetches must not stall behind background transfer).
        self.bulk = Endpoint(f"{name}.bulk", backend, secret=secret, timeout=timeout, op_timeout=None,
                             max_message=1 << 30, config_check=self.config.check())
        self.bulk.pacer = _YieldToOnDemand(self.endpoint.pacer) if self.endpoint.pacer is not None else None
        self.endpoint.serve("fetch", self._fetch)
        self.endpoint.serve("free", self._free_call)
        self.endpoint.serve("stats", lambda peer, payload: proto.pack(
            dict(held=self.held(), bytes_in_use=self.pool.bytes_in_use, live=self.pool.live(),
                 prefix_cache=self.prefix_cache.stats() if self.prefix_cache else None)))
        self.endpoint.serve("set_bandwidth", lambda peer, payload: self.set_bandwidth(
            proto.unpack(payload)[0]["bps"]) or b"")
        self.endpoint.on_notify("prefill", self._enqueue)
        self.endpoint.on_notify("spec", self._spec)
        self.endpoint.serve("warm_codec", self._warm_codec)
        self._warmed_codecs: set[str] = set()
        self._warm_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self.link_sample_waits = 0  # batches whose hand-off waited for push acknowledgements (a link sample)
        self._closed = threading.Event()
        self._lease_thread = threading.Thread(target=self._lease_loop, daemon=True, name=f"jkv-lease-{name}")
        self._lease_thread.start()

    @property
    def name(self) -> str:
        return self.endpoint.name

    def listen(self, address=None) -> str:
        """Returns "main|bulk": the decode worker connects to both. `address`: "host:port" (the bulk
        connection on a free port of that host) or "host:port|host:port" (both fixed, e.g. the
        ports a container exposes)."""
        main_at, _, bulk_at = (address or "").partition("|")
        main = self.endpoint.listen(main_at or None)
        host = main.rpartition(":")[0] if self.endpoint.backend == "tcp" else None
        bulk = self.bulk.listen(bulk_at or (f"{host}:0" if host else None))
        return f"{main}|{bulk}"

    def set_bandwidth(self, bits_per_s: float) -> None:
        """Re-pace the link (benchmarks measure Tp first, then choose the bandwidth)."""
        pacer = self.endpoint.pacer
        if pacer is None:
            raise ValueError(f"{self.name} was started without --bandwidth; start it paced to re-pace it")
        pacer.set_rate(float(bits_per_s))  # burst and chunk follow (TokenBucket's few ms of link time)

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def held_load(self) -> tuple[int, int]:
        """(requests, prompt tokens) whose KV this worker holds."""
        with self._lock:
            return len(self._held), sum(h.geometry.num_tokens for h in self._held.values())

    @property
    def closed(self) -> bool:
        """close() has begun: what is released from now on is released for shutdown."""
        return self._closed.is_set()

    # ---------------------------------------------------------------- observer hooks
    # A serving wrapper overrides these to count (jkv/serving/disagg_prefill.py); they must be
    # quick and must not raise. The thread each runs on is named.
    def on_prefill_queued(self, requests: list[dict]) -> None:
        """Notify thread: a "prefill" batch was received and is queued for the main loop."""

    def on_free_requested(self, rid: str) -> None:
        """RPC thread: the decode worker called "free" for rid (its release follows)."""

    def on_released(self, rid: str, stats: dict | None) -> None:
        """Any thread: rid was forgotten (stats: its bytes per path), or held nothing (None)."""

    def on_notify_failed(self, kind: str, peer_name: str) -> None:
        """Any thread: a notification to the decode worker could not be sent."""

    def on_fetch_failed(self, error: Exception) -> None:
        """RPC thread: a "fetch" raised (unknown request, bad positions, ...); it is re-raised."""

    def _enqueue(self, note) -> None:
        self.on_prefill_queued(proto.unpack(note.payload)[0]["requests"])
        self._jobs.put(note)

    # ---------------------------------------------------------------- main loop
    def run(self) -> None:
        while not self._closed.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            header, _ = proto.unpack(job.payload)
            try:
                self.prefill_batch(job.peer, header["requests"])
            except Exception as e:  # report to decode; the worker keeps serving
                if isinstance(e, DecodePeerGone) or (isinstance(e, TransportError) and not self._connected(job.peer)):
                    # handled, not a fault here: nobody is left to hand the KV to or to tell
                    log.warning("%s: decode peer %r went away mid-prefill (%s); dropped its requests %s", self.name,
                                job.peer, e, [r["rid"] for r in header["requests"]])
                    for r in header["requests"]:
                        self._release(r["rid"])
                    continue
                log.exception("prefill of a batch from %r failed", job.peer)
                for r in header["requests"]:
                    self._release(r["rid"])
                    self._notify(job.peer, "failed", dict(rid=r["rid"], error=f"prefill failed: {e}"))

    def _connected(self, peer_name: str) -> bool:
        try:
            return self.bulk.peer(peer_name).alive
        except KeyError:
            return False

    def _notify(self, peer_name, kind, header, *arrays):
        try:
            return self.bulk.peer(peer_name).notify(kind, proto.pack(header, *arrays))
        except (KeyError, TransportError) as e:
            log.warning("%s: notify %r to %r failed: %s", self.name, kind, peer_name, e)
            self.on_notify_failed(kind, peer_name)

    def prefill_batch(self, peer_name: str, requests: list[dict]) -> None:
        """Raises DecodePeerGone when the decode worker that sent the batch is no longer connected."""
        model, cfg = self.model, self.model.cfg
        try:
            peer = self.bulk.peer(peer_name)
        except KeyError:
            raise DecodePeerGone(f"decode peer {peer_name!r} disconnected before its prefill started") from None
        lengths = np.asarray([len(r["tokens"]) for r in requests], np.int32)
        T = -(-int(lengths.max()) // PREFILL_BUCKET) * PREFILL_BUCKET
        tokens = np.zeros((len(requests), T), np.int32)
        held = []
        now = time.monotonic()
        for b, r in enumerate(requests):
            tokens[b, :lengths[b]] = r["tokens"]
            held.append(self._hold(peer_name, r, now))
        link0 = self._link_counters() if any("compression" in r for r in requests) else None
        proactive = [per_layer(h.geometry, h.order[:h.spec_cursor]) for h in held]
        ship_meta = needs_metadata(self.selector)
        dense_below = dense_layer_count(self.selector, cfg.num_layers)
        dropping = {h.rid for h in held if isinstance(h.codec, DroppingCodec)}  # absorbed and pushed after
        plans = [self.prefix_cache.plan(r["tokens"]) for r in requests] if self.prefix_cache else None
        jl = jnp.asarray(lengths)
        t_start = time.time()

        def on_layer(layer, K, V):  # as each layer's KV exists (DESIGN.md: transfer starts after layer 0)
            self.kv_export.exported(export_layer((K, V), [h.kv.kv[:, layer] for h in held], lengths))
            for h, plan in zip(held, plans or ()):  # exact KV, before a codec overwrites the host copy
                self.prefix_cache.store_layer(plan, layer, h.kv.kv[:, layer])
            leaves = None
            if ship_meta and layer >= dense_below:
                leaves = jax.tree_util.tree_leaves(self.selector.prepare(layer, K, jl))
                leaves = [np.asarray(x) for x in leaves]
            for b, h in enumerate(held):
                if h.original is not None:
                    h.original[:, layer] = h.kv.kv[:, layer]
                if h.codec is not None and h.rid not in dropping:  # every later row read sees decode(encode(KV))
                    h.codec.absorb(layer, h.kv.kv[:, layer])
                if leaves is not None:  # selector metadata goes before the layer's blocks
                    mine = [x[b:b + 1] for x in leaves]
                    payload = (pack_metadata(dict(rid=h.rid, layer=layer), mine, h.meta_codec) if h.meta_codec
                               else proto.pack_leaves(dict(rid=h.rid, layer=layer), mine))
                    h.bytes["metadata"] += len(payload)
                    peer.notify("meta", payload)
                blocks = proactive[b].get(layer)
                if blocks and h.rid not in dropping:  # its keep table needs every layer: pushed after the prefill
                    self._push(peer, h, layer, blocks, "proactive")

        logits = prefill_rows(model, self.prefix_cache, tokens, lengths, plans, on_layer)
        prefill_s = time.time() - t_start
        for b, h in ((b, h) for b, h in enumerate(held) if h.rid in dropping):
            self._absorb_dropping(peer, h, tokens[b, :h.geometry.num_tokens], proactive[b])
        first = self._first_tokens(logits, requests)
        t_first = time.time()
        link = None
        if link0 is not None and any(h.codec is not None for h in held):
            link = self._link_sample(link0, held)
        elif link0 is not None:  # "auto" chose no compression: never delay the hand-off for a sample
            self._link_sample_later(peer_name, link0, held)
        for b, h in enumerate(held):
            h.lease_until = time.monotonic() + self.lease_s  # the lease runs from the hand-off
            extra = {} if link0 is None else dict(compression=h.codec.spec_id if h.codec else None)
            if link is not None:
                extra["link"] = link
            if h.codec is not None:  # every chunk is encoded during the prefill (absorb)
                extra["encode_s"] = h.codec.encode_s
            fields, arrays = handoff_keep(h.codec)  # a token-dropping profile's keep table (or nothing)
            self._notify(peer_name, "handoff", dict(rid=h.rid, first_token=int(first[b]), t_first=t_first,
                                                    prefill_s=prefill_s, bytes=dict(h.bytes), **extra, **fields), *arrays)

    def _hold(self, peer_name: str, r: dict, now: float) -> _Held:
        """Start holding one request of a "prefill" batch: its host KV buffer, plan and codec."""
        cfg, n = self.model.cfg, len(r["tokens"])
        geometry = prefill_geometry(self.model, r)  # skips the rows a decode side's prefix cache holds
        h = _Held(r["rid"], peer_name, self.pool.allocate(r["rid"], n, n), geometry,
                  int(r["capacity"]), np.asarray(r["order"], np.int64), np.zeros(geometry.num_blocks, bool),
                  int(r["kr"]), int(r["spec_cap"]), now + self.lease_s,
                  served=ServedRows(cfg.num_layers, cfg.num_kv_heads, n))
        if "compression" in r:
            h.codec = self._kv_codec().start(r["compression"], geometry)
            h.on_demand, h.meta_codec = r.get("on_demand"), r.get("meta_codec")
            if h.on_demand not in (None, F16):  # a row pipeline encodes the original rows on demand
                h.original = np.zeros((2, cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim), WIRE_DTYPE)
        with self._lock:
            self._held[h.rid] = h
        return h

    # ---------------------------------------------------------------- compression (KVServe)
    def _absorb_dropping(self, peer, h: _Held, prompt, proactive: dict):
        """A token-dropping request after the prefill (jkv/compression/dropping.py): keep table,
        absorb, then its proactive pushes."""
        h.codec.absorb_request(self.model, prompt, h.kv.kv)
        for layer, blocks in proactive.items():
            self._push(peer, h, layer, blocks, "proactive")

    def _warm_codec(self, peer_name: str, payload) -> bytes:
        """RPC from a connecting decode worker: its pipelines (`CompressionPolicy.pipelines`). Compile
        this worker's prefill-side codec for each (`KVCodec.warm_absorb`) and reply when done; the
        decode worker's connect waits for it, so its first request finds the codec warm. Once per
        pipeline per process (a lock keeps two decode workers from compiling the same one twice)."""
        header, _ = proto.unpack(payload)
        cfg = self.model.cfg
        max_tokens = min(int(header.get("max_tokens", 0)), MAX_WARM_TOKENS)
        for spec_id in header.get("pipelines", []):
            with self._warm_lock:
                if not isinstance(spec_id, str) or spec_id in self._warmed_codecs:
                    continue
                started = time.perf_counter()
                try:
                    self._kv_codec().warm_absorb(spec_id, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_tokens)
                except ValueError as e:  # an unknown pipeline id: its requests fail with the same error later
                    log.warning("%s: cannot warm pipeline %r from %r: %s", self.name, spec_id, peer_name, e)
                    continue
                self._warmed_codecs.add(spec_id)
            log.info("%s: codec %s warmed for prompts up to %d tokens in %.1f s", self.name, spec_id, max_tokens,
                     time.perf_counter() - started)
        return b""

    def _kv_codec(self):
        if self.codec is None:
            self.codec = KVCodec()
        return self.codec

    def _link_counters(self) -> tuple[int, float]:
        tx = self.bulk.metrics.snapshot()["tx"]
        return sum(tx[k]["bytes"] for k in ("write", "notify")), sum(tx[k]["busy_s"] for k in ("write", "notify"))

    def _link_sample(self, before, held) -> dict:
        """Busy-time goodput of this batch's bulk traffic (KVServe §3.1: B is measured goodput), for
        the decode side's bandwidth estimator; waits for the batch's pushes to be acknowledged (the
        hand-off queues behind them on the same connection anyway). Only batches with a compressed
        request wait (their hand-off carries the sample); see `_link_sample_later` for the others."""
        self.link_sample_waits += 1
        for h in held:
            for t in list(h.inflight):
                try:
                    t.wait(timeout=60.0)
                except TransportError:
                    pass
        nbytes, busy = self._link_counters()
        return dict(bytes=nbytes - before[0], busy_s=busy - before[1])

    def _link_sample_later(self, peer_name: str, before, held) -> None:
        """The same sample without waiting: once every push of the batch is acknowledged (a done
        callback, on a transport thread), it goes to the decode worker as a "link" notification
        (one sample per request, as a hand-off would carry). The hand-off does not wait for it."""
        pending = [t for h in held for t in list(h.inflight) if not t.done()]
        rids = [h.rid for h in held]
        left = [len(pending)]
        lock = threading.Lock()

        def send(_t=None):
            with lock:
                left[0] -= 1
                if left[0] > 0:
                    return
            nbytes, busy = self._link_counters()
            self._notify(peer_name, "link", dict(rids=rids, bytes=nbytes - before[0], busy_s=busy - before[1]))

        if not pending:
            left[0] = 1
            send()
        for t in pending:
            t.add_done_callback(send)

    @staticmethod
    def _first_tokens(logits, requests):
        sp = [r["sampling"] for r in requests]
        return sample_or_argmax(logits, np.asarray([s["temperature"] for s in sp], np.float32),
                                np.asarray([s["top_k"] for s in sp], np.int32),
                                np.asarray([s["top_p"] for s in sp], np.float32),
                                np.asarray([s["seed"] for s in sp], np.uint32), np.zeros(len(sp), np.int32))

    # ---------------------------------------------------------------- RPCs
    def _fetch(self, peer_name, payload):
        """On-demand rows (§4.2): rows of each (request, head) contiguous, K block then V block
        (the wire format is jkv/kvbuffers/fetch.py)."""
        try:
            return self._fetch_rows(payload)
        except Exception as e:
            self.on_fetch_failed(e)
            raise

    def _fetch_rows(self, payload):
        layer, items, framed, seq = parse_fetch_framed(payload)
        ks, vs, parts = [], [], []
        for rid, heads in items:
            # No lock: a speculative push may hold it, and the on-demand reply is on the decode
            # step's critical path (dict lookups and attribute stores are atomic in CPython; a
            # request freed meanwhile still has its buffers referenced by `h`).
            h = self._held.get(rid)
            if h is not None:
                h.lease_until = time.monotonic() + self.lease_s
            if h is None:
                raise KeyError(f"{self.name} holds no KV for request {rid!r} (freed, expired or never prefilled)")
            nbytes, first = 0, len(ks)
            source = h.kv.kv if h.original is None else h.original
            for head, p in enumerate(heads):
                if len(p):
                    if p.max() >= h.geometry.num_tokens or p.min() < 0:
                        raise ValueError(f"request {rid}: fetch positions outside [0, {h.geometry.num_tokens})")
                    ks.append(source[0, layer, head, p])
                    vs.append(source[1, layer, head, p])
                    nbytes += 2 * len(p) * h.kv.kv.shape[-1] * 4  # float32 rows
            if seq is not None and h.codec is None:  # exact rows: a push may leave them out once kept
                h.served.record(seq, layer, heads)
            if framed:  # one container per item, each as its request's on-demand path chose
                part = self._encode_rows(h, layer, ks[first:], vs[first:])
                parts.append(part)
                nbytes = len(part) if h.on_demand is not None else nbytes
            h.bytes["on_demand"] += nbytes
        reply = pack_framed_reply(parts) if framed else pack_reply(ks, vs)
        if reply and isinstance(self.bulk.pacer, _YieldToOnDemand):
            self.bulk.pacer.reserve(len(reply))
        return reply

    def _encode_rows(self, h: _Held, layer: int, ks: list, vs: list) -> bytes:
        """One request's rows of a framed reply (jkv.compression.paths.encode_rows)."""
        D = h.kv.kv.shape[-1]
        k = np.concatenate(ks) if ks else np.zeros((0, D), np.float32)
        v = np.concatenate(vs) if vs else np.zeros((0, D), np.float32)
        pipeline = None if h.on_demand in (None, F16) else self._kv_codec().pipeline(h.on_demand)
        return encode_rows(pipeline, h.on_demand, k, v, layer)

    def _free_call(self, peer_name, payload):
        header, _ = proto.unpack(payload)
        self.on_free_requested(header["rid"])
        return proto.pack(dict(bytes=self._release(header["rid"])))

    def _release(self, rid: str):
        """Forget a request: wait for its in-flight writes (their buffers), then free its KV."""
        with self._lock:
            h = self._held.pop(rid, None)
        if h is None:
            self.on_released(rid, None)
            return None
        with h.push_lock:  # waits for a push in progress; none starts after this
            h.released = True
        for t in h.inflight:
            try:
                t.wait(timeout=60.0 if self.endpoint.peers else 1.0)
            except TransportError:
                pass
        self.pool.free(rid)
        self.on_released(rid, h.bytes)
        return h.bytes

    def _lease_loop(self) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            with self._lock:
                for h in self._held.values():  # a write still draining over the link is activity:
                    if any(not t.done() for t in h.inflight):  # a full push may outlast the lease
                        h.lease_until = max(h.lease_until, now + self.lease_s)
                expired = [rid for rid, h in self._held.items()
                           if h.lease_until < now or h.peer not in self.endpoint.peers]
            for rid in expired:
                log.warning("%s: freeing request %s (lease expired or decode peer gone)", self.name, rid)
                self._release(rid)

    def close(self) -> None:
        self._closed.set()
        self._lease_thread.join()
        for rid in self.held():
            self._release(rid)
        self.endpoint.close()
        self.bulk.close()


# -------------------------------------------------------------------- process entry
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jkv prefill-worker", description="run a SmartGen prefill worker")
    add_args(p)
    return run_from_args(p.parse_args(argv))


def add_args(p):
    p.add_argument("--model", required=True, help='model name/path, or "tiny:llama:0"')
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="shard the weights and KV cache "
                   "over N devices; any decode side's degree works (KV crosses per KV-head slice; docs/scale.md)")
    p.add_argument("--selector-file", required=True, help="selector saved by the decode side (save_selector)")
    p.add_argument("--name", default="prefill-0")
    p.add_argument("--listen", default=None, help="host:port, or main|bulk host:port pair (default 127.0.0.1 on "
                                                  "free ports)")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--bandwidth", default=None, help='paced link, e.g. "1gbit"')
    p.add_argument("--lease-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--max-blocks", type=int, default=None,
                   help="M the decode side must use (checked in the handshake; default: any)")
    p.add_argument("--prefix-cache-tokens", type=int, default=0, help="tokens of prompt KV this worker's own "
                   "prefix cache keeps (host memory, LRU); a prompt that starts with cached pages is prefilled "
                   "from its first uncached token (0: none)")
    p.add_argument("--exit-with-parent", action="store_true", help="exit when the starting process dies")


def run_from_args(args) -> int:
    logging.basicConfig(level=os.environ.get("JKV_LOG", "WARNING"))
    secret = os.environ.get("JKV_SECRET")
    if not secret:
        print("error: set JKV_SECRET to the deployment's shared secret (>= 8 bytes)", file=sys.stderr)
        return 2
    model = load_model_spec(args.model, args.dtype, tensor_parallel=args.tensor_parallel)
    selector = load_selector(args.selector_file)
    worker = PrefillWorker(model, selector, args.name, secret=secret, backend=args.transport,
                           bandwidth=args.bandwidth, lease_s=args.lease_s, timeout=args.timeout_s,
                           max_blocks=args.max_blocks, prefix_cache_tokens=args.prefix_cache_tokens)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    address = worker.listen(args.listen)
    print(f"JKV-READY {address}", flush=True)
    runner = threading.Thread(target=worker.run, name="jkv-prefill-main", daemon=True)
    runner.start()
    parent = os.getppid()
    try:
        while not stop.wait(0.2):
            if args.exit_with_parent and os.getppid() != parent:
                log.warning("%s: parent process exited; shutting down", args.name)
                break
    except KeyboardInterrupt:
        pass
    worker.close()
    runner.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
