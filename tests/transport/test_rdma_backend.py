"""rdma backend wiring, run against an in-process loopback device (and a real NIC if present)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from transport_consts import SECRET  # noqa: E402  (tests/transport is on sys.path)
from fake_verbs import Fabric, LoopbackVerbs  # noqa: E402

from transport import BackendUnavailable, Endpoint, Mask, PeerDeadError, TransferState, TransportError
from transport.rdma import open_device


@pytest.fixture
def rdma_pair(make_endpoint):
    fabric = Fabric()
    decode = make_endpoint("decode", "rdma", rdma_device=LoopbackVerbs(fabric), timeout=1.0)
    prefill = make_endpoint("prefill", "rdma", rdma_device=LoopbackVerbs(fabric), timeout=1.0)
    pool = np.zeros((16, 4096), np.uint8)
    mask = np.zeros(16, np.int8)
    decode.register("kv_pool", pool)
    decode.register("kv_mask", mask)
    peer = prefill.connect(decode.listen())
    return fabric, decode, prefill, peer, pool, mask


def test_blocks_and_masks_land_through_planned_work_requests(rdma_pair):
    fabric, decode, prefill, peer, pool, mask = rdma_pair
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (16, 4096), dtype=np.uint8)
    staging = prefill.register("staging", blocks)  # registered source: no temporary MR
    t = peer.write_many([("kv_pool", i * 4096, blocks[i], Mask("kv_mask", i, 1)) for i in range(8)])
    t.wait(5)
    assert t.state is TransferState.COMPLETE
    assert np.array_equal(pool[:8], blocks[:8]) and list(mask) == [1] * 8 + [0] * 8
    wrs = fabric.posted
    # contiguous blocks and masks coalesce; every mask WR follows its blocks' data WRs
    for i, wr in enumerate(wrs):
        if wr.is_mask:
            assert all(j < i for j, other in enumerate(wrs)
                       if not other.is_mask and set(other.blocks) & set(wr.blocks))
    assert all(s.lkey in prefill.rdma.mrs for wr in wrs if not wr.inline for s in wr.sges)
    assert staging.nbytes == blocks.nbytes
    # an unregistered source is registered for the transfer and released afterwards
    before = len(prefill.rdma.mrs)
    scratch = rng.integers(0, 256, 4096, dtype=np.uint8)
    peer.write("kv_pool", 15 * 4096, scratch, then=("kv_mask", 15, b"\x02")).wait(5)
    assert np.array_equal(pool[15], scratch) and mask[15] == 2
    deadline = time.monotonic() + 2
    while len(prefill.rdma.mrs) != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(prefill.rdma.mrs) == before
    # the control plane is the tcp connection: RPC and notifications still work
    decode.serve("sum", lambda p, payload: int(pool.sum()).to_bytes(8, "little"))
    assert int.from_bytes(peer.call("sum"), "little") == int(pool.sum())
    assert prefill.metrics.snapshot()["tx"]["write"]["ops"] == 2


def test_bounds_and_remote_protection_errors(rdma_pair):
    fabric, decode, prefill, peer, pool, mask = rdma_pair
    with pytest.raises(ValueError, match="does not fit"):
        peer.write("kv_pool", pool.nbytes - 1, b"ab")
    peer.write("kv_pool", 0, b"ok").wait(5)
    decode.unregister("kv_pool")  # the prefill side still holds the old rkey
    t = peer.write("kv_pool", 0, b"late")
    with pytest.raises(TransportError, match="remote access error"):
        t.wait(5)
    assert bytes(pool[0, :4]) == b"ok\0\0"


def test_dead_peer_fails_in_flight_rdma_writes(rdma_pair):
    fabric, decode, prefill, peer, pool, mask = rdma_pair
    peer.write("kv_pool", 0, b"x").wait(5)
    prefill.rdma.hold = True  # completions stay in flight
    t = peer.write("kv_pool", 0, b"y" * 100)
    time.sleep(0.05)
    assert t.state is TransferState.TRANSFERRING
    closed_at = time.monotonic()
    decode.close()
    with pytest.raises(PeerDeadError):
        t.wait(3)
    assert t.finished_at - closed_at < 1.0


def test_rdma_op_timeout(rdma_pair):
    fabric, decode, prefill, peer, pool, mask = rdma_pair
    prefill.rdma.hold = True
    t = peer.write("kv_pool", 0, b"z", timeout=0.2)
    with pytest.raises(TransportError, match="did not complete within its timeout"):
        t.wait(2)


@pytest.mark.rdma
def test_real_device_loopback_write(make_endpoint):
    try:
        device_a, device_b = open_device(), open_device()
    except BackendUnavailable as e:
        pytest.skip(f"needs an RDMA device and pyverbs: {e}")
    decode = make_endpoint("decode", "rdma", rdma_device=device_a)
    prefill = make_endpoint("prefill", "rdma", rdma_device=device_b)
    pool = np.zeros(1 << 20, np.uint8)
    mask = np.zeros(16, np.int8)
    decode.register("pool", pool)
    decode.register("mask", mask)
    data = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
    prefill.register("src", data)
    peer = prefill.connect(decode.listen())
    peer.write("pool", 0, data, then=("mask", 3, 1)).wait(10)
    assert np.array_equal(pool, data) and mask[3] == 1


def test_rdma_device_argument_needs_rdma_backend():
    with pytest.raises(ValueError, match="only used with backend='rdma'"):
        Endpoint("x", "tcp", secret=SECRET, rdma_device=object())
