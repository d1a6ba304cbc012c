"""An in-process loopback "NIC" with the device interface of transport.rdma (for tests).

Two endpoints in one process share a :class:`Fabric` (QP numbers and rkeys). Posting
executes each WRITE immediately with ``ctypes.memmove`` after checking the local lkey and
the remote rkey bounds, in posting order like an RC QP; a bad key puts the QP in error and
produces an error completion, as a NIC's protection check would. ``hold`` delays
completions (to model a transfer still in flight).
"""
from __future__ import annotations

import ctypes
import itertools
import json
import threading

from transport.rdma import MemoryKeys
from transport.rdma_plan import DeviceLimits


class Fabric:
    def __init__(self):
        self.keys = itertools.count(100)
        self.qpns = itertools.count(1)
        self.rkeys: dict[int, tuple[int, int]] = {}
        self.qps: dict[int, "LoopbackQP"] = {}
        self.posted: list = []  # every WR posted, in order (for assertions)


class LoopbackVerbs:
    def __init__(self, fabric: Fabric, limits: DeviceLimits = DeviceLimits(max_sge=3, max_send_wr=4,
                                                                            max_inline=8, max_msg=1 << 20)):
        self.fabric, self.limits = fabric, limits
        self.mrs: dict[int, tuple[int, int]] = {}
        self.hold = False
        self.closed = False

    def register(self, addr: int, nbytes: int) -> MemoryKeys:
        key = next(self.fabric.keys)
        self.mrs[key] = (addr, nbytes)
        self.fabric.rkeys[key] = (addr, nbytes)
        return MemoryKeys(addr, nbytes, key, key)

    def deregister(self, keys: MemoryKeys) -> None:
        self.mrs.pop(keys.lkey, None)
        self.fabric.rkeys.pop(keys.rkey, None)

    def create_qp(self) -> "LoopbackQP":
        return LoopbackQP(self)

    def close(self) -> None:
        self.closed = True


def _inside(table, key, addr, n) -> bool:
    if key not in table:
        return False
    base, size = table[key]
    return base <= addr and addr + n <= base + size


class LoopbackQP:
    def __init__(self, dev: LoopbackVerbs):
        self.dev = dev
        self.qpn = next(dev.fabric.qpns)
        dev.fabric.qps[self.qpn] = self
        self.remote: LoopbackQP | None = None
        self.error: str | None = None
        self._completions: list = []
        self._lock = threading.Lock()

    def local_info(self) -> bytes:
        return json.dumps({"qpn": self.qpn}).encode()

    def connect(self, remote: bytes) -> None:
        self.remote = self.dev.fabric.qps[json.loads(remote)["qpn"]]

    def post(self, batch) -> None:
        assert self.remote is not None, "post before connect"
        assert len(batch) <= self.dev.limits.max_send_wr
        for wr in batch:
            assert len(wr.sges) <= self.dev.limits.max_sge
            self.dev.fabric.posted.append(wr)
            if self.error is None:
                data = b""
                for s in wr.sges:
                    if not _inside(self.dev.mrs, s.lkey, s.addr, s.length):
                        self.error = f"local protection error (lkey {s.lkey})"
                        break
                    data += ctypes.string_at(s.addr, s.length)
                if self.error is None:
                    if not _inside(self.dev.fabric.rkeys, wr.rkey, wr.remote_addr, len(data)):
                        self.error = f"remote access error (rkey {wr.rkey})"
                    else:
                        ctypes.memmove(wr.remote_addr, data, len(data))
            if wr.signaled or self.error is not None:
                with self._lock:
                    self._completions.append((wr.wr_id, self.error))

    def poll(self):
        if self.dev.hold:
            return []
        with self._lock:
            out, self._completions = self._completions, []
        return out

    def close(self) -> None:
        self.dev.fabric.qps.pop(self.qpn, None)
