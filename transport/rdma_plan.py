"""Pure-Python planning of RDMA work requests (no pyverbs needed; unit-tested on any machine).

Turns a list of block writes — each a scatter list of local spans going to one contiguous
remote range, optionally followed by a mask write — into doorbell batches of RDMA WRITE
work requests for one RC queue pair (SmartGen §4.1):

* **SGE batching**: adjacent local spans with the same lkey merge into one SGE; a WR holds
  at most ``max_sge`` SGEs and ``max_msg`` bytes, larger blocks become several WRs.
* **Coalescing**: consecutive blocks whose remote ranges (and mask ranges) are contiguous
  share WRs; their masks become one WR placed after all of their data.
* **Ordering**: every mask WR comes after every data WR of its block(s) in the same posting
  order, on the same QP. RC QPs execute WRITEs in order, so the mask becomes visible only
  after the block (SmartGen relies on the same in-order property of the NIC).
* **Doorbell batching**: WRs are chained into lists of at most ``max_send_wr`` per
  ``post_send``; only the last WR of a batch is signaled (selective signaling — its
  completion implies the completion of every earlier WR on the QP).
* Masks of at most ``max_inline`` bytes are sent inline (no lkey needed at completion time).

:func:`execute` applies a plan to simulated memories; tests use it as the reference NIC.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass(frozen=True)
class DeviceLimits:
    max_sge: int = 30
    max_send_wr: int = 512
    max_inline: int = 64
    max_msg: int = 1 << 30

    def __post_init__(self):
        for name in ("max_sge", "max_send_wr", "max_msg"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_inline < 0:
            raise ValueError(f"max_inline={self.max_inline} must be >= 0")


@dataclass(frozen=True)
class LocalSpan:
    addr: int
    length: int
    lkey: int


@dataclass(frozen=True)
class MaskWrite:
    source: LocalSpan
    dest_addr: int
    rkey: int


@dataclass(frozen=True)
class BlockWrite:
    sources: tuple[LocalSpan, ...]
    dest_addr: int
    rkey: int
    mask: MaskWrite | None = None

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sources)


@dataclass(frozen=True)
class WorkRequest:
    wr_id: int
    sges: tuple[LocalSpan, ...]
    remote_addr: int
    rkey: int
    signaled: bool = False
    inline: bool = False
    is_mask: bool = False
    blocks: tuple[int, ...] = field(default=(), compare=False)  # indices into the input

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


def _merge_spans(spans: Iterable[LocalSpan]) -> list[LocalSpan]:
    out: list[LocalSpan] = []
    for s in spans:
        if s.length < 0:
            raise ValueError(f"span length {s.length} must be >= 0")
        if s.length == 0:
            continue
        if out and out[-1].lkey == s.lkey and out[-1].addr + out[-1].length == s.addr:
            out[-1] = LocalSpan(out[-1].addr, out[-1].length + s.length, s.lkey)
        else:
            out.append(s)
    return out


def _can_join(prev: BlockWrite, nxt: BlockWrite) -> bool:
    if nxt.rkey != prev.rkey or nxt.dest_addr != prev.dest_addr + prev.length:
        return False
    if (prev.mask is None) != (nxt.mask is None):
        return False
    if prev.mask is None:
        return True
    a, b = prev.mask, nxt.mask
    return (a.rkey == b.rkey and b.dest_addr == a.dest_addr + a.source.length
            and a.source.lkey == b.source.lkey
            and b.source.addr == a.source.addr + a.source.length)


def _split_into_wrs(spans: list[LocalSpan], dest: int, rkey: int, limits: DeviceLimits,
                    blocks: tuple[int, ...]) -> list[tuple]:
    wrs, cur, cur_len, cur_dest = [], [], 0, dest
    for span in spans:
        addr, left = span.addr, span.length
        while left:
            take = min(left, limits.max_msg - cur_len)
            cur.append(LocalSpan(addr, take, span.lkey))
            cur_len += take
            addr += take
            left -= take
            if cur_len == limits.max_msg or len(cur) == limits.max_sge:
                wrs.append((tuple(cur), cur_dest, rkey, False, blocks))
                cur_dest += cur_len
                cur, cur_len = [], 0
    if cur:
        wrs.append((tuple(cur), cur_dest, rkey, False, blocks))
    return wrs


def plan_writes(blocks: Sequence[BlockWrite], limits: DeviceLimits, *, first_wr_id: int = 1,
                coalesce: bool = True) -> list[list[WorkRequest]]:
    """Doorbell batches of WRs for ``blocks`` (see the module docstring for the rules)."""
    groups: list[list[int]] = []
    for i, b in enumerate(blocks):
        if coalesce and groups and _can_join(blocks[groups[-1][-1]], b):
            groups[-1].append(i)
        else:
            groups.append([i])
    raw: list[tuple] = []
    for g in groups:
        first = blocks[g[0]]
        ids = tuple(g)
        spans = _merge_spans(s for i in g for s in blocks[i].sources)
        raw += _split_into_wrs(spans, first.dest_addr, first.rkey, limits, ids)
        if first.mask is not None:
            mspans = _merge_spans(blocks[i].mask.source for i in g)
            mlen = sum(s.length for s in mspans)
            if mlen:
                mask_wrs = _split_into_wrs(mspans, first.mask.dest_addr, first.mask.rkey,
                                           limits, ids)
                raw += [(s, d, k, True, b) for s, d, k, _, b in mask_wrs]
    batches, wr_id = [], first_wr_id
    for start in range(0, len(raw), limits.max_send_wr):
        chunk = raw[start:start + limits.max_send_wr]
        batch = []
        for j, (sges, dest, rkey, is_mask, ids) in enumerate(chunk):
            length = sum(s.length for s in sges)
            batch.append(WorkRequest(wr_id, sges, dest, rkey, signaled=j == len(chunk) - 1,
                                     inline=is_mask and length <= limits.max_inline,
                                     is_mask=is_mask, blocks=ids))
            wr_id += 1
        batches.append(batch)
    return batches


def execute(batches: Sequence[Sequence[WorkRequest]], local: dict[int, tuple[int, bytearray]],
            remote: dict[int, tuple[int, bytearray]]) -> None:
    """Apply a plan like an in-order NIC would. ``local[lkey]`` / ``remote[rkey]`` are
    ``(base_addr, memory)``; out-of-range accesses raise (a NIC would raise a protection
    error), so tests catch planning bugs."""
    def window(table, key, addr, length):
        base, mem = table[key]
        lo = addr - base
        if lo < 0 or lo + length > len(mem):
            raise IndexError(f"access [{addr}, {addr + length}) outside key {key}")
        return mem, lo

    for batch in batches:
        for wr in batch:
            data = b""
            for s in wr.sges:
                mem, lo = window(local, s.lkey, s.addr, s.length)
                data += bytes(mem[lo:lo + s.length])
            mem, lo = window(remote, wr.rkey, wr.remote_addr, len(data))
            mem[lo:lo + len(data)] = data
