"""``rdma`` backend: one-sided RDMA WRITEs over RC queue pairs (pyverbs), control over TCP.

Data plane: each peer pair gets one RC QP per direction of use. ``write``/``write_many``
are planned by :mod:`transport.rdma_plan` (SGE batching within ``max_sge``, each mask WRITE
after its block's WRITEs, doorbell-batched ``post_send`` chains, selective signaling) and
posted from the caller's thread; a transfer is COMPLETE when the signaled completion of its
last batch arrives (on RC that means the remote NIC acknowledged every WRITE before it).
Control plane (auth, region/QP exchange, RPC, notifications, heartbeats) is the ``tcp``
connection: the peers exchange QP numbers, GIDs and region rkeys over authenticated RPC
(``_jkv.rdma_qp``, ``_jkv.rdma_regions``), so no region is exposed before the HMAC handshake.
A WRITE and a later ``notify`` travel on different channels: wait for the write's
completion before notifying if the receiver must see the bytes first.

Devices: :func:`open_device` opens a pyverbs device; anything with the same small interface
(``limits``, ``register``, ``deregister``, ``create_qp``, ``close``; queue pairs with
``local_info``, ``connect``, ``post``, ``poll``, ``close``) can be passed as
``Endpoint(..., rdma_device=...)`` — the tests use an in-process loopback device.

Install pyverbs: the distro package (Debian/Ubuntu ``apt install python3-pyverbs
rdma-core ibverbs-providers``) matches the system's rdma-core; the PyPI ``pyverbs`` needs
the same rdma-core version and its headers (``libibverbs-dev``, ``libnl-3-dev``,
``libnl-route-3-dev``) and ``cython<3.1`` to build. Without pyverbs or an RDMA device,
:func:`open_device` raises :class:`~transport.errors.BackendUnavailable` suggesting
``--transport tcp``.

Concurrency: posting takes the channel's lock (one QP, one posting order); the endpoint's
``jkvt-rdma-<name>`` thread polls completions and completes/fails transfers.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import numpy as np

from transport.errors import BackendUnavailable, OpTimeout, TransportError
from transport.rdma_plan import BlockWrite, DeviceLimits, LocalSpan, MaskWrite, plan_writes
from transport.transfer import Transfer

log = logging.getLogger(__name__)

_FIX = "run with --transport tcp (or Endpoint(backend='tcp')) on machines without RDMA"


@dataclass(frozen=True)
class MemoryKeys:
    addr: int
    nbytes: int
    lkey: int
    rkey: int


def buffer_address(view: memoryview) -> int:
    """Virtual address of a C-contiguous buffer (read-only buffers included)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


# ---------------------------------------------------------------------- pyverbs device
def open_device(name: str | None = None, port: int = 1, gid_index: int = 0,
                queue_depth: int = 1024) -> "VerbsDevice":
    """Open an RDMA device with pyverbs, or raise BackendUnavailable saying what is missing."""
    try:
        import pyverbs.device as d  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            f"RDMA backend unavailable: pyverbs is not importable ({e}). Install the distro's "
            f"python3-pyverbs (rdma-core) — see transport/rdma.py — or {_FIX}.") from None
    try:
        devices = d.get_device_list()
    except Exception as e:  # pyverbs raises PyverbsRDMAError when no device exists
        raise BackendUnavailable(f"RDMA backend unavailable: no RDMA device ({e}); {_FIX}.") from None
    if not devices:
        raise BackendUnavailable(f"RDMA backend unavailable: no RDMA device found; {_FIX}.")
    names = [dev.name.decode() if isinstance(dev.name, bytes) else dev.name for dev in devices]
    if name is not None and name not in names:
        raise BackendUnavailable(f"RDMA device {name!r} not found (have {names}); {_FIX}.")
    return VerbsDevice(name or names[0], port, gid_index, queue_depth)


class VerbsDevice:  # pragma: no cover - needs an RDMA NIC (tests marked `rdma`)
    def __init__(self, name: str, port: int, gid_index: int, queue_depth: int):
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD
        self._e = e
        self.name, self.port, self.gid_index, self.queue_depth = name, port, gid_index, queue_depth
        self.ctx = Context(name=name)
        attr = self.ctx.query_device()
        self.limits = DeviceLimits(max_sge=min(attr.max_sge, 30),
                                   max_send_wr=min(attr.max_qp_wr, queue_depth),
                                   max_inline=64, max_msg=1 << 30)
        self.pd = PD(self.ctx)
        self.cq_depth = min(attr.max_cqe, 4 * queue_depth)
        self._CQ = CQ
        self._mrs: dict[int, object] = {}

    def register(self, addr: int, nbytes: int) -> MemoryKeys:
        from pyverbs.mr import MR
        e = self._e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        mr = MR(self.pd, nbytes, access, address=addr)
        self._mrs[mr.lkey] = mr
        return MemoryKeys(addr, nbytes, mr.lkey, mr.rkey)

    def deregister(self, keys: MemoryKeys) -> None:
        mr = self._mrs.pop(keys.lkey, None)
        if mr is not None:
            mr.close()

    def create_qp(self) -> "VerbsQueuePair":
        return VerbsQueuePair(self)

    def close(self) -> None:
        for mr in self._mrs.values():
            mr.close()
        self._mrs.clear()
        self.pd.close()
        self.ctx.close()


class VerbsQueuePair:  # pragma: no cover - needs an RDMA NIC (tests marked `rdma`)
    def __init__(self, dev: VerbsDevice):
        import random

        from pyverbs.qp import QP, QPCap, QPInitAttr
        e = dev._e
        self.dev, self._e = dev, e
        self.cq = dev._CQ(dev.ctx, dev.cq_depth, None, None, 0)
        cap = QPCap(max_send_wr=dev.limits.max_send_wr, max_recv_wr=1,
                    max_send_sge=dev.limits.max_sge, max_recv_sge=1,
                    max_inline_data=dev.limits.max_inline)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = QP(dev.pd, init)
        self.psn = random.randrange(1 << 24)
        port_attr = dev.ctx.query_port(dev.port)
        self.lid = port_attr.lid
        self.gid = str(dev.ctx.query_gid(dev.port, dev.gid_index))
        self.mtu = port_attr.active_mtu

    def local_info(self) -> bytes:
        return json.dumps({"qpn": self.qp.qp_num, "psn": self.psn, "lid": self.lid,
                           "gid": self.gid, "mtu": int(self.mtu)}).encode()

    def connect(self, remote: bytes) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        e, info = self._e, json.loads(remote)
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        attr.path_mtu = min(int(self.mtu), int(info["mtu"]))
        attr.dest_qp_num = info["qpn"]
        attr.rq_psn = info["psn"]
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gr = GlobalRoute(dgid=GID(info["gid"]), sgid_index=self.dev.gid_index)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, dlid=info["lid"], port_num=self.dev.port)
        self.qp.to_rts(attr)

    def post(self, batch) -> None:
        from pyverbs.wr import SGE, SendWR
        e = self._e
        head = None
        for wr in reversed(batch):
            flags = (e.IBV_SEND_SIGNALED if wr.signaled else 0) | (e.IBV_SEND_INLINE if wr.inline else 0)
            sges = [SGE(s.addr, s.length, s.lkey) for s in wr.sges]
            send = SendWR(wr_id=wr.wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=len(sges), sg=sges,
                          send_flags=flags, next_wr=head)
            send.set_wr_rdma(wr.rkey, wr.remote_addr)
            head = send
        self.qp.post_send(head)  # one doorbell for the whole chain

    def poll(self) -> list[tuple[int, str | None]]:
        n, wcs = self.cq.poll(num_entries=64)
        out = []
        for wc in wcs[:n]:
            ok = wc.status == self._e.IBV_WC_SUCCESS
            out.append((wc.wr_id, None if ok else f"work completion status {wc.status}"))
        return out

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


# ---------------------------------------------------------------------- data path
class RdmaChannel:
    """One peer's RDMA data path: plans, posts, and matches completions to transfers."""

    def __init__(self, device, qp, peer_name: str, local_keys):
        self.device, self.qp, self.peer_name = device, qp, peer_name
        self._local_keys = local_keys  # callable: (addr, nbytes) -> MemoryKeys | None
        self._lock = threading.Lock()
        self._next_wr = 1
        self._outstanding = 0
        # last wr_id of a transfer -> (transfer, WR count, temporary registrations, mask staging)
        self._waiting: dict[int, tuple[Transfer, int, list[MemoryKeys], object]] = {}
        self.failed: TransportError | None = None

    def post_writes(self, items, remote_regions, transfer: Transfer) -> None:
        """``items``: (region name, offset, byte view, mask (name, offset, view) | None)."""
        temps: list[MemoryKeys] = []
        blocks = []
        masks = [m for *_, m in items if m is not None]
        staging = np.frombuffer(b"".join(bytes(m[2]) for m in masks), np.uint8).copy() if masks else None
        staging_keys = None
        if staging is not None and staging.nbytes:
            staging_keys = self.device.register(buffer_address(memoryview(staging)), staging.nbytes)
            temps.append(staging_keys)
        mpos = 0
        try:
            for region, offset, view, mask in items:
                r = remote_regions[region]
                sources = ()
                if len(view):
                    addr = buffer_address(view)
                    keys = self._local_keys(addr, len(view))
                    if keys is None:
                        keys = self.device.register(addr, len(view))
                        temps.append(keys)
                    sources = (LocalSpan(addr, len(view), keys.lkey),)
                mw = None
                if mask is not None:
                    mr = remote_regions[mask[0]]
                    n = len(mask[2])
                    mw = MaskWrite(LocalSpan(staging_keys.addr + mpos, n, staging_keys.lkey),
                                   mr.addr + mask[1], mr.rkey)
                    mpos += n
                blocks.append(BlockWrite(sources, r.addr + offset, r.rkey, mw))
            with self._lock:
                if self.failed is not None:
                    raise self.failed
                batches = plan_writes(blocks, self.device.limits, first_wr_id=self._next_wr)
                if not batches:
                    transfer.start()
                    transfer.complete()
                    return
                self._next_wr = batches[-1][-1].wr_id + 1
                transfer.start()
                last = batches[-1][-1].wr_id
                self._waiting[last] = (transfer, sum(len(b) for b in batches), temps, staging)
                for batch in batches:
                    self.qp.post(batch)
                    self._outstanding += len(batch)
        except Exception:
            for k in temps:
                self.device.deregister(k)
            raise

    def poll(self) -> int:
        done = self.qp.poll()
        for wr_id, error in done:
            with self._lock:
                entry = self._waiting.pop(wr_id, None)
            if entry is None:
                continue
            transfer, count, temps, _ = entry
            with self._lock:
                self._outstanding -= count
            for k in temps:
                self.device.deregister(k)
            if error is None:
                transfer.complete()
            else:
                transfer.fail(TransportError(f"RDMA write to {self.peer_name!r} failed: {error}"))
                self.fail(TransportError(f"queue pair to {self.peer_name!r} entered error: {error}"))
        return len(done)

    def fail(self, error: TransportError) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = error
            waiting, self._waiting = self._waiting, {}
        for transfer, _, temps, _ in waiting.values():
            transfer.fail(error)
            for k in temps:
                self.device.deregister(k)

    def expire(self, now: float) -> None:
        """Fail transfers past their per-operation deadline (the WRs stay posted; a late
        completion is ignored)."""
        with self._lock:
            late = [(k, v) for k, v in self._waiting.items()
                    if v[0].deadline is not None and now > v[0].deadline]
        for _, (transfer, *_rest) in late:
            transfer.fail(OpTimeout(f"RDMA write to {self.peer_name!r} ({transfer.nbytes} B) did "
                                    f"not complete within its timeout"))

    def close(self) -> None:
        self.fail(TransportError(f"RDMA channel to {self.peer_name!r} closed"))
        self.qp.close()
