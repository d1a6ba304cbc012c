"""A multi-host replica (jkv/multihost.py, issue 21 item 4): two processes with 2 CPU devices each
form one replica at tensor_parallel=4 over jax.distributed (loopback, gloo) and generate the same
greedy tokens as one process at tensor_parallel=1; a batch that differs on one rank is refused by
every rank. The ranks run tests/models/multihost_worker.py."""
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jkv.multihost import MultiHost, MultiHostError, batch_digest
from tests.device_subprocess import ROOT, device_env, result_line
from tests.models import multihost_worker as w

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks():
    port = _free_port()
    base = device_env(2, JKV_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JKV_NUM_PROCESSES="2")
    procs = [subprocess.Popen([sys.executable, str(WORKER)], env=dict(base, JKV_PROCESS_ID=str(rank)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=600)
            result = result_line(out, "MULTIHOST")
            assert proc.returncode == 0 and result is not None, f"rank {rank} failed (rc {proc.returncode}):\n{err[-4000:]}"
            results.append(result)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture(scope="module")
def one_process_tokens():
    from jkv import LLM, SamplingParams
    from models import tiny_model

    model = tiny_model(w.MODEL["family"], w.MODEL["seed"],
                       **{k: v for k, v in w.MODEL.items() if k not in ("family", "seed")})
    res = LLM(model, max_batch_size=2).generate(w.PROMPTS, SamplingParams(max_tokens=w.MAX_TOKENS, ignore_eos=True))
    return [r.token_ids for r in res]


@pytest.mark.slow  # two jax processes compiling the same programs: ~1 CPU-minute
def test_two_processes_form_one_replica_and_generate_the_one_process_tokens(ranks, one_process_tokens):
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["processes"], r["devices"], r["local_devices"]) == (2, 4, 2)
        assert r["tokens"] == one_process_tokens
        assert r["again"] == one_process_tokens
    assert len({tuple(t) for t in one_process_tokens}) == 2 and len(set(one_process_tokens[1])) > 3


@pytest.mark.slow  # two jax processes compiling the same programs: ~1 CPU-minute
def test_the_kv_cache_is_split_by_kv_head_across_both_processes(ranks):
    for r in ranks:
        assert r["kv_spec"] == "P(None, 'tensor')" and r["kv_processes"] == [0, 1]
        assert r["kv_local_shards"] == 2  # each process holds its 2 devices' heads only


@pytest.mark.slow  # two jax processes compiling the same programs: ~1 CPU-minute
def test_a_batch_that_differs_on_one_rank_is_refused_by_every_rank(ranks):
    for r in ranks:
        assert r["refused"] is not None and "ranks [1] of a 2-process replica got a different batch than rank 0" \
            in r["refused"], r["refused"]


# ---------------------------------------------------------------- no second process needed
def test_settings_come_from_flags_or_the_environment():
    env = dict(JKV_COORDINATOR_ADDRESS="10.0.0.1:8476", JKV_NUM_PROCESSES="2", JKV_PROCESS_ID="1")
    assert MultiHost.from_values(environ=env) == MultiHost("10.0.0.1:8476", 2, 1)
    assert MultiHost.from_values("h:1", 4, 3, environ=env) == MultiHost("h:1", 4, 3)  # flags win
    assert MultiHost.from_values(environ={}) is None


@pytest.mark.parametrize("values, match", [
    (dict(coordinator_address="10.0.0.1", num_processes=2, process_id=0), r"coordinator_address='10.0.0.1' must be host:port"),
    (dict(coordinator_address="h:1", num_processes=2), r"needs process_id too \(--process-id or JKV_PROCESS_ID\)"),
    (dict(num_processes=2, process_id=0), r"num_processes is set but no coordinator address"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"process_id=2 must be in \[0, 2\)"),
])
def test_a_partial_or_impossible_setting_is_refused_naming_it(values, match):
    with pytest.raises(MultiHostError, match=match):
        MultiHost.from_values(environ={}, **values)


def test_the_batch_digest_tells_batches_apart():
    assert (batch_digest([[1, 2], [3]]) == batch_digest([[1, 2], [3]])).all()
    assert not (batch_digest([[1, 2], [3]]) == batch_digest([[3], [1, 2]])).all()


def test_jkv_generate_refuses_a_partial_multi_host_setting(capsys):
    from jkv.cli import main

    rc = main(["generate", "--num-processes", "2", "--prompt", "hi"])
    assert rc == 2 and "num_processes is set but no coordinator address" in capsys.readouterr().err
