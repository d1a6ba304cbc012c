"""Bandwidth parsing, token bucket, and end-to-end pacing accuracy (±5 % over >= 1 s)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from transport import TokenBucket, parse_bandwidth
from transport.metrics import Metrics


@pytest.mark.parametrize("text, bits", [
    ("10gbit", 10e9), ("100mbit", 100e6), ("2.5Gbps", 2.5e9), ("500kbit/s", 500e3),
    ("1.25GB/s", 10e9), ("800bit", 800.0), (1e9, 1e9), ("  1e3mbit ", 1e9),
])
def test_parse_bandwidth(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("bad", ["", "fast", "10g", "-1gbit", "0mbit", "10 xbit", True, 0, float("inf")])
def test_parse_bandwidth_rejects_with_a_hint(bad):
    with pytest.raises(ValueError, match="bandwidth="):
        parse_bandwidth(bad)


def _retry_undershoot(measure, target):
    """Measure; once more if the result undershoots (the shared CI machine starved the
    sender past the bucket's 10 ms credit cap). Overshoot is never retried: it is a pacer bug."""
    rate = measure()
    return measure() if rate < 0.95 * target else rate


def test_token_bucket_long_run_rate_any_chunk_size():
    def measure():
        bucket = TokenBucket("400mbit")  # 50 MB/s
        start, sent, i = time.monotonic(), 0, 0
        sizes = [1000, 70000, 3, 250000]
        while time.monotonic() - start < 0.3:
            n = sizes[i % 4]
            i += 1
            bucket.consume(n)
            sent += n
        return 8 * sent / (time.monotonic() - start)

    assert _retry_undershoot(measure, 400e6) == pytest.approx(400e6, rel=0.05)


def test_busy_time_bandwidth_ignores_idle_gaps():
    m = Metrics()
    t0 = time.monotonic()
    m.begin("tx", "write")
    time.sleep(0.05)
    m.end("tx", "write", 1000, True)
    idle_start = time.monotonic()
    time.sleep(0.1)  # idle: must not count
    idle = time.monotonic() - idle_start
    m.begin("tx", "write")
    m.begin("tx", "write")  # overlapping ops count once
    time.sleep(0.05)
    m.end("tx", "write", 1000, True)
    m.end("tx", "write", 0, False)
    wall = time.monotonic() - t0
    snap = m.snapshot()["tx"]["write"]
    assert snap["ops"] == 2 and snap["failures"] == 1 and snap["bytes"] == 2000
    assert 0.1 <= snap["busy_s"] <= wall - idle + 1e-3
    assert snap["busy_bandwidth_bps"] == pytest.approx(8 * 2000 / snap["busy_s"])


def _paced_rate(make_endpoint, backend, peer_bw=None, endpoint_bw=None, seconds=1.0):
    rate = parse_bandwidth(peer_bw or endpoint_bw)
    server = make_endpoint("sink", backend)
    block = np.full(8 << 20, 7, np.uint8)
    server.register("pool", np.zeros(block.nbytes, np.uint8))
    client = make_endpoint("src", backend, bandwidth=endpoint_bw)
    peer = client.connect(server.listen(), bandwidth=peer_bw)
    peer.regions()
    nbytes = int(rate / 8 * seconds)
    items, left = [], nbytes
    while left:
        n = min(left, block.nbytes)
        items.append(("pool", 0, block[:n]))
        left -= n
    t = peer.write_many(items)
    t.wait(seconds * 3 + 5)
    return 8 * nbytes / t.elapsed, rate


@pytest.mark.parametrize("backend, bw", [("tcp", "100mbit"), ("tcp", "2gbit"), ("shm", "1gbit")])
def test_pacing_accuracy_one_second(make_endpoint, backend, bw):
    target = parse_bandwidth(bw)
    achieved = _retry_undershoot(lambda: _paced_rate(make_endpoint, backend, peer_bw=bw)[0], target)
    assert achieved == pytest.approx(target, rel=0.05), f"{achieved / 1e6:.1f} Mbit/s vs {bw}"


def test_endpoint_bandwidth_is_shared_by_its_peers(make_endpoint):
    server_a, server_b = make_endpoint("a"), make_endpoint("b")
    for s in (server_a, server_b):
        s.register("pool", np.zeros(4 << 20, np.uint8))
    client = make_endpoint("src", bandwidth="400mbit")
    pa, pb = client.connect(server_a.listen()), client.connect(server_b.listen())
    data = np.ones(4 << 20, np.uint8)
    pa.regions(), pb.regions()

    def measure():
        start = time.monotonic()
        ts = [p.write_many([("pool", 0, data)] * 3) for p in (pa, pb)]  # 2 x 12 MiB
        for t in ts:
            t.wait(10)
        return 8 * 2 * 3 * data.nbytes / (time.monotonic() - start)

    assert _retry_undershoot(measure, 400e6) == pytest.approx(400e6, rel=0.05)


def test_default_burst_is_a_few_ms_of_link_time_or_one_chunk():
    b = TokenBucket("8mbit")  # 1 MB/s: 5 ms = 5000 bytes
    assert b.burst == 5000 and b.chunk == 5000
    assert TokenBucket("8mbit", burst_s=0.02).burst == 20000
    slow = TokenBucket("128kbit")  # 16 KB/s: 5 ms is 80 bytes, less than one chunk
    assert slow.burst == slow.chunk == TokenBucket.MIN_CHUNK
    assert TokenBucket("8mbit", burst=1 << 20).burst == 1 << 20  # explicit burst kept
    b.set_rate("80mbit")  # re-pacing recomputes both
    assert b.burst == 50000 and b.chunk == 50000


def test_repacing_drops_credit_banked_at_the_old_rate():
    """A benchmark measures on a fast link, then paces it: the megabytes banked at 100 Gbit/s must
    not leave unpaced afterwards."""
    b = TokenBucket("100gbit")
    time.sleep(0.01)
    b.consume(1)  # banks up to 5 ms of 100 Gbit/s (62.5 MB)
    b.set_rate("8mbit")
    assert b.consume(100_000) == pytest.approx(0.1, abs=0.02)  # 100 KB at 1 MB/s, not free
    with pytest.raises(ValueError, match="burst_s="):
        TokenBucket("8mbit", burst_s=0)


def test_idle_credit_is_capped_at_the_burst():
    """After 0.2 s of idle a 50 KB message at 1 MB/s still takes ~45 ms: only 5 KB was banked
    (a real paced link does not store its idle time)."""
    b = TokenBucket("8mbit")
    time.sleep(0.2)
    assert b.consume(50_000) == pytest.approx(0.045, abs=0.01)


def test_a_throttled_senders_oversleep_is_not_lost(monkeypatch):
    """Every sleep in consume wakes 8 ms late (a loaded machine), more than the 5 ms burst. The
    sender was busy all along in one message of full chunks (a NIC drains its queue meanwhile),
    so the long-run rate holds."""
    import transport.pacing as pacing

    real_sleep = time.sleep
    monkeypatch.setattr(pacing.time, "sleep", lambda s: real_sleep(s + 0.008))
    b = TokenBucket("8mbit")  # 1 MB/s, 5000-byte chunks: 5 ms each
    start = time.monotonic()
    for _ in range(100):  # 0.5 s of link time
        b.consume(b.chunk)
    rate = 100 * b.chunk / (time.monotonic() - start)
    monkeypatch.setattr(pacing.time, "sleep", real_sleep)
    assert rate == pytest.approx(1e6, rel=0.12), rate  # without the rule: ~0.4 MB/s (13 ms per chunk)
