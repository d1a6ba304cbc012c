"""Registered memory regions and page-aligned host buffers.

A :class:`Region` is a named, writable, C-contiguous buffer (usually a numpy array such as
the decode worker's KV pool ``K, V: [H_kv, N, D]`` or its mask ``kv_mask: i8[B, N]``) that
authenticated peers may write into. Peers address regions by *name*; on the wire a region
is its numeric ``id``, which is never reused, so a frame aimed at an unregistered region
is rejected rather than landing in whatever took its place.

Concurrency: the table is guarded by a lock; reader threads look regions up by id while
user threads register new ones.
"""
from __future__ import annotations

import itertools
import mmap
import struct
import threading
from dataclasses import dataclass, field

import numpy as np

PAGE = mmap.PAGESIZE


def aligned_empty(shape, dtype=np.uint8, align: int = PAGE, *, zeroed: bool = False) -> np.ndarray:
    """An uninitialised C-contiguous array whose data pointer is ``align``-byte aligned; with
    ``zeroed``, all zeros at no cost up front: a large one comes from calloc as fresh pages the
    kernel zero-fills when first touched, where filling an empty one would write every byte now
    (a decode request's 100 MB staging at 4 x 2K: 22-220 ms) and map pages nothing may ever use."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (np.zeros if zeroed else np.empty)(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def as_byte_view(obj, *, writable: bool = False, what: str = "buffer") -> memoryview:
    """Flat ``uint8`` memoryview of a bytes-like / numpy object without copying."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} of type {type(obj).__name__} does not support the buffer "
                        f"protocol; pass bytes, bytearray, memoryview or a numpy array") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous; pass np.ascontiguousarray(...)")
    if writable and mv.readonly:
        raise ValueError(f"{what} is read-only; a registered region must be writable")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


@dataclass(eq=False)
class Region:
    """A registered buffer. ``view`` is the flat byte view writes land in."""

    name: str
    id: int
    array: object
    view: memoryview = field(repr=False)

    @property
    def nbytes(self) -> int:
        return len(self.view)


class RegionTable:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_name: dict[str, Region] = {}
        self._by_id: dict[int, Region] = {}
        self._ids = itertools.count(1)

    def register(self, name: str, array) -> Region:
        if not isinstance(name, str) or not name or len(name.encode()) > 255:
            raise ValueError(f"region name {name!r} must be a non-empty string of <= 255 bytes")
        view = as_byte_view(array, writable=True, what=f"region {name!r}")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"region {name!r} is already registered; unregister it first")
            region = Region(name, next(self._ids), array, view)
            self._by_name[name] = region
            self._by_id[region.id] = region
        return region

    def unregister(self, name: str) -> None:
        with self._lock:
            region = self._by_name.pop(name, None)
            if region is None:
                raise KeyError(f"no region {name!r} registered (have {sorted(self._by_name)})")
            del self._by_id[region.id]

    def by_id(self, region_id: int) -> Region | None:
        with self._lock:
            return self._by_id.get(region_id)

    def by_name(self, name: str) -> Region | None:
        with self._lock:
            return self._by_name.get(name)

    def encode(self) -> bytes:
        """Table sent to authenticated peers: per region u32 id, u64 nbytes, u8 len, name."""
        with self._lock:
            regions = list(self._by_name.values())
        out = [struct.pack("<I", len(regions))]
        for r in regions:
            raw = r.name.encode()
            out.append(struct.pack("<IQB", r.id, r.nbytes, len(raw)) + raw)
        return b"".join(out)


@dataclass(frozen=True)
class RemoteRegion:
    name: str
    id: int
    nbytes: int
    addr: int = 0  # rdma only: virtual address and rkey of the remote memory region
    rkey: int = 0


def decode_region_table(data) -> dict[str, RemoteRegion]:
    data = bytes(data)
    (count,) = struct.unpack_from("<I", data)
    pos, out = 4, {}
    for _ in range(count):
        rid, nbytes, n = struct.unpack_from("<IQB", data, pos)
        pos += 13
        name = data[pos:pos + n].decode()
        pos += n
        out[name] = RemoteRegion(name, rid, nbytes)
    return out
