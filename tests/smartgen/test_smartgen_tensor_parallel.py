"""Prefill TP != decode TP (issue 21 item 2): a prefill worker at TP 2 feeding a decode worker at
TP 1, and TP 1 feeding TP 2, generate the same tokens as TP 1 -> 1 in every transfer mode.

The KV crosses whole-head (every KV head, global order): the prefill side gathers each layer's
sharded K, V into its host pool, the decode side scatters the rows into pages split by KV head over
its own mesh. The runs happen in one subprocess (tests/smartgen/tp_disagg_worker.py) with
4 CPU devices (tests/device_subprocess.py), like tests/models/test_tensor_parallel.py.
"""
from pathlib import Path

import pytest

from tests.device_subprocess import run_worker

WORKER = Path(__file__).with_name("tp_disagg_worker.py")
MODES = ("full", "partial", "+profile", "+parallel", "smartgen")


@pytest.fixture(scope="module")
def runs():
    result = run_worker(WORKER, "TP-DISAGG", timeout=900)
    assert not result["prefill_leaked"]
    return result["runs"]


@pytest.mark.parametrize("pair", ["2->1", "1->2"])
@pytest.mark.parametrize("mode", MODES)
def test_prefill_and_decode_at_different_degrees_generate_the_tp1_tokens(runs, pair, mode):
    ref, run = runs[f"1->1 {mode}"], runs[f"{pair} {mode}"]
    assert run["finish"] == ["length", "length"]
    assert run["tokens"] == ref["tokens"] == runs["1->1 full"]["tokens"]
    assert len(set(ref["tokens"][0])) > 3, "degenerate reference continuation; pick other prompts"
    # the same blocks moved the same way: on-demand fetches happened in the partial modes
    assert run["on_demand_ratio"] == ref["on_demand_ratio"]
    assert (max(run["on_demand_ratio"]) > 0) == (mode != "full")
    assert run["peer_tp"] == [int(t) for t in pair.split("->")]  # both declared, and they connected
    assert not run["leaked"]


def test_a_decode_worker_at_tp_2_keeps_its_pages_split_by_kv_head(runs):
    for mode in MODES:
        run = runs[f"1->2 {mode}"]  # 2 KV heads over 2 shards; pinned after landing and writes
        assert (run["pages_spec"], run["pages_devices"], run["mask_devices"]) == ("P(None, 'tensor')", 2, 2)
        assert runs[f"2->1 {mode}"]["pages_spec"] == "single-device"
