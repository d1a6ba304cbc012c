"""The decode worker's fetch lanes: one layer's selected K, V rows, wherever they are.

Per layer of a decode step (engine thread; SmartGen §4.2, Algorithm 1):

    land      what arrived in staging since the last layer goes into the device pages, mask 1
              (jkv/disagg/decode_pages.py)
    split     the device mask of each row (request x KV head: a row fetched earlier is in the pages,
              so it is 1) and `split_reorder` of the selection against it, on the device:
              i32[B*H_kv, k] reordered remote-first plus each row's remote count (to the host)
    remote    one asynchronous "fetch" RPC per owner with each row's remote-first prefix
              (`jkv.kvbuffers.fetch.FetchCall`); in the serial modes (`partial`, `+profile`) the
              replies are awaited before the local lane starts
    wait      the replies, in owner order; their rows go into staging (marked fetched) and are
              landed into their pages (KV reuse, DESIGN.md): the only rows that cross host->device
    local     a gather of every selected row from the pages, attention in selection order (so
              the output never depends on which lane supplied a row) and the MLP: one program
              (`decode_program.attend`)

Failure policy (`_gather`): a transport error of one owner is an `OwnerDown`; when the owner
only refused the RPC because a request in it was cancelled or freed meanwhile, the layer is
fetched again without it, otherwise the owner's requests fail (or are recomputed).

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
    def _gather(self, st, layer, kv_index, q):
        """kv_index: i32[B*H, k] (device), q: [B, H_q, D] -> (x [B, hidden]: the layer's output,
        attention over every selected row in selection order and the MLP; remote: i32[B*H] entries
        fetched on demand this layer)."""
        lives = st.lives
        while True:
            fetchable = {id(lv) for lv in lives if lv.fetchable}
            try:
                return self._gather_once(st, layer, kv_index, q)
            except OwnerDown as e:
                # A request cancelled (or freed) while its rows were being fetched makes the owner
                # refuse the whole RPC; the owner is alive: fetch again without that request.
                gone = [lv for lv in lives if lv.owner == e.owner and id(lv) in fetchable and not lv.fetchable]
                if isinstance(e.error, RemoteError) and gone:
                    continue
                self._owner_failed(e.owner, e.error, lives + self._pending)

    def _gather_once(self, st, layer, kv_index, q):
        lives = st.lives
        # What landed in staging since the last layer (pushes, "ckv", the lookahead's replies, a
        # recomputed prompt) goes to the device pages first, so the split sees it as local.
        self.pages.land(lives, layer, st.table_np, self.phases)
        self.phases.lap("land")
        fetchable = np.asarray([lv.fetchable for lv in lives])
        reordered, remote_count = self.programs.split(self.pages.mask, np.int32(layer), st.table, fetchable, kv_index)
        reordered, remote_count = np.asarray(reordered), np.asarray(remote_count)
        self.phases.lap("split")
        pending = [(owner, call, self._call(owner, call.payload()))
                   for owner, call in self._fetch_calls(lives, layer, reordered, remote_count)]
        if not self.transfer.parallel_lanes:  # serial lanes: remote first, then local
            for _, _, t in pending:
                self._wait(t)
        self.phases.lap("remote_issue")
        self._lookahead.release(layer + 1)  # the next layer's prefetch queues behind this fetch
        for owner, call, t in pending:
            self._scatter(lives, layer, owner, call, self._wait(t))
        if pending:  # the replies' rows into their pages (KV reuse), before attention reads them
            self.pages.land(lives, layer, st.table_np, self.phases)
            self.phases.lap("land")
        # Local lane: every selected row from the pages (on the device), in selection order, then
        # attention and the MLP in the same program.
        K, V = self.pages.cache.kv[layer]
        x = self.programs.attend(self.model.layer_params(layer), st.x, q, K, V, st.table, kv_index)
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
