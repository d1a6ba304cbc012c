"""Ordering: a mask value is never visible before its block's bytes are complete.

A poller thread in the receiving process reads the mask concurrently with the writes; every
time it sees ``mask[i] == 1`` it checks block ``i`` by content. The negative control sends the
mask *before* the block (two separate writes) and shows the checker does catch a violation.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from transport import Mask, aligned_empty

NUM_BLOCKS, BLOCK = 48, 256 * 1024


class Poller:
    def __init__(self, pool: np.ndarray, mask: np.ndarray, patterns: np.ndarray):
        self.pool, self.mask, self.patterns = pool, mask, patterns
        self.violations: list[int] = []
        self.verified: set[int] = set()
        self.partial_seen = 0  # polls that caught a block mid-write (mask still 0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="test-poller")

    def run(self):
        while not self.stop.is_set() and len(self.verified) < NUM_BLOCKS:
            for i in np.flatnonzero(self.mask == 0):
                head, tail = self.pool[i, 0], self.pool[i, -1]
                if (head != 0 or tail != 0) and not np.array_equal(self.pool[i], self.patterns[i]):
                    self.partial_seen += 1
            for i in np.flatnonzero(self.mask == 1):
                if i in self.verified:
                    continue
                if np.array_equal(self.pool[i], self.patterns[i]):
                    self.verified.add(int(i))
                else:
                    self.violations.append(int(i))
                    self.verified.add(int(i))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(20)
        self.stop.set()
        self.thread.join()


def _setup(make_endpoint, backend, streams=1):
    rng = np.random.default_rng(7)
    patterns = rng.integers(1, 256, (NUM_BLOCKS, BLOCK), dtype=np.uint8)
    pool = aligned_empty((NUM_BLOCKS, BLOCK), np.uint8)
    pool[:] = 0
    mask = np.zeros(NUM_BLOCKS, np.int8)
    decode = make_endpoint("decode", backend)
    decode.register("kv_pool", pool)
    decode.register("kv_mask", mask)
    prefill = make_endpoint("prefill", backend)
    peer = prefill.connect(decode.listen(), streams=streams)
    return peer, pool, mask, patterns


@pytest.mark.parametrize("backend, streams", [("tcp", 1), ("shm", 1), ("tcp", 3)])
def test_mask_never_visible_before_block(backend, streams, make_endpoint):
    peer, pool, mask, patterns = _setup(make_endpoint, backend, streams)
    with Poller(pool, mask, patterns) as poller:
        transfers = [peer.write("kv_pool", i * BLOCK, patterns[i], then=Mask("kv_mask", i, 1))
                     for i in range(NUM_BLOCKS // 2)]
        # the second half as one batched transfer (a layer's blocks in one write_many)
        transfers.append(peer.write_many(
            [("kv_pool", i * BLOCK, patterns[i], ("kv_mask", i, 1))
             for i in range(NUM_BLOCKS // 2, NUM_BLOCKS)]))
        for t in transfers:
            t.wait(30)
    assert poller.violations == []
    assert len(poller.verified) == NUM_BLOCKS
    assert np.array_equal(pool, patterns) and (mask == 1).all()


def test_checker_catches_mask_written_before_block(make_endpoint):
    """Negative control: the same checker flags a mask that overtakes its block."""
    peer, pool, mask, patterns = _setup(make_endpoint, "tcp")
    with Poller(pool, mask, patterns) as poller:
        for i in range(4):
            peer.write("kv_mask", i, b"\x01").wait(10)
            time.sleep(0.02)  # the window a misordered transport would open
            peer.write("kv_pool", i * BLOCK, patterns[i]).wait(10)
        poller.stop.set()
    assert poller.violations, "a mask set before its block must be detected"
