"""The rdma backend's control plane, as a mixin of :class:`transport.endpoint.Endpoint`: the
regions table and QP set-up a peer asks for over its tcp control connection, the outgoing
channel per peer, and the completion-polling loop (``jkvt-rdma-poll-*``).

Uses the endpoint's ``_lock``, ``_mr`` (region id -> memory keys), ``regions``, ``rdma``,
``_rdma_in``/``_rdma_out`` and ``_closed``; kept apart so endpoint.py holds the backend-neutral
parts.
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from transport.errors import TransportError
from transport.peer import RDMA_QP_METHOD, RDMA_REGIONS_METHOD

if TYPE_CHECKING:
    from transport.peer import Peer

log = logging.getLogger("transport.endpoint")


class RdmaControl:
    def _rdma_control(self, peer_name: str, method: str, payload: memoryview) -> bytes:
        if method == RDMA_REGIONS_METHOD:
            table = []
            for rid, keys in list(self._mr.items()):
                region = self.regions.by_id(rid)
                if region is not None:
                    table.append([region.name, rid, region.nbytes, keys.addr, keys.rkey])
            return json.dumps(table).encode()
        qp = self.rdma.create_qp()  # RDMA_QP_METHOD: the peer asks for a QP to write through
        qp.connect(bytes(payload))
        with self._lock:
            old = self._rdma_in.pop(peer_name, None)
            self._rdma_in[peer_name] = qp
        if old is not None:
            old.close()
        return qp.local_info()

    def rdma_channel(self, peer: Peer):
        """rdma backend: the channel this endpoint writes to ``peer`` through (its QP is set
        up over ``peer``'s control connection on first use). Used by :class:`Peer`."""
        from transport.rdma import RdmaChannel
        with self._lock:
            channel = self._rdma_out.get(peer.name)
        if channel is not None:
            return channel
        qp = self.rdma.create_qp()
        try:
            qp.connect(bytes(peer.call(RDMA_QP_METHOD, qp.local_info())))
        except Exception:
            qp.close()
            raise
        channel = RdmaChannel(self.rdma, qp, peer.name, self._local_keys)
        with self._lock:
            existing = self._rdma_out.setdefault(peer.name, channel)
        if existing is not channel:
            channel.close()
        return existing

    def _local_keys(self, addr: int, nbytes: int):
        for keys in list(self._mr.values()):
            if keys.addr <= addr and addr + nbytes <= keys.addr + keys.nbytes:
                return keys
        return None

    def _poll_rdma(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                channels = list(self._rdma_out.values())
            completed = 0
            now = time.monotonic()
            for ch in channels:
                try:
                    completed += ch.poll()
                except Exception as e:  # a broken CQ fails that peer's transfers, not the loop
                    log.warning("polling RDMA completions for %r failed: %s", ch.peer_name, e)
                    ch.fail(TransportError(f"RDMA completion polling failed: {e}"))
                ch.expire(now)
            if not completed:
                self._closed.wait(0.0002)
