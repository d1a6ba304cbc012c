"""The prefill worker's pushes: proactive (§4.1) and speculative (§4.3) block writes.

`PushSide` is a mixin of `PrefillWorker` (jkv/disagg/prefill_worker.py): it reads the worker's
`bulk` endpoint, `head_slices`, `kv_export`, `lease_s`, `_lock` and `_held`, and each held
request's fields (`_Held`: geometry, order, sent, spec cursor and cap, in-flight writes, codec,
`served`).

    _push   a layer's blocks as one write_many per KV-head slice (jkv/disagg/head_slices.py), or
            one "ckv" notification of the chunks covering them (a compressed request, KVServe);
            the rows the decode side confirmed it keeps from on-demand replies are left out
            (jkv/disagg/served_rows.py), their runs' mask bytes still follow
    _spec   the "spec" notification: first the confirmations it carries ("kept"), then the next
            unsent blocks of each request's plan, at most `spec_cap` per trigger and one
            speculative write in flight per request (so an on-demand reply never queues behind
            more than one)

Threads: `_push` runs on the worker's main loop (proactive, during the prefill) and on the
transport notify thread (`_spec`, under `_lock`); `h.push_lock` orders a push against the
request's release (no write into a region the decode side has unregistered).
"""
from __future__ import annotations

import time

from jkv.compression.kv_transfer import KIND as COMPRESSED_KV
from jkv.disagg import protocol as proto
from jkv.disagg.head_slices import push_slices
from jkv.transfer.plan import per_layer


class PushSide:
    def _push(self, peer, h, layer: int, blocks, path: str):
        """`blocks` (indices m of `layer`) as one write_many per KV-head slice (head_slices.py: per
        contiguous run, K rows then V rows of the slice's heads; the run's mask bytes after the last
        slice). Returns the last write. Nothing once the request is released (decode freed it)."""
        with h.push_lock:
            if h.released:
                return None
            return self._push_locked(peer, h, layer, blocks, path)

    def _push_locked(self, peer, h, layer: int, blocks, path: str):
        if h.codec is not None:
            return self._push_compressed(peer, h, layer, blocks, path)
        t, runs = None, h.geometry.runs(blocks)
        sent = push_slices(peer, h.rid, h.kv.kv, h.capacity, layer, runs, self.head_slices, h.served.held_rows(layer))
        for heads, t, nbytes in sent:
            h.bytes[path] += nbytes
            h.inflight.append(t)
        if runs:  # a slice that wrote no row (absent from `sent`, or mask bytes only) had every row held
            wrote = {heads for heads, _, nbytes in sent if nbytes}
            for heads in self.head_slices:
                (self.kv_export.pushed if heads in wrote else self.kv_export.held_only)(heads)
        for m in blocks:
            h.sent[layer * h.geometry.blocks_per_layer + m] = True
        return t

    def _push_compressed(self, peer, h, layer: int, blocks, path: str):
        """The chunks covering `blocks` as one "ckv" notification (see jkv.compression.kv_transfer);
        every block of those chunks becomes sent (the receiver flips their mask after decoding)."""
        chunks, covered = h.codec.cover(blocks)
        for m in covered:
            h.sent[layer * h.geometry.blocks_per_layer + m] = True
        payload = h.codec.frame(h.rid, layer, chunks)
        t = peer.notify(COMPRESSED_KV, payload)
        h.bytes[path] += len(payload)
        h.inflight.append(t)
        return t

    def _spec(self, note) -> None:
        header, _ = proto.unpack(note.payload)
        try:
            peer = self.bulk.peer(note.peer)
        except KeyError:
            return
        kept = header.get("kept") or {}
        for rid in header["rids"]:
            with self._lock:
                h = self._held.get(rid)
                if h is None:
                    continue
                h.lease_until = time.monotonic() + self.lease_s
                if rid in kept:  # before any push below: those rows need none (served_rows.py)
                    h.served.confirm(kept[rid])
                if h.spec_busy is not None and not h.spec_busy.done():
                    continue  # one speculative write in flight per request (§4.3 cap)
                todo, i = [], h.spec_cursor
                while i < len(h.order) and len(todo) < h.spec_cap:
                    if not h.sent[h.order[i]]:
                        todo.append(int(h.order[i]))
                    i += 1
                h.spec_cursor = i
                if not todo:
                    continue
                last = None
                for layer, blocks in per_layer(h.geometry, todo).items():
                    last = self._push(peer, h, layer, blocks, "speculative") or last
                h.spec_busy = last
                h.inflight = [t for t in h.inflight if not t.done()]
