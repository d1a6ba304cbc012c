"""The busy-time goodput the bandwidth estimator reads (KVServe §3.1) on a paced link after
compressed-size transfers: small messages separated by short idle gaps (the codec's time between
layers). The token bucket lets each message's first chunk pass on credit banked in the gap; the
link still needed that time to carry it, so the transport counts it as busy and the estimate reads
the link rate instead of up to twice it."""
from __future__ import annotations

import time

import numpy as np
import pytest

from jkv.compression.bandwidth import BandwidthEstimator
from transport import parse_bandwidth
from transport.metrics import Metrics

RATE = "40mbit"  # 5 MB/s: the default burst (5 ms of link time) is 25 KB


def _link_sample(metrics) -> tuple[int, float]:
    tx = metrics.snapshot()["tx"]
    return sum(tx[k]["bytes"] for k in ("write", "notify")), sum(tx[k]["busy_s"] for k in ("write", "notify"))


@pytest.mark.parametrize("kind", ["notify", "write"])
def test_estimate_reads_the_paced_rate_after_compressed_transfers(make_endpoint, kind):
    sink = make_endpoint("decode")
    sink.register("pool", np.zeros(1 << 20, np.uint8))
    sink.on_notify("ckv", lambda note: None)
    src = make_endpoint("prefill", bandwidth=RATE)
    peer = src.connect(sink.listen())
    peer.regions()
    frame = np.random.default_rng(0).integers(0, 256, 48_000, dtype=np.uint8)  # one layer's compressed chunks

    def measure() -> float:
        estimator = BandwidthEstimator()
        for _ in range(3):  # three "requests" of 8 layers each
            before = _link_sample(src.metrics)
            for _layer in range(8):
                t = peer.notify("ckv", frame) if kind == "notify" else peer.write("pool", 0, frame)
                t.wait(10)
                time.sleep(0.012)  # the next layer's encode: the bucket banks credit meanwhile
            after = _link_sample(src.metrics)
            estimator.observe(after[0] - before[0], after[1] - before[1])
        return estimator.estimate()

    link_Bps = parse_bandwidth(RATE) / 8
    estimate = measure()
    # Once more on an undershoot: a loaded CI box that deschedules the sender stretches its busy
    # time (read 33.4 of 40 Mbit/s in one CI run at load ~2.5). The bug this guards against is
    # the over-read (up to 2x the link), which is never retried.
    estimate = measure() if estimate < 0.85 * link_Bps else estimate
    assert estimate == pytest.approx(link_Bps, rel=0.15), \
        f"estimate {8 * estimate / 1e6:.1f} Mbit/s on a {RATE} link"


def test_add_busy_extends_busy_time():
    m = Metrics()
    m.begin("tx", "notify")
    m.end("tx", "notify", 100, True)
    busy = m.snapshot()["tx"]["notify"]["busy_s"]
    m.add_busy("tx", "notify", 0.5)
    assert m.snapshot()["tx"]["notify"]["busy_s"] == pytest.approx(busy + 0.5)
    with pytest.raises(ValueError, match="seconds"):
        m.add_busy("tx", "notify", -1.0)
