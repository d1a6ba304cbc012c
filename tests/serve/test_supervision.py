"""Supervision of local prefill workers in `jkv serve --role all --disaggregation` (issue 21, item 5):
the restart policy of `PrefillSupervisor` on fake processes (backoff, quick-failure limit, give up
with a clear error, restarts off), the reconnector following a moved worker, and a live server whose
prefill worker is SIGKILLed: it is restarted, re-registered and serves the same greedy tokens."""
import logging
import os
import signal
import time

import httpx
import pytest

from conftest import ServerProcess, metric
from jkv import SamplingParams
from jkv.disagg.cluster import WorkerStartError
from jkv.disagg.reconnect import Backoff, PrefillReconnector
from jkv.disagg.supervisor import PrefillSupervisor

FAST = Backoff(initial_s=0.1, max_s=0.4, factor=2.0, jitter=0.0)


class FakeProc:
    _next_pid = 1000

    def __init__(self):
        FakeProc._next_pid += 1
        self.pid, self.code = FakeProc._next_pid, None

    def poll(self):
        return self.code


class FakeWorkers:
    """LocalPrefillWorkers' interface: `procs`, `addresses`, `respawn(i)`; `start_fails` of the next
    respawns raise, and every started process "dies" after `lives` polls when `lives` is set."""

    def __init__(self, count=1, start_fails=0):
        self.procs = [FakeProc() for _ in range(count)]
        self.addresses = [f"127.0.0.1:{100 + i}|127.0.0.1:{200 + i}" for i in range(count)]
        self.start_fails, self.respawns = start_fails, 0

    def respawn(self, i):
        self.respawns += 1
        if self.start_fails:
            self.start_fails -= 1
            raise WorkerStartError(f"prefill worker {i} did not start (exit code 1, said '')")
        self.procs[i] = FakeProc()
        self.addresses[i] = f"127.0.0.1:{1000 + self.respawns}|127.0.0.1:{2000 + self.respawns}"
        return self.addresses[i]


def wait_for(cond, timeout=10, what=""):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.01)


def test_a_dead_worker_is_restarted_and_re_registered_at_its_new_address(caplog):
    workers, moved = FakeWorkers(2), []
    sup = PrefillSupervisor(workers, on_restart=lambda i, old, new: moved.append((i, old, new)), backoff=FAST,
                            interval=0.01)
    caplog.set_level(logging.INFO, logger="jkv.serve")
    sup.start()
    try:
        dead_pid = workers.procs[1].pid
        workers.procs[1].code = -9
        wait_for(lambda: sup.restarts == 1, what="the restart")
        assert moved == [(1, "127.0.0.1:101|127.0.0.1:201", "127.0.0.1:1001|127.0.0.1:2001")]
        s = sup.status()[1]
        assert (s["state"], s["restarts"], s["last_exit_code"]) == ("running", 1, -9) and s["pid"] != dead_pid
        assert sup.status()[0]["restarts"] == 0
    finally:
        sup.stop()
    text = caplog.text
    assert f"local process prefill-1 (pid {dead_pid}) exited with code -9" in text
    assert "restarted local process prefill-1" in text and "127.0.0.1:1001|127.0.0.1:2001" in text


def test_quick_failures_back_off_and_give_up_with_a_clear_error(caplog):
    workers = FakeWorkers(1, start_fails=100)
    sup = PrefillSupervisor(workers, max_quick_failures=3, backoff=FAST, interval=0.01)
    caplog.set_level(logging.INFO, logger="jkv.serve")
    sup.start()
    try:
        workers.procs[0].code = 1
        wait_for(lambda: sup.status()[0]["state"] == "failed", what="the supervisor giving up")
    finally:
        sup.stop()
    assert workers.respawns == 3 and sup.restarts == 0  # exit + 2 failed starts = 3 tolerated, the 4th gives up
    delays = [float(r.getMessage().split(" in ")[1].split("s ")[0]) for r in caplog.records
              if "restarting prefill-0 in" in r.getMessage()]
    assert delays == [0.1, 0.2, 0.4]  # doubling, capped at max_s
    error = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(error) == 1 and "giving up on local process prefill-0 after 4 quick failures in a row" in \
        error[0].getMessage() and "did not start" in error[0].getMessage()
    assert sup.status()[0]["last_error"].startswith("prefill worker 0 did not start")


def test_a_worker_that_ran_past_stable_s_starts_its_count_afresh():
    workers = FakeWorkers(1)
    sup = PrefillSupervisor(workers, max_quick_failures=1, stable_s=0.05, backoff=FAST, interval=0.01)
    sup.start()
    try:
        for n in (1, 2, 3):  # three slow failures in a row with a limit of one quick failure
            time.sleep(0.1)
            workers.procs[0].code = -9
            wait_for(lambda n=n: sup.restarts == n, what=f"restart {n}")
        assert sup.status()[0]["state"] == "running"
    finally:
        sup.stop()


def test_restarts_off_leave_a_dead_worker_dead(caplog):
    workers = FakeWorkers(1)
    sup = PrefillSupervisor(workers, max_quick_failures=0, backoff=FAST, interval=0.01)
    caplog.set_level(logging.INFO, logger="jkv.serve")
    sup.start()
    try:
        workers.procs[0].code = -9
        wait_for(lambda: sup.status()[0]["state"] == "failed", what="the exit being noticed")
    finally:
        sup.stop()
    assert workers.respawns == 0 and "restarts are off" in caplog.text
    with pytest.raises(ValueError, match="max_quick_failures=-1"):
        PrefillSupervisor(workers, max_quick_failures=-1)


def test_the_reconnector_follows_a_moved_worker_at_once():
    up, attempts = {"prefill-0": False}, []

    def connect(address, timeout):
        attempts.append(address)
        if address != "NEW|B":
            raise ConnectionRefusedError(address)
        up["prefill-0"] = True
        return "prefill-0"

    r = PrefillReconnector(["OLD|B"], {"OLD|B": "prefill-0"}, connect=connect, alive=lambda n: up[n],
                           backoff=Backoff(initial_s=60.0, max_s=60.0))
    r.check()
    assert attempts == ["OLD|B"] and r.reconnecting() == ["OLD|B"]
    r.check()
    assert attempts == ["OLD|B"]  # backing off for a minute
    r.readdress("OLD|B", "NEW|B")
    r.check()
    assert attempts == ["OLD|B", "NEW|B"] and r.reconnecting() == [] and r.addresses == ["NEW|B"]
    with pytest.raises(KeyError, match="not a configured prefill worker"):
        r.readdress("OLD|B", "X|Y")


# ----------------------------------------------------------------------------- a live server
def health(url):
    return httpx.get(url + "/health", timeout=10).json()


def complete(url, prompt="lazy dog", max_tokens=10):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_killed_local_prefill_worker_is_restarted_and_serves_the_same_tokens(tiny_dir, cache_env, tiny_llm):
    s = ServerProcess(["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", "--selector",
                       "streamingllm", "--strategy", "sequential", "--kr-fraction", "0.3", "--disaggregation",
                       "smartgen", "--num-prefill-workers", "1", "--bandwidth", "1gbit", "--max-model-len", "256"],
                      env=cache_env)
    try:
        want = tiny_llm.generate("lazy dog", SamplingParams(max_tokens=10, ignore_eos=True))[0].text
        assert complete(s.url) == want
        h = health(s.url)
        assert h["handshake"]["agreed_with"] == ["prefill-0"] and h["handshake"]["config"]["dtype"] == "float32"
        pid = h["local_prefill_workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: health(s.url)["local_prefill_workers"][0]["restarts"] == 1, timeout=180,
                 what="the prefill worker being restarted")
        wait_for(lambda: httpx.get(s.url + "/ready", timeout=10).status_code == 200, timeout=60,
                 what="the decode side reconnecting to the restarted worker")
        h = health(s.url)
        w = h["local_prefill_workers"][0]
        assert (w["state"], w["last_exit_code"]) == ("running", -9) and w["pid"] != pid, w
        assert h["prefill_workers"][0]["alive"] and h["handshake"]["agreed_with"] == ["prefill-0"], h
        assert complete(s.url) == want  # the same greedy tokens through the restarted worker
        assert metric(s.url, "jkv_prefill_worker_restarts_total", {"worker": "prefill-0"}) == 1
        log = "".join(s.log)
        assert f"prefill-0 (pid {pid}) exited with code -9" in log and "restarted local process prefill-0" in log
        assert h["kv_host_requests"] == 0 and h["kv_pages_in_use"] == 0
    finally:
        assert s.stop() == 0, "".join(s.log[-30:])
