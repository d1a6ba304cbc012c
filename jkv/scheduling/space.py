"""Space accounting for one storage level (L2 host staging, L1 device KV): a slot allocator.

A slot holds one KV chunk (or one chunk-sized piece of a request's compute workspace). Slots
are indices into buffers the caller preallocated once, so "allocating space" is bookkeeping
only, never a malloc on the critical path (as vLLM's block pool). Not thread-safe by itself:
the pipeline core guards it with the pipeline's lock.
"""
from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable


class SlotPool:
    """`capacity` numbered slots; all-or-nothing allocation per owner; leak-checkable."""

    def __init__(self, name: str, capacity: int):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"{name} capacity={capacity!r} must be an int >= 0 (slots)")
        self.name = name
        self.capacity = capacity
        self._free: collections.deque[int] = collections.deque(range(capacity))
        self._owner: dict[int, Hashable] = {}
        self.peak_used = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, owner: Hashable, n: int) -> list[int] | None:
        """n slots for `owner`, or None (nothing taken) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n=} slots from {self.name}")
        if n > len(self._free):
            return None
        slots = [self._free.popleft() for _ in range(n)]
        for slot in slots:
            self._owner[slot] = owner
        self.peak_used = max(self.peak_used, self.used)
        return slots

    def release(self, owner: Hashable, slots: Iterable[int]) -> None:
        for slot in slots:
            holder = self._owner.pop(slot, None)
            assert holder == owner, f"{self.name} slot {slot} held by {holder!r}, not {owner!r}"
            self._free.append(slot)

    def owned_by(self, owner: Hashable) -> list[int]:
        return sorted(s for s, o in self._owner.items() if o == owner)

    def __repr__(self) -> str:
        return f"SlotPool({self.name!r}, used={self.used}/{self.capacity})"
