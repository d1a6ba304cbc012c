"""Shared-memory rings for the ``shm`` backend (same host, same API as ``tcp``).

Each direction of an shm connection owns one ring: a file in ``/dev/shm`` that the *sender*
creates and ``mmap``\\ s, and that the receiver maps and immediately unlinks during the
handshake, so a crash of either process leaves no segment behind. Control traffic (headers,
RPC, notifications, ACK) goes over an ``AF_UNIX`` socket in the abstract namespace (no
file to clean up); WRITE payloads are copied into the ring by the sender and out of it into
the registered region by the receiver's reader thread, which then applies the trailing mask
frame — the same single in-order stream that gives ``tcp`` its ordering guarantee.

Ring accounting uses monotonic byte positions: the sender's ``head`` (bytes reserved) and
the receiver's consumed position, reported back in CREDIT frames. A frame never wraps:
if it does not fit before the end, the tail is skipped. Frames are at most ``size // 4``
bytes, and the receiver reports credit at least every ``size // 8`` bytes and at every
acknowledged frame, so a waiting sender always gets enough space (no deadlock).

Concurrency: a ring's sender state is touched only by its connection's sender thread and
the reader thread (CREDIT), under the connection's condition variable.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "jkvt-"


class ShmRing:
    def __init__(self, path: str, fd: int, size: int, owner: bool):
        self.path, self.size, self.owner = path, size, owner
        # MAP_POPULATE pre-faults the pages, so the first pass over the ring runs at memcpy speed
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        os.close(fd)
        self.view = memoryview(self._mm)
        self.linked = True
        self.head = 0  # sender: monotonic bytes reserved
        self.credit = 0  # sender: monotonic bytes the receiver consumed

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def max_frame(self) -> int:
        return self.size // 4

    @classmethod
    def create(cls, size: int) -> "ShmRing":
        if size < 1 << 16:
            raise ValueError(f"ring size {size} must be >= 64 KiB")
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, fd, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> "ShmRing":
        """Map the peer's ring and unlink its name (the mapping stays valid)."""
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"shm ring name {name!r} is not a jkv transport ring")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        ring = cls(path, fd, size, owner=False)
        ring.unlink()
        return ring

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def reserve_fits(self, n: int) -> int | None:
        """Sender: monotonic position for ``n`` contiguous bytes, or None if the ring is full."""
        pos = self.head % self.size
        skip = self.size - pos if pos + n > self.size else 0
        if self.size - (self.head - self.credit) < skip + n:
            return None
        self.head += skip
        start = self.head
        self.head += n
        return start

    def close(self) -> None:
        self.unlink()
        self.view.release()
        try:
            self._mm.close()
        except BufferError:  # a slice is still referenced somewhere; GC unmaps it later
            log.debug("ring %s still exported at close", self.name)
