"""Layer lookahead: layer l+1's remote rows go on the wire while layer l computes.

InfiniGen scores layer l+1 with a query computed from layer l's *input* (its speculation,
SmartGen §4.4 / InfiniGen §4), which exists at the start of layer l; the only thing it lacks
then is the current token's own key, and that row is always local. So at the start of layer l
the decode worker runs the selector for layer l+1 on what it has (the metadata without the
current token, lengths without it: `hint: i32[B*H_kv, k]`), and `LayerLookahead.issue` sends
one asynchronous "fetch" per owner for the hint's rows that are neither local nor fetched yet.
Selectors that score with the true query (Oracle, Quest) get the same speculative query as a
hint. At layer l+1 `complete` puts the replies into the request's host staging buffer (rows
marked fetched, as an on-demand fetch does), and the worker lands them into their device pages
*before* the real selection is split against the device mask, so only the rows the hint missed
are fetched synchronously.

Correctness never depends on the prefetch: attention gathers the real selection, and a
prefetched row holds the same bytes a synchronous fetch or a later block write brings. A
prefetch that fails (its owner died, the request was cancelled or freed meanwhile) is dropped
and counted; the synchronous fetch then asks for those rows and surfaces a dead owner through
the usual path. Nothing is held for a prefetch on either side (the owner serves it like any
fetch), so an abandoned one leaks nothing.

Threads: `start`, `complete` and `clear` run on the decode worker's engine thread. With
`threaded=True` the hint (a selector call) and `issue` run on one helper thread, so the hint's
compute overlaps layer l's on a second core; the helper touches only layer l+1's mask, fetched
rows and metadata, which the engine thread leaves alone until `complete(l+1)` has joined it.
The replies complete on transport threads through their `Transfer` futures.

Gating: in a request's first decode step (`gated`, set per step by the decode worker) a
prefetch leaves only after the previous layer's synchronous fetch is on the wire: the link is
FIFO per owner and a first-step prefetch is a whole layer's selection, so a row the hint missed
would wait behind it. Later steps send each prefetch as soon as its hint exists: the prefetch is
small, the hint (with its margin) misses almost nothing, and holding it through the previous
layer's select left the paced link idle for that long every layer.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

import numpy as np

from jkv.compression.paths import decode_rows
from jkv.kvbuffers.fetch import FetchCall, iter_reply, keep_rows, read_reply
from jkv.kvbuffers.geometry import REMOTE
from transport import TransportError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Prefetch:
    owner: str
    call: FetchCall  # its segments: ((b, h), positions i32[c]) in the order the rows come back
    transfer: object  # transport.Transfer of the "fetch" call


class LayerLookahead:
    """One decode step's in-flight prefetches, per layer (at most one layer ahead)."""

    def __init__(self, endpoint, num_kv_heads: int, head_dim: int, threaded: bool = True):
        self.endpoint, self.H, self.D = endpoint, num_kv_heads, head_dim
        self._pending: dict[int, list[_Prefetch]] = {}
        self._started: dict[int, concurrent.futures.Future] = {}
        self._gates: dict[int, threading.Event] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jkv-lookahead") if threaded else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def clear(self) -> None:
        """Forget every prefetch (a new step; an aborted one's replies are simply not read)."""
        for g in self._gates.values():
            g.set()
        for f in self._started.values():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - an aborted step's hint: nothing to keep
                pass
        self._started.clear()
        self._gates.clear()
        self._pending.clear()

    def release(self, layer: int) -> None:
        """The engine thread has issued the synchronous fetch of layer-1 (or needs none): `layer`'s
        prefetch may go on the wire now. The link is FIFO per owner, so a prefetch sent earlier
        would delay that fetch, which the step is blocked on."""
        gate = self._gates.get(layer)
        if gate is not None:
            gate.set()

    def start(self, lives, layer: int, make_hint, clock):
        """Compute `make_hint() -> (hint i32[B*H_kv, k], extra)` and `issue` it, on the helper thread
        when threaded; `complete(layer)` joins it. Returns a callable giving `extra` (joins)."""
        gate = self._gates[layer] = threading.Event()
        if not self.gated:
            gate.set()

        def run():
            cpu = time.thread_time()
            hint, extra = make_hint()
            cpu -= time.thread_time()
            gate.wait(self.GATE_TIMEOUT_S)  # after the engine thread issued layer-1's own fetch
            cpu += time.thread_time()
            self.issue(lives, layer, hint, clock)
            clock.count("hint_cpu_us_n", (time.thread_time() - cpu) * 1e6)  # this thread's CPU for the hint
            return extra
        if self._pool is None:
            gate.set()
            extra = run()
            return lambda: extra
        fut = self._started[layer] = self._pool.submit(run)
        return fut.result

    gated = True  # hold a prefetch until the previous layer's synchronous fetch is on the wire (per step)
    PREFETCH_TIMEOUT_S = 60.0  # a hint is never waited for without bound (the sync fetch takes over)
    GATE_TIMEOUT_S = 5.0  # a gate nobody opens (an aborted layer) delays the hint, never hangs it

    def issue(self, lives, layer: int, hint: np.ndarray, clock) -> int:
        """hint: i32[B*H_kv, k] speculative selection of `layer` (-1 = none). Sends one async fetch
        per owner for the hinted rows that are REMOTE and not fetched yet; returns rows asked for."""
        H = self.H
        by_owner: dict[str, FetchCall] = {}
        for b, lv in enumerate(lives):
            if not lv.active or lv.released or lv.owner is None:
                continue
            mask, fetched, cap = lv.kv.mask[layer], lv.fetched[layer], lv.kv.capacity
            idx = hint[b * H:(b + 1) * H]  # [H_kv, w]: each row's positions are distinct
            ok = (idx >= 0) & (idx < cap)
            safe = np.where(ok, idx, 0)
            want = ok & (mask[safe] == REMOTE) & ~np.take_along_axis(fetched, safe, axis=1)
            if want.any():
                by_owner.setdefault(lv.owner, FetchCall(layer)).add(
                    lv.rid, [((b, h), idx[h][want[h]].astype(np.int32)) for h in range(H)],
                    framed=lv.compression is not None and lv.compression.on_demand is not None)
        asked = 0
        for owner, call in by_owner.items():
            try:
                t = self.endpoint.peer(owner).call_async("fetch", call.payload())
            except (KeyError, TransportError) as e:  # the synchronous fetch will meet it too
                log.debug("lookahead fetch of layer %d from %r not sent: %s", layer, owner, e)
                continue
            self._pending.setdefault(layer, []).append(_Prefetch(owner, call, t))
            asked += call.rows
            clock.count("prefetches_n", 1)
            clock.count("prefetch_rows_n", call.rows)
        return asked

    def complete(self, lives, layer: int, capacity: int, clock) -> np.ndarray | None:
        """Wait for `layer`'s prefetches and scatter their rows into the pool (marked fetched).
        Returns delivered: bool[B*H_kv, capacity] (rows this layer's prefetch brought), or None."""
        self.release(layer)
        started = self._started.pop(layer, None)
        if started is not None:
            started.result()  # the hint was issued (or its error surfaces here)
        pending = self._pending.pop(layer, None)
        if not pending:
            return None
        H, D = self.H, self.D
        delivered = np.zeros((len(lives) * H, capacity), bool)
        for p in pending:
            try:
                data = p.transfer.result(timeout=self.PREFETCH_TIMEOUT_S)  # OpTimeout is a TransportError
            except TransportError as e:  # a hint only: the synchronous fetch takes over
                log.debug("lookahead fetch of layer %d from %r dropped: %s", layer, p.owner, e)
                clock.count("prefetch_lost_n", 1)
                continue
            reply, failed = read_reply(data, p.call, D, f"lookahead reply from {p.owner!r}", decode_rows)
            for item, ((b, h), pos, k, v) in zip(p.call.segment_items, iter_reply(reply, p.call.segments)):
                if item in failed:  # a corrupted part is never used: its request fails
                    lives[b].error = lives[b].error or f"request {lives[b].req.request_id}: {failed[item]}"
                    continue
                if keep_rows(lives[b], layer, h, pos, k, v, p.call.seq):  # else its staging was freed: dropped
                    delivered[b * H + h, pos] = True
            clock.count("od_bytes_n", reply.nbytes)
            clock.count("prefetch_bytes_n", reply.nbytes)
        return delivered

    @staticmethod
    def hits(delivered: np.ndarray | None, kv_index: np.ndarray) -> np.ndarray:
        """Selected entries per row (i32[B*H_kv]) that this layer's prefetch supplied."""
        if delivered is None:
            return np.zeros(kv_index.shape[0], np.int64)
        safe = np.clip(kv_index, 0, delivered.shape[1] - 1)
        return ((kv_index >= 0) & np.take_along_axis(delivered, safe, axis=1)).sum(1)
