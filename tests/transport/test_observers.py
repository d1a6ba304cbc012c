"""Endpoint.observe_transfers: every operation an endpoint starts reaches its observers once done,
with the timings serving's histograms split into queueing and wire time."""
from __future__ import annotations

import threading

import numpy as np

from transport import TransportError


def test_observers_see_every_operation_with_ordered_timings(make_endpoint):
    server = make_endpoint("server")
    server.register("pool", np.zeros(1 << 20, np.uint8))
    server.serve("fetch", lambda peer, payload: bytes(payload))
    server.on_notify("spec", lambda note: None)
    seen, server_seen, lock = [], [], threading.Lock()

    def observe(t):
        with lock:
            seen.append(t)

    server.observe_transfers(lambda t: server_seen.append(t))
    client = make_endpoint("client")
    client.observe_transfers(observe)
    client.observe_transfers(lambda t: 1 / 0)  # a failing observer is logged and never breaks the transport
    peer = client.connect(server.listen())
    peer.write("pool", 0, np.ones(300_000, np.uint8), then=("pool", 400_000, 1)).wait(10)
    assert peer.call("fetch", b"rows", timeout=10) == b"rows"
    peer.notify("spec", b"x").wait(10)
    with lock:
        mine = [t for t in seen if t.kind in ("write", "notify") or t.method == "fetch"]
    assert sorted(t.kind for t in mine) == ["call", "notify", "write"]
    for t in mine:
        assert t.error is None and t.created_at <= t.started_at <= t.finished_at
    assert [t.method for t in mine if t.kind == "call"] == ["fetch"]
    assert any(t.kind == "reply" for t in server_seen)  # the server's reply operations too
    peer.close()


def test_observers_see_failed_operations(make_endpoint):
    server = make_endpoint("server")
    server.serve("boom", lambda peer, payload: 1 / 0)
    seen = []
    client = make_endpoint("client")
    client.observe_transfers(seen.append)
    peer = client.connect(server.listen())
    try:
        peer.call("boom", b"", timeout=10)
    except TransportError:
        pass
    calls = [t for t in seen if t.method == "boom"]
    assert len(calls) == 1 and calls[0].error is not None
