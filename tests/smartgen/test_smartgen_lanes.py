"""The bulk lane yields the paced link to on-demand replies (bounded), sharing one bucket."""
import time

from jkv.disagg.prefill_worker import _YieldToOnDemand
from transport import TokenBucket


def test_bulk_waits_for_a_draining_on_demand_reply():
    shared = TokenBucket("80mbit", burst=1 << 20)  # 10 MB/s
    gate = _YieldToOnDemand(shared)
    t = time.monotonic()
    gate.consume(1)
    assert time.monotonic() - t < 0.05  # idle link: no wait
    gate.reserve(2_000_000)  # a 2 MB reply drains for ~0.2 s
    t = time.monotonic()
    gate.consume(1)
    assert 0.15 < time.monotonic() - t < 0.6
    assert gate.chunk == shared.chunk


def test_yield_is_bounded_so_the_bulk_lane_never_starves():
    gate = _YieldToOnDemand(TokenBucket("8mbit", burst=1 << 20))
    gate.MAX_YIELD_S = 0.2
    gate.reserve(100_000_000)  # 100 s of on-demand traffic
    t = time.monotonic()
    gate.consume(1)
    assert 0.15 < time.monotonic() - t < 0.8
