"""Two decode servers sharing one prefill worker (`jkv serve --role decode` x2, deploy/k8s): a prefill
worker keys its peers by transport name, so each decode worker needs its own (launch.py names a
decode role decode-<hostname>-<pid>); under one shared name the second connection replaces the first."""
import time

from jkv.disagg.cluster import DisaggregatedEngine
from jkv.disagg.config import Disaggregation
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests


def _engine(model, selector, address, name):
    dis = Disaggregation(transfer=TransferConfig(mode="partial", strategy="sequential", kr_fraction=0.3, max_blocks=16),
                         selector="oracle", addresses=(address,), secret=SECRET, bandwidth=None)
    return DisaggregatedEngine(model, dis, selector=selector, name=name)


def test_two_decode_workers_with_their_own_names_share_a_prefill_worker(model, selectors, prompts):
    workers = InProcessWorkers(model, selectors["oracle"], 1)
    engines = []
    try:
        engines = [_engine(model, selectors["oracle"], workers.addresses[0], f"decode-host{i}-1") for i in range(2)]
        outs = [e.generate(make_requests(prompts[:1], max_tokens=3, tag=f"d{i}")) for i, e in enumerate(engines)]
        assert [o[0].finish_reason for o in outs] == ["length", "length"], [o[0].metrics.extra for o in outs]
        assert outs[0][0].token_ids == outs[1][0].token_ids
        assert sorted(workers.workers[0].endpoint.peers) == ["decode-host0-1", "decode-host1-1"]
        assert all(e.decode.alive_owners() == ["prefill-0"] for e in engines)
    finally:
        for e in engines:
            e.close()
        workers.close()


def test_under_one_name_the_second_decode_worker_replaces_the_first(model, selectors):
    workers = InProcessWorkers(model, selectors["oracle"], 1)
    engines = []
    try:
        engines = [_engine(model, selectors["oracle"], workers.addresses[0], "decode-0") for _ in range(2)]
        assert list(workers.workers[0].endpoint.peers) == ["decode-0"]
        first = engines[0].decode
        deadline = time.monotonic() + 10
        while first.alive_owners() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.alive_owners() == []  # why a decode role needs a unique name
    finally:
        for e in engines:
            e.close()
        workers.close()
