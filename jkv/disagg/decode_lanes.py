"""The decode worker's fetch lanes: one layer's selected K, V rows, wherever they are.

Per layer of a decode step (engine thread; SmartGen §4.2, Algorithm 1):

    land      what arrived in staging since the last layer (pushes, "ckv", the lookahead's
              replies) goes into the device pages, mask 1, inside the layer's program
              (`DecodePages.landing`, jkv/disagg/decode_program.py `landed`)
    split     in the same program, after the selection: the device mask of each row (request x
              KV head: a row fetched earlier is in the pages, so it is 1) and `split_reorder` of
              the selection against it: reordered remote-first plus each row's remote count
    local     with layer lookahead the same program gathers every selected row from the pages,
              attends in selection order (so the output never depends on which lane supplied a
              row) and runs the MLP; when no selected row is remote the layer is done
    remote    a true miss: one asynchronous "fetch" RPC per owner with each row's remote-first
              prefix (`jkv.kvbuffers.fetch.FetchCall`); in the serial modes (`partial`,
              `+profile`) the replies are awaited before anything else is issued
    wait      the replies, in owner order; their rows go into staging (marked fetched), then
              `attend_landed` scatters them into their pages (KV reuse, DESIGN.md: the only rows
              that cross host->device besides the landed ones) and runs the local lane again

Failure policy (`_gather`): a transport error of one owner is an `OwnerDown`; when the owner
only refused the RPC because a request in it was cancelled or freed meanwhile, the layer is
fetched again without it, otherwise the owner's requests fail (or are recomputed); either way the
selection is split again (`split`) against what is on the device then.

`FetchLanes` is a mixin of `DecodeWorker`: it reads the worker's `model`, `transfer`,
`endpoint`, `pages`, `programs`, `phases`, `_lookahead` and `_pending`, and calls `_owner_failed`.
"""
from __future__ import annotations

import numpy as np

from jkv.compression.paths import decode_rows
from jkv.disagg.decode_state import OwnerDown
from jkv.kvbuffers.fetch import FetchCall, iter_reply, keep_rows, read_reply
from transport import RemoteError, TransportError


class FetchLanes:
    def _layer_programs(self, st, layer, args):
        """One layer of the running set -> (meta, kv_index i32[B*H, k], selected i32[B*H] (both on the
        device), x [B, hidden], remote i64[B*H]: entries fetched on demand). Everything local:
        `fused`, or `landed` when rows wait in staging; otherwise `_gather`. args: the layer's
        select arguments; every program computes the layer's q, k, v and writes the new K, V."""
        B, H = len(st.lives), self.model.cfg.num_kv_heads
        if any(lv.fetchable for lv in st.lives):
            return self._gather(st, layer, args)
        landing = self.pages.landing(st.lives, layer, st.table_np, self.phases)  # staging rows not yet in pages
        if landing is not None:
            meta, kv_index, selected, _, _, x, _ = self._landed(st, layer, args, np.zeros(B, bool), landing, True)
        else:
            K, V = self.pages.cache.kv[layer]
            meta, kv_index, selected, _, x, K, V, mask = self.programs.fused(
                **args, params=self.model.layer_params(layer), x=st.x, K=K, V=V, mask=self.pages.mask,
                layer=np.int32(layer), table=st.table, fetchable=np.zeros(B, bool))
            self.pages.replace(layer, K, V, mask)
        return meta, kv_index, selected, x, np.zeros(B * H, np.int64)

    def _landed(self, st, layer, args, fetchable, landing, attend_now):
        """`programs.landed` on this layer's pages (replaced by the program's) -> (meta, kv_index,
        selected, reordered, remote_count, x, q), all on the device."""
        K, V = self.pages.cache.kv[layer]
        *out, K, V, mask = self.programs.landed(
            **args, params=self.model.layer_params(layer), x=st.x, K=K, V=V, mask=self.pages.mask,
            layer=np.int32(layer), table=st.table, fetchable=fetchable, landing=landing, attend_now=attend_now)
        self.pages.replace(layer, K, V, mask)
        return out

    def _gather(self, st, layer, args):
        """`_layer_programs` while a request has rows to fetch: one program lands what arrived or was
        prefetched, selects, splits and (with lookahead, where the prefetch supplied the remote rows)
        attends; a true miss (a selected row still remote) is fetched, then `attend_landed`."""
        lives = st.lives
        landing = self.pages.landing(lives, layer, st.table_np, self.phases) or self.pages.null_landing()
        self.phases.lap("land")
        expect_hits = st.lookahead is not None
        meta, kv_index, selected, reordered, remote_count, x, q = self._landed(
            st, layer, args, np.asarray([lv.fetchable for lv in lives]), landing, expect_hits)
        remote_count = np.asarray(remote_count)
        self.phases.lap("landed")
        if expect_hits and not remote_count.any():
            self._lookahead.release(layer + 1)  # no synchronous fetch: the next prefetch may go
            return meta, kv_index, selected, x, remote_count
        reordered = np.asarray(reordered)
        while True:
            fetchable = {id(lv) for lv in lives if lv.fetchable}
            try:
                return (meta, kv_index, selected, *self._fetch_and_attend(st, layer, kv_index, q, reordered,
                                                                          remote_count))
            except OwnerDown as e:
                # A request cancelled (or freed) while its rows were being fetched makes the owner
                # refuse the whole RPC; the owner is alive: fetch again without that request.
                gone = [lv for lv in lives if lv.owner == e.owner and id(lv) in fetchable and not lv.fetchable]
                if not (isinstance(e.error, RemoteError) and gone):
                    self._owner_failed(e.owner, e.error, lives + self._pending)
            # split again against what is on the device now (a recomputed prompt lands here)
            self.pages.land(lives, layer, st.table_np, self.phases)
            reordered, remote_count = (np.asarray(a) for a in self.programs.split(
                self.pages.mask, np.int32(layer), st.table, np.asarray([lv.fetchable for lv in lives]), kv_index))
            self.phases.lap("split")

    def _fetch_and_attend(self, st, layer, kv_index, q, reordered, remote_count):
        """The remote lane for each row's remote-first prefix, then the replies' rows into their pages
        (KV reuse) and attention in one program -> (x, remote_count)."""
        lives = st.lives
        pending = [(owner, call, self._call(owner, call.payload()))
                   for owner, call in self._fetch_calls(lives, layer, reordered, remote_count)]
        if not self.transfer.parallel_lanes:  # serial lanes: remote first, then local
            for _, _, t in pending:
                self._wait(t)
        self.phases.lap("remote_issue")
        self._lookahead.release(layer + 1)  # the next layer's prefetch queues behind this fetch
        for owner, call, t in pending:
            self._scatter(lives, layer, owner, call, self._wait(t))
        landing = self.pages.landing(lives, layer, st.table_np, self.phases) or self.pages.null_landing()
        self.phases.lap("land")
        # Local lane: every selected row from the pages (on the device), in selection order, then
        # attention and the MLP in the same program.
        K, V = self.pages.cache.kv[layer]
        x, K, V, mask = self.programs.attend_landed(self.model.layer_params(layer), st.x, q, K, V, self.pages.mask,
                                                    np.int32(layer), st.table, kv_index, landing)
        self.pages.replace(layer, K, V, mask)
        self.phases.lap("local")
        return x, remote_count

    def _fetch_calls(self, lives, layer, reordered, remote_count) -> list[tuple[str, FetchCall]]:
        """One "fetch" per owner with each row's remote-first prefix (Algorithm 1); segment keys
        are row ids b * H_kv + h."""
        H = self.model.cfg.num_kv_heads
        calls = []
        for owner in {lv.owner for lv in lives if lv.owner is not None}:
            call = FetchCall(layer)
            for b, lv in enumerate(lives):
                counts = remote_count[b * H:(b + 1) * H]
                if lv.owner == owner and counts.sum() > 0:
                    call.add(lv.rid, [(b * H + h, reordered[b * H + h, :counts[h]]) for h in range(H)],
                             framed=lv.compression is not None and lv.compression.on_demand is not None)
            if call.items:
                calls.append((owner, call))
        return calls

    def _scatter(self, lives, layer, owner, call, data) -> None:
        """One owner's reply: its rows into the staging buffers, marked fetched (`land` moves them)."""
        self.phases.lap("remote_wait")
        H = self.model.cfg.num_kv_heads
        reply, failed = read_reply(data, call, self.model.cfg.head_dim, f"fetch reply from {owner!r}", decode_rows)
        for item, (r, positions, k, v) in zip(call.segment_items, iter_reply(reply, call.segments)):
            b, h = divmod(r, H)
            if item in failed:  # a corrupted part is never used: its request fails at the step's end
                lives[b].error = lives[b].error or f"request {lives[b].req.request_id}: {failed[item]}"
                continue
            keep_rows(lives[b], layer, h, positions, k, v, call.seq)  # identical bytes to a later block write
        self.phases.count("od_bytes_n", reply.nbytes)
        self.phases.count("fetches_n", 1)
        self.phases.lap("scatter")

    def _call(self, owner, payload):
        try:
            return self.endpoint.peer(owner).call_async("fetch", payload)
        except (KeyError, TransportError) as e:
            raise OwnerDown(owner, e) from e

    @staticmethod
    def _wait(transfer):
        try:
            return transfer.result()
        except TransportError as e:
            raise OwnerDown(transfer.peer, e) from e
