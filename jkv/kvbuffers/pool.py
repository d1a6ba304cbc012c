"""Request-scoped KV buffers: one page-aligned buffer per request, registered with the transport,
allocated when a request is planned (decode) or prefilled (prefill) and freed when it ends.

Per request the pool holds

    kv:   f32[2, L, H_kv, N_cap, D]   (kv[0] = K, kv[1] = V; per layer K, V: [H_kv, N_cap, D])
    mask: i8[L, N_cap]                 (decode side: PAD 0 / LOCAL 1 / REMOTE 2 per token)

`kv` is one contiguous page-aligned array so a peer addresses any (layer, head, token) with a
byte offset (`RequestKV.offset`, jkv/kvbuffers/fetch.py); the prefill side writes a block's rows there and then, in
the same ordered transfer, the block's mask bytes (DESIGN.md "KV mask": a 1 is always safe).

The pool is pure bookkeeping plus numpy buffers: `allocate` reserves bytes against a
capacity and `free` returns them; `live()` and `bytes_in_use` are what leak checks assert
on (after every test each allocation is back). Thread-safe: the prefill worker frees from
transport handler threads while its main thread allocates.

A freed buffer takes no more writes: a writer that is not the transport (an on-demand or
lookahead reply, a decoded "ckv" frame: whatever was in flight when it was freed) asks
`RequestKV.take_write()` first, and a late write is dropped and counted (`late_writes_dropped`),
never written. The transport itself cannot write late: its region is unregistered with the free
(a WRITE to it would be rejected). `free(rid, drop_buffers=True)` also lets the arrays go at once
(the decode worker's engine thread, when every row is in the device pages: staging freed early,
jkv/disagg/decode_owners.py); without it they live until the last reference goes, so a reader on
another thread (a step in flight when a request is cancelled) never finds them missing.
"""
from __future__ import annotations

import threading

import numpy as np

from jkv.kvbuffers.fetch import kv_offset, mask_offset
from jkv.kvbuffers.geometry import LOCAL, PAD, REMOTE
from transport import aligned_empty


class PoolExhausted(RuntimeError):
    pass


class RequestKV:
    """One request's KV buffers. prompt_len: N tokens from prefill; capacity: N_cap slots."""

    def __init__(self, request_id: str, num_layers: int, num_kv_heads: int, capacity: int, head_dim: int,
                 prompt_len: int, dtype=np.float32, with_mask: bool = True):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.capacity = capacity
        self.kv = aligned_empty((2, num_layers, num_kv_heads, capacity, head_dim), dtype, zeroed=True)
        self.mask = None
        if with_mask:
            self.mask = np.full((num_layers, capacity), PAD, np.int8)
            self.mask[:, :prompt_len] = REMOTE
        self.freed = False  # set by KVBufferPool.free: writes are refused from then on
        self._on_late = None  # the pool's counter of refused writes

    def take_write(self) -> bool:
        """Whether a write may go into these buffers now; False once freed (the write is dropped
        and counted as late by the pool). Writers check right before writing, on the thread that
        writes (the buffers are dropped only on the decode worker's engine thread)."""
        if not self.freed:
            return True
        self._on_late()
        return False

    @property
    def K(self) -> np.ndarray:
        """[L, H_kv, N_cap, D]"""
        return self.kv[0]

    @property
    def V(self) -> np.ndarray:
        """[L, H_kv, N_cap, D]"""
        return self.kv[1]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.mask.nbytes if self.mask is not None else 0)

    def offset(self, kv: int, layer: int, head: int, token: int) -> int:
        """Byte offset of kv[kv, layer, head, token, 0] in the flat buffer."""
        _, L, H, N, D = self.kv.shape
        return kv_offset(L, H, N, D, kv, layer, head, token, self.kv.itemsize)

    def mask_offset(self, layer: int, token: int) -> int:
        return mask_offset(self.capacity, layer, token)

    def all_local(self) -> bool:
        """Every prompt token of every layer has landed (mask == LOCAL)."""
        return bool((self.mask[:, :self.prompt_len] == LOCAL).all())

    def local_fraction(self) -> float:
        return float((self.mask[:, :self.prompt_len] == LOCAL).mean())


class KVBufferPool:
    """Allocates RequestKV buffers against `capacity_bytes` (None = unbounded)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_bytes: int | None = None,
                 dtype=np.float32, with_mask: bool = True):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.capacity_bytes = capacity_bytes
        self.dtype = np.dtype(dtype)
        self.with_mask = with_mask
        self._lock = threading.Lock()
        self._live: dict[str, RequestKV] = {}
        self.bytes_in_use = 0
        self.late_writes_dropped = 0  # writes refused because their request's buffers were freed

    def allocate(self, request_id: str, prompt_len: int, capacity: int) -> RequestKV:
        if not 1 <= prompt_len <= capacity:
            raise ValueError(f"request {request_id}: need 1 <= {prompt_len=} <= {capacity=}")
        need = (2 * self.num_layers * self.num_kv_heads * capacity * self.head_dim * self.dtype.itemsize
                + (self.num_layers * capacity if self.with_mask else 0))
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} already holds KV in this pool")
            if self.capacity_bytes is not None and self.bytes_in_use + need > self.capacity_bytes:
                raise PoolExhausted(f"request {request_id}: needs {need} bytes but only "
                                    f"{self.capacity_bytes - self.bytes_in_use} of {self.capacity_bytes} are free; "
                                    "raise the pool capacity or lower the batch size")
            self.bytes_in_use += need
        kv = RequestKV(request_id, self.num_layers, self.num_kv_heads, capacity, self.head_dim, prompt_len,
                       self.dtype, self.with_mask)
        with self._lock:
            self._live[request_id] = kv
        return kv

    def get(self, request_id: str) -> RequestKV | None:
        with self._lock:
            return self._live.get(request_id)

    def free(self, request_id: str, drop_buffers: bool = False) -> bool:
        """Release a request's buffers; False if it held none (idempotent). From now on its
        `take_write()` refuses (and counts) writes. drop_buffers: also drop the arrays now (the
        caller knows no other thread reads them); `kv` and `mask` become None."""
        with self._lock:
            kv = self._live.pop(request_id, None)
            if kv is None:
                return False
            self.bytes_in_use -= kv.nbytes
            assert self.bytes_in_use >= 0
            kv.freed, kv._on_late = True, self._count_late
        if drop_buffers:
            kv.kv = kv.mask = None
        return True

    def _count_late(self) -> None:
        with self._lock:
            self.late_writes_dropped += 1

    def live(self) -> list[str]:
        with self._lock:
            return sorted(self._live)


__all__ = ["KVBufferPool", "RequestKV", "PoolExhausted", "PAD", "LOCAL", "REMOTE"]
