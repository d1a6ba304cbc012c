"""The decode worker's fetch lanes: one layer's selected K, V rows, wherever they are.

Per layer of a decode step (engine thread; SmartGen §4.2, Algorithm 1):

    split     a snapshot of each row's mask (request x KV head), rows fetched earlier counting as
              local, and `split_reorder` of the selection against it: i32[B*H_kv, k] reordered
              remote-first plus each row's remote count
    remote    one asynchronous "fetch" RPC per owner with each row's remote-first prefix
              (`jkv.kvbuffers.fetch.FetchCall`); in the serial modes (`partial`, `+profile`) the
              replies are awaited before the local lane starts
    local     a numpy gather of every selected slot from the pool (remote slots are overwritten)
    wait      the replies, in owner order
    scatter   remote rows into their slots of the selection and into the pool (marked fetched,
              so a later step reuses them: KV reuse, DESIGN.md)

Failure policy (`_gather`): a transport error of one owner is an `OwnerDown`; when the owner
only refused the RPC because a request in it was cancelled or freed meanwhile, the layer is
fetched again without it, otherwise the owner's requests fail (or are recomputed).

`FetchLanes` is a mixin of `DecodeWorker`: it reads the worker's `model`, `transfer`,
`endpoint`, `phases`, `_split`, `_lookahead` and `_pending`, and calls `_owner_failed`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv.compression.paths import decode_rows
from jkv.disagg.decode_state import OwnerDown
from jkv.kvbuffers.fetch import FetchCall, iter_reply, keep_rows, read_reply
from jkv.kvbuffers.geometry import LOCAL, PAD, REMOTE
from transport import RemoteError, TransportError


class FetchLanes:
    def _gather(self, lives, layer, kv_index, capacity):
        """kv_index: i32[B*H, k] -> K_sel, V_sel: f32[B, H, k, D] in selection order, remote: i32[B*H].
        capacity: the batch N_cap (>= every member's own pool capacity)."""
        while True:
            fetchable = {id(lv) for lv in lives if lv.fetchable}
            try:
                return self._gather_once(lives, layer, kv_index, capacity)
            except OwnerDown as e:
                # A request cancelled (or freed) while its rows were being fetched makes the owner
                # refuse the whole RPC; the owner is alive: fetch again without that request.
                gone = [lv for lv in lives if lv.owner == e.owner and id(lv) in fetchable and not lv.fetchable]
                if isinstance(e.error, RemoteError) and gone:
                    continue
                self._owner_failed(e.owner, e.error, lives + self._pending)

    def _gather_once(self, lives, layer, kv_index, capacity):
        mask = self._mask_snapshot(lives, layer, capacity)
        reordered, remote_count, _ = self._split(jnp.asarray(kv_index), jnp.asarray(mask))
        reordered, remote_count = np.asarray(reordered), np.asarray(remote_count)
        self.phases.lap("split")
        safe = np.maximum(kv_index, 0)
        is_remote = (kv_index >= 0) & (np.take_along_axis(mask, safe, axis=1) == REMOTE)
        assert (is_remote.sum(1) == remote_count).all(), "split_reorder disagrees with the mask snapshot"
        pending = [(owner, call, self._call(owner, call.payload()))
                   for owner, call in self._fetch_calls(lives, layer, reordered, remote_count)]
        if not self.transfer.parallel_lanes:  # serial lanes: remote first, then local
            for _, _, t in pending:
                self._wait(t)
        self.phases.lap("remote_issue")
        self._lookahead.release(layer + 1)  # the next layer's prefetch queues behind this fetch
        # Local lane: gather every selected slot from the pool (remote slots are overwritten below).
        H = self.model.cfg.num_kv_heads
        heads = np.arange(H)[:, None]
        K_sel = np.stack([lv.kv.kv[0, layer][heads, safe[b * H:(b + 1) * H]] for b, lv in enumerate(lives)])
        V_sel = np.stack([lv.kv.kv[1, layer][heads, safe[b * H:(b + 1) * H]] for b, lv in enumerate(lives)])
        self.phases.lap("local")
        for owner, call, t in pending:
            self._scatter(lives, layer, owner, call, self._wait(t), is_remote, K_sel, V_sel)
        return K_sel, V_sel, is_remote.sum(1)

    def _mask_snapshot(self, lives, layer, capacity) -> np.ndarray:
        """i8[B*H_kv, N_cap]: one snapshot of the mask per row (request, KV head). Rows fetched on
        demand earlier are kept in the pool (KV reuse, DESIGN.md) and count as local here; the
        shared token mask itself still only turns 1 when a block lands. Members with a smaller pool
        than the batch N_cap are padded with PAD (never selected)."""
        H = self.model.cfg.num_kv_heads
        token_mask = np.full((len(lives), capacity), PAD, np.int8)
        for b, lv in enumerate(lives):
            token_mask[b, :lv.kv.capacity] = lv.kv.mask[layer]
        mask = np.repeat(token_mask, H, axis=0)
        for b, lv in enumerate(lives):
            rows = mask[b * H:(b + 1) * H, :lv.kv.capacity]
            if not lv.fetchable:  # nothing remote to fetch (inactive rows are ignored)
                rows[rows == REMOTE] = LOCAL
            else:
                rows[lv.fetched[layer] & (rows == REMOTE)] = LOCAL
        return mask

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

    def _scatter(self, lives, layer, owner, call, data, is_remote, K_sel, V_sel) -> None:
        """One owner's reply: its rows into their selection slots and into the pool."""
        self.phases.lap("remote_wait")
        H = self.model.cfg.num_kv_heads
        reply, failed = read_reply(data, call, K_sel.shape[-1], f"fetch reply from {owner!r}", decode_rows)
        for item, (r, positions, k, v) in zip(call.segment_items, iter_reply(reply, call.segments)):
            b, h = divmod(r, H)
            if item in failed:  # a corrupted part is never used: its request fails at the step's end
                lives[b].error = lives[b].error or f"request {lives[b].req.request_id}: {failed[item]}"
                continue
            slots = np.nonzero(is_remote[r])[0]
            K_sel[b, h, slots] = k
            V_sel[b, h, slots] = v
            keep_rows(lives[b], layer, h, positions, k, v)  # identical bytes to what a later block write brings
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
