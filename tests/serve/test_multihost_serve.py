"""`jkv serve --role all` spanning two processes (jkv/serving/replica.py, issue 21 item 4).

Two processes with 2 CPU devices each (jax.distributed on loopback, gloo collectives) form one
replica at --tensor-parallel 4 on a tiny Llama with 8 query / 2 KV heads (fewer KV heads than
shards: the KV cache is replicated, the query heads split). Rank 0 serves HTTP and broadcasts every
engine step, rank 1 follows. Concurrent completions of different lengths (greedy, and one seeded
sample) equal those of a one-process server; killing rank 1 makes rank 0's next request fail with
an error that names the lost rank, within seconds, and /ready says so.
"""
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPO, ServerProcess
from tiny_ckpt import write_tiny_llama

ARGS = ["--served-model-name", "tiny", "--max-slots", "2", "--max-model-len", "32"]
REQUESTS = [dict(prompt="the quick brown fox", max_tokens=7, temperature=0),
            dict(prompt="a stitch in time saves nine", max_tokens=12, temperature=0),
            dict(prompt="JAX", max_tokens=4, temperature=0),
            dict(prompt="tokens flow from prefill to decode", max_tokens=9, temperature=0.8, seed=7)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def awkward_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-8q-2kv"), heads=8, kv_heads=2)


def _complete_all(post) -> list[dict]:
    """The REQUESTS at once (they share decode steps and wait for seats); (text, finish, tokens) each."""
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        bodies = list(pool.map(lambda r: post(dict(model="tiny", **r)), REQUESTS))
    assert all("choices" in b for b in bodies), bodies
    return [dict(text=b["choices"][0]["text"], finish=b["choices"][0]["finish_reason"],
                 tokens=b["usage"]["completion_tokens"]) for b in bodies]


@pytest.fixture(scope="module")
def replica(awkward_dir, tmp_path_factory):
    """Rank 0 (flags) and rank 1 (JKV_* variables) of one replica; yields (rank 0 server, rank 1 process)."""
    cache = {"JKV_CACHE_DIR": str(tmp_path_factory.mktemp("jkv-cache-mh"))}
    env = dict(cache, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    address = f"127.0.0.1:{_free_port()}"
    rank1_log = open(tmp_path_factory.mktemp("rank1") / "stderr.log", "w+")
    rank1 = subprocess.Popen(
        [sys.executable, "-m", "jkv.cli", "serve", "--model", str(awkward_dir), "--tensor-parallel", "4", *ARGS],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=rank1_log, text=True,
        env=dict(os.environ, **env, PYTHONPATH=str(REPO), JKV_COORDINATOR_ADDRESS=address, JKV_NUM_PROCESSES="2",
                 JKV_PROCESS_ID="1"))
    rank0 = ServerProcess(["--model", str(awkward_dir), "--port", "0", "--tensor-parallel", "4", *ARGS,
                           "--coordinator-address", address, "--num-processes", "2", "--process-id", "0"],
                          env=env, ready_timeout=600, wait=False)
    try:
        yield rank0, rank1, rank1_log
    finally:
        rank0.stop(signal.SIGKILL)
        if rank1.poll() is None:
            rank1.kill()
        rank1.wait()
        rank1_log.close()


@pytest.fixture(scope="module")
def one_process_completions(awkward_dir):
    """The same requests to a one-process `jkv serve --role all` app (in this process, TP 1)."""
    from fastapi.testclient import TestClient

    from jkv.serving.config import config_from_flags
    from jkv.serving.launch import build_all

    cfg = config_from_flags(dict(model=str(awkward_dir), served_model_name="tiny", max_slots=2, max_model_len=32))
    app, _ = build_all(cfg)
    with TestClient(app) as client:
        return _complete_all(lambda body: client.post("/v1/completions", json=body).json())


@pytest.mark.slow  # two jax processes compile and warm up the paged engine at TP 4: ~1-2 CPU-minutes
def test_a_two_process_replica_serves_the_one_process_completions(replica, one_process_completions):
    rank0, rank1, _ = replica
    rank0.wait_ready()
    with httpx.Client(base_url=rank0.url, timeout=300) as client:
        got = _complete_all(lambda body: client.post("/v1/completions", json=body).json())
        health = client.get("/health").json()
    assert got == one_process_completions
    assert len({c["text"] for c in got}) == len(REQUESTS) and {c["tokens"] for c in got} >= {4, 7}
    assert health["multihost"] == {"processes": 2, "rank": 0, "lost": None}
    assert rank1.poll() is None


@pytest.mark.slow  # runs after the test above, on its replica
def test_killing_rank_1_fails_rank_0s_next_request_with_a_clear_error(replica):
    rank0, rank1, rank1_log = replica
    rank0.wait_ready()
    rank1.send_signal(signal.SIGKILL)
    rank1.wait()
    start = time.monotonic()
    with httpx.Client(base_url=rank0.url, timeout=60) as client:
        try:
            r = client.post("/v1/completions", json=dict(model="tiny", prompt="the quick", max_tokens=4))
            elapsed = time.monotonic() - start
            ready = client.get("/ready")
        except httpx.HTTPError as e:
            raise AssertionError(f"rank 0 did not answer ({e}):\n" + "".join(rank0.log[-30:])) from None
    assert r.status_code >= 500, r.text
    assert "the multi-host replica lost a rank" in r.text and "restart every rank of the replica" in r.text, r.text
    assert elapsed < 30
    assert ready.status_code == 503 and "lost a rank" in json.loads(ready.text)["reason"]


# ------------------------------------------------------------------- no second process needed
def test_the_step_channel_carries_a_message_longer_than_one_broadcast():
    from jkv.serving.replica import StepChannel

    channel = StepChannel(words=8)  # 20 payload bytes per broadcast: this message takes several
    message = {"items": [["submit", {"id": "req-1", "ids": list(range(40))}], ["cancel", "req-0"]], "state": [1, 2]}
    assert channel.broadcast(message) == message
    assert channel.broadcast({}) == {}


@pytest.mark.parametrize("flags, match", [
    (dict(role="decode", prefill_worker=["a:1|a:2"], strategy="streaming"), r"--role decode cannot span processes yet"),
    (dict(disaggregation="smartgen", strategy="streaming"), r"--disaggregation cannot span processes yet"),
    (dict(kv_layout="slots"), r"--kv-layout slots cannot span processes"),
    (dict(prefix_cache_host_bytes=1 << 20), r"--prefix-cache-host-bytes cannot be used in a multi-host replica"),
])
def test_what_cannot_span_processes_is_refused_naming_the_flag(flags, match):
    from jkv.multihost import MultiHost, MultiHostError
    from jkv.serving.config import config_from_flags
    from jkv.serving.replica import check_multihost_serve

    with pytest.raises(MultiHostError, match=match):
        check_multihost_serve(config_from_flags(flags), MultiHost("h:1", 2, 0))


def test_tensor_parallel_must_cover_every_device_of_the_replica():
    from jkv.multihost import MultiHost, MultiHostError
    from jkv.serving.config import config_from_flags
    from jkv.serving.replica import check_multihost_serve

    cfg = config_from_flags(dict(tensor_parallel=2))
    check_multihost_serve(cfg, MultiHost("h:1", 2, 0))  # the device count is not known before joining
    with pytest.raises(MultiHostError, match=r"--tensor-parallel 2 must equal the replica's global device count 4"):
        check_multihost_serve(cfg, MultiHost("h:1", 2, 0), device_count=4)


def test_jkv_serve_refuses_a_partial_multi_host_setting(capsys):
    from jkv.cli import main

    assert main(["serve", "--process-id", "1", "--model", "x"]) == 2
    assert "process_id is set but no coordinator address" in capsys.readouterr().err


# ------------------------------------- rank 0 and a follower in one process, joined by a queue
class _QueueChannel:
    """StepChannel's contract without jax.distributed: rank 0's broadcast hands its message to the
    follower's (`tamper` changes the state digest rank 0 sends, from the given step on)."""

    def __init__(self, rank: int, pipe, tamper_from: int | None = None):
        self.rank, self.processes, self.pipe, self.tamper_from, self.sent = rank, 2, pipe, tamper_from, 0

    def broadcast(self, message=None):
        if self.rank:
            return self.pipe.get(timeout=120)
        if self.tamper_from is not None and self.sent >= self.tamper_from and "state" in message:
            message = dict(message, state=[0, 0, 0, 0])
        self.sent += 1
        self.pipe.put(message)
        return message


def _lockstep(model, tamper_from=None):
    """(leader, follower, follower thread, follower's events by request, follower's exit or error)."""
    import queue
    import threading

    from jkv.serving.batcher import BatcherConfig
    from jkv.serving.replica import FollowerBatcher, LeaderBatcher

    cfg = BatcherConfig(max_slots=2, max_model_len=64, page_size=8, prefill_chunk=16)
    pipe = queue.Queue()
    leader = LeaderBatcher(model, cfg, channel=_QueueChannel(0, pipe, tamper_from))
    follower = FollowerBatcher(model, cfg, channel=_QueueChannel(1, pipe))
    seen, result = {}, {}
    follower._send = lambda req, ev: seen.setdefault(req.request_id, []).append(ev)

    def follow():
        try:
            result["rc"] = follower.run()
        except Exception as e:  # noqa: BLE001 - the test reads it
            result["error"] = e

    thread = threading.Thread(target=follow, daemon=True)
    leader.start()
    thread.start()
    return leader, follower, thread, seen, result


@pytest.fixture(scope="module")
def tiny():
    from models import tiny_model

    return tiny_model("llama", seed=3)


def test_a_follower_steps_the_leaders_batches_in_lock_step_and_stops_with_it(tiny):
    from engine_events import collect, submit, token_ids

    from jkv import SamplingParams

    leader, follower, thread, seen, result = _lockstep(tiny)
    prompts = [[5, 6, 7], list(range(3, 40)), [9] * 20]  # one prompt takes three 16-token chunks
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 4)]
    params[2] = SamplingParams(max_tokens=4, temperature=0.9, ignore_eos=True)  # its seed is drawn by rank 0
    queues = [submit(leader, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    leader.cancel("never-submitted")
    events = [collect(q) for q in queues]
    leader.stop()
    thread.join(60)
    assert result == {"rc": 0}
    assert [token_ids(e) for e in events] == [token_ids(seen[f"r{i}"]) for i in range(3)]
    assert [len(token_ids(e)) for e in events] == [6, 9, 4]
    assert follower.kv.pages_in_use == 0 and leader.pages_in_use == 0


def test_a_follower_whose_state_differs_from_rank_0s_stops_naming_the_step(tiny):
    from engine_events import collect, submit

    from jkv import SamplingParams
    from jkv.multihost import MultiHostError

    leader, follower, thread, seen, result = _lockstep(tiny, tamper_from=3)
    collect(submit(leader, "r0", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)))
    thread.join(60)
    leader.stop()
    assert isinstance(result.get("error"), MultiHostError), result
    assert "engine state diverged from rank 0's before step 3" in str(result["error"])
