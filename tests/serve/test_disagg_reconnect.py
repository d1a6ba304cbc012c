"""A decode worker reconnects to its configured prefill workers (issue 23, defect 4): the backoff
schedule and logging of `PrefillReconnector` on a fake clock, and live `--role prefill` +
`jkv decode-worker` subprocesses on loopback where first the decode process and then the
prefill process is stopped (SIGSTOP) past the transport timeout."""
import logging
import random
import signal
import time

import httpx
import pytest

from conftest import ServerProcess
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.prefill_worker import PrefillWorker
from jkv.disagg.reconnect import Backoff, PrefillReconnector
from jkv.disagg.selectors import build_selector
from jkv.transfer.plan import TransferConfig
from models import tiny_model
from tests.stop_process import stop_process
from transport import TransportError

SECRET = {"JKV_SECRET": "serve-reconnect-test-secret"}
TIMEOUT_S = "1"  # --transfer-timeout: a peer silent this long is declared dead


# ----------------------------------------------------------------------------- backoff, fake clock
def test_backoff_is_exponential_capped_and_jittered_downwards():
    b = Backoff(initial_s=0.5, max_s=4.0, factor=2.0, jitter=0.5)
    assert [b.base(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    rng = random.Random(0)
    delays = [b.delay(3, rng) for _ in range(200)]
    assert 1.0 <= min(delays) < 1.1 and 1.9 < max(delays) <= 2.0  # uniform in [(1 - jitter) * 2, 2]
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=1.0)
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=5.0, max_s=1.0)


class FakeWorker:
    def __init__(self):
        self.up = {"prefill-a": True}
        self.reachable = True
        self.attempts: list[float] = []
        self.now = 0.0

    def connect(self, address, timeout):
        self.attempts.append(self.now)
        if not self.reachable:
            raise ConnectionRefusedError(f"{address} refused")
        self.up["prefill-a"] = True
        return "prefill-a"


def test_reconnector_retries_with_backoff_and_logs_loss_attempts_and_recovery(caplog, monkeypatch):
    w = FakeWorker()
    monkeypatch.setattr("jkv.disagg.reconnect.time.monotonic", lambda: w.now)
    r = PrefillReconnector(["A|B"], {"A|B": "prefill-a"}, connect=w.connect, alive=lambda n: w.up[n],
                           backoff=Backoff(initial_s=1.0, max_s=4.0, jitter=0.0))
    with caplog.at_level(logging.INFO, logger="jkv.disagg.reconnect"):
        r.check()
        assert w.attempts == [] and r.reconnecting() == []  # alive: nothing to do
        w.up["prefill-a"], w.reachable = False, False
        for t in range(0, 20):
            w.now = float(t)
            r.check()
        assert w.attempts == [0.0, 1.0, 3.0, 7.0, 11.0, 15.0, 19.0]  # +1, +2, +4, then capped at 4
        assert r.reconnecting() == ["A|B"]
        w.reachable, w.now = True, 23.0
        r.check()
        assert w.attempts[-1] == 23.0 and w.up["prefill-a"] and r.reconnecting() == []
    # the loss once; attempts at INFO until the delay reaches its cap, then WARNING; the recovery
    assert [rec.levelname for rec in caplog.records] == ["WARNING"] + ["INFO"] * 2 + ["WARNING"] * 5 + ["INFO"]
    assert caplog.records[0].getMessage().startswith("lost the connection to prefill worker prefill-a at A|B")
    assert "attempt 3 to prefill worker prefill-a at A|B failed: A|B refused; next attempt in 4.0s" in \
        caplog.records[3].getMessage()
    assert "reconnected to prefill worker prefill-a at A|B after 7 failed attempts" in caplog.records[-1].getMessage()


# ----------------------------------------------------------------------------- the bulk lane, in process
def test_connect_returns_only_once_the_prefill_worker_has_adopted_the_bulk_lane(monkeypatch):
    """The CI hang of the live test below: the handshake returns to the decode side before the
    prefill worker's bulk endpoint has adopted the connection (its handshake thread lags, e.g. just
    after a SIGCONT); a hand-in arriving meanwhile found no bulk peer and was dropped ("decode peer
    went away mid-prefill"), and the decode side waited for its hand-off forever."""
    model = tiny_model("llama", seed=3)
    sel = build_selector(model, "streamingllm")
    prefill = PrefillWorker(model, sel, "prefill-lane", secret=SECRET["JKV_SECRET"])
    adopt = prefill.bulk._adopt

    def lagging_adopt(*a, **kw):
        time.sleep(0.5)
        return adopt(*a, **kw)

    monkeypatch.setattr(prefill.bulk, "_adopt", lagging_adopt)
    address = prefill.listen()
    decode = DecodeWorker(model, sel, TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3,
                                                     max_blocks=16), secret=SECRET["JKV_SECRET"])
    try:
        assert decode.connect_one(address, connect_timeout=5) == "prefill-lane"
        first = prefill.bulk.peer(decode.endpoint.name)  # KeyError before the fix: not adopted yet
        assert first.alive
        for peer in list(decode.endpoint.peers.values()):  # the link is declared dead, then reconnected
            for conn in peer.connections:
                conn.fail(TransportError("test: link declared dead"))
        assert decode.connect_one(address, connect_timeout=5) == "prefill-lane"
        second = prefill.bulk.peer(decode.endpoint.name)
        assert second is not first and second.alive
    finally:
        decode.close()
        prefill.close()


# ----------------------------------------------------------------------------- live processes
def health(url):
    return httpx.get(url + "/health", timeout=10).json()


def wait_for(cond, timeout, what):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)
    return time.time() - t0


def complete(url):
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "lazy dog", "max_tokens": 3,
                                                     "temperature": 0}, timeout=60)


def prefill_alive(url) -> bool:
    return all(w["alive"] for w in health(url)["prefill_workers"])


@pytest.fixture
def pair(tiny_dir, cache_env):
    env = dict(cache_env, **SECRET)
    prefill = ServerProcess(["--role", "prefill", "--model", str(tiny_dir), "--port", "0", "--selector", "streamingllm",
                             "--worker-name", "prefill-r", "--transfer-timeout", TIMEOUT_S], env=env)
    decode = None
    try:
        address = health(prefill.url)["transport_address"]
        decode = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0",
                                "--selector", "streamingllm", "--disaggregation", "smartgen", "--strategy", "sequential",
                                "--kr-fraction", "0.3", "--max-model-len", "512", "--transfer-timeout", TIMEOUT_S,
                                "--prefill-worker", address], env=env, command="decode-worker")
        yield prefill, decode
    finally:
        for s in (decode, prefill):
            if s is not None:
                s.proc.send_signal(signal.SIGCONT)
        if decode is not None:
            assert decode.stop() == 0, "".join(decode.log[-30:])
        prefill.stop()


def test_decode_worker_reconnects_after_its_link_was_declared_dead(pair):
    prefill, decode = pair
    assert complete(decode.url).status_code == 200

    # The reported case: the decode process stopped past the timeout, then resumed. No request names
    # the worker (no X-JKV-Prefill-Worker header): the decode side must reconnect by itself.
    stop_process(decode.proc.pid)  # stopped for the full 3 s, not from whenever SIGSTOP lands
    time.sleep(3)
    decode.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: complete(decode.url).status_code == 200, 20, "the decode worker serving again")
    assert "prefill-r" in "".join(decode.log) and "lost the connection to prefill worker" in "".join(decode.log)

    # The prefill process stops: while it is unreachable a request fails fast with 503 naming the
    # cause; once it resumes the reconnect lands and requests succeed again.
    stop_process(prefill.proc.pid)
    try:
        wait_for(lambda: not prefill_alive(decode.url), 10, "the decode side declaring the prefill worker dead")
        t0 = time.time()
        r = complete(decode.url)
        assert time.time() - t0 < 2.0 and r.status_code == 503, (r.status_code, r.text)
        assert "no live prefill worker" in r.json()["error"]["message"]
        assert "reconnecting to" in r.json()["error"]["message"]
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
    waited = wait_for(lambda: complete(decode.url).status_code == 200, 20, "serving after the prefill resumed")
    assert waited < 20
    assert health(decode.url)["kv_host_requests"] == 0 and health(decode.url)["kv_pages_in_use"] == 0
    assert "reconnected to prefill worker prefill-r" in "".join(decode.log)
