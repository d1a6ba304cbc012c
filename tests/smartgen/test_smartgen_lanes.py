"""The bulk lane yields the paced link to on-demand replies (bounded), sharing one bucket."""
import time

from jkv.disagg.prefill_worker import _YieldToOnDemand
from transport import TokenBucket


def test_bulk_waits_for_a_draining_on_demand_reply():
    shared = TokenBucket("80mbit", burst=1 << 20)  # 10 MB/s
    gate = _YieldToOnDemand(shared)
    # Upper bounds read consume()'s own account of the seconds it slept, lower bounds the wall
    # clock: a wall-clock upper bound (50 ms for "no wait") fails whenever the other test worker
    # keeps this thread off the CPU for a moment.
    assert gate.consume(1) == 0.0  # idle link: no wait
    t = time.monotonic()  # before reserve(): the drain is timed from there
    gate.reserve(2_000_000)  # a 2 MB reply drains for ~0.2 s
    slept = gate.consume(1)
    assert 0.15 < time.monotonic() - t and slept < 0.25
    assert gate.chunk == max(4096, shared.chunk // 4) < shared.chunk  # bulk packets are small


def test_yield_is_bounded_so_the_bulk_lane_never_starves():
    gate = _YieldToOnDemand(TokenBucket("8mbit", burst=1 << 20))
    gate.MAX_YIELD_S = 0.2
    gate.reserve(100_000_000)  # 100 s of on-demand traffic
    t = time.monotonic()
    slept = gate.consume(1)
    assert 0.15 < time.monotonic() - t and 0.15 < slept < 0.3  # gave up after MAX_YIELD_S, not 100 s


def _high_priority_wait(bulk_take) -> float:
    """A bulk chunk of 0.5 s of link time is booked at t=0 on a thread; at t=0.05 an on-demand
    chunk of 0.1 s arrives. Returns how long the on-demand chunk waited."""
    import threading
    bucket = TokenBucket("800kbit", burst=50_000)  # 100 KB/s, starts empty
    bulk = threading.Thread(target=bulk_take, args=(bucket,))
    bulk.start()
    time.sleep(0.05)
    t = time.monotonic()
    bucket.consume(10_000)
    waited = time.monotonic() - t
    bulk.join()
    return waited


def test_credit_only_bulk_never_makes_on_demand_wait_behind_its_chunk():
    debt = _high_priority_wait(lambda b: b.consume(50_000))  # books debt: on-demand queues behind it
    credit = _high_priority_wait(lambda b: b.consume_credit(50_000))  # waits for banked credit instead
    assert debt > 0.4  # ~0.55 s: the rest of the bulk chunk, then its own 0.1 s
    assert credit < 0.3  # ~0.05 s: only its own bytes beyond the credit banked so far
