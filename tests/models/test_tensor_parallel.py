"""Tensor parallelism (models/sharding.py): identical greedy tokens at TP 1, 2 and 4, the layouts
chosen for awkward head counts, and the refusals.

The multi-device runs happen in one subprocess (tests/models/tp_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=4: the host device count is fixed when jax
initialises, and the rest of the suite keeps its single CPU device. The planning and refusal
checks that need no devices run here.
"""
from pathlib import Path

import numpy as np
import pytest

from models import TensorParallelError, plan_layout, tiny_config, tiny_model
from tests.device_subprocess import run_worker

WORKER = Path(__file__).with_name("tp_worker.py")


# The worker compiles ~40 small sharded programs (7 tiny models x paged/dense decode, prefill,
# writes; 3 SmolLM2 prefills; 2 serve engines) at -O0 (tests/device_subprocess.py; tiny runs
# 57 -> 45 s, SmolLM2 runs 17 -> 15 s of CPU).
@pytest.fixture(scope="module")
def runs():
    return run_worker(WORKER, "TP-RESULT")


CASES = ["qwen3-6q2kv", "qwen2-8q2kv", "llama-8q8kv-bias"]


@pytest.mark.parametrize("case", CASES)
def test_tiny_models_generate_identical_greedy_tokens_at_every_degree(runs, case):
    by_tp = runs["tiny"][case]
    assert len(by_tp) >= 2
    ref = by_tp["1"]
    assert len(set(ref["tokens"][1])) > 3, "the reference continuation is degenerate; pick another prompt"
    for tp, run in by_tp.items():
        assert run["tokens"] == ref["tokens"], f"TP {tp} (paged engine) differs from TP 1"
        assert run["dense_tokens"] == ref["dense_tokens"], f"TP {tp} (dense cache) differs from TP 1"
        np.testing.assert_allclose(run["prefill_logits"], ref["prefill_logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_the_handshake_declares_the_degree_and_the_same_weights_fingerprint(runs, case):
    by_tp = runs["tiny"][case]
    assert {int(tp): run["handshake_tp"] for tp, run in by_tp.items()} == {int(tp): int(tp) for tp in by_tp}
    assert len({run["handshake_weights"] for run in by_tp.values()}) == 1  # sharding changes no weight


@pytest.mark.parametrize("case, tp", [("qwen3-6q2kv", "2"), ("qwen2-8q2kv", "4"), ("llama-8q8kv-bias", "2")])
def test_paged_decode_attends_per_shard_without_gathering_the_context(runs, case, tp):
    """Query heads split (KV heads split, or replicated with fewer than the shards): the decode
    step's only collectives are the 2 all-reduces per layer (o_proj, down_proj); the paged
    attention's merged B x H_kv rows made GSPMD all-gather the K/V context before its shard_map."""
    layers = 2 if case != "qwen3-6q2kv" else 3
    assert runs["tiny"][case][tp]["decode_collectives"] == {"all-reduce": 2 * layers, "all-gather": 0}


@pytest.mark.parametrize("layout", ["paged", "slots"])
def test_the_serve_engines_generate_identical_tokens_over_a_sharded_kv_cache(runs, layout):
    run = runs["serve"][f"{layout}-2"]  # two requests at once, chunked prefill (paged)
    assert run["tokens"] == runs["tiny"]["qwen3-6q2kv"]["1"]["tokens"]
    assert run["cache_spec"] == "P(None, 'tensor')"


def test_heads_that_split_shard_attention_and_the_kv_cache_by_kv_head(runs):
    run = runs["tiny"]["qwen3-6q2kv"]["2"]  # 6 query / 2 KV heads over 2 shards: one KV head each
    assert run["q_spec"] == run["k_spec"] == run["up_spec"] == "P(None, 'tensor')"
    assert run["o_spec"] == run["down_spec"] == "P('tensor', None)"
    assert run["paged_cache_spec"] == run["dense_cache_spec"] == "P(None, 'tensor')"
    assert run["cache_devices"] == 2
    run = runs["tiny"]["llama-8q8kv-bias"]["2"]
    assert run["k_spec"] == run["paged_cache_spec"] == "P(None, 'tensor')"


def test_fewer_kv_heads_than_shards_are_replicated_while_query_heads_split(runs):
    run = runs["tiny"]["qwen2-8q2kv"]["4"]  # 8 query heads over 4 shards, 2 KV heads on each
    assert run["q_spec"] == "P(None, 'tensor')" and run["o_spec"] == "P('tensor', None)"
    assert run["k_spec"] == "P()" and run["paged_cache_spec"] == run["dense_cache_spec"] == "P(None, None)"
    assert run["cache_devices"] == 4
    assert "replicated KV cache" in run["layout"]


def test_query_heads_that_do_not_split_replicate_attention_and_shard_the_mlp(runs):
    run = runs["tiny"]["qwen3-6q2kv"]["4"]  # 6 heads do not split over 4 shards; intermediate 160 does
    assert run["q_spec"] == run["o_spec"] == run["k_spec"] == "P()"
    assert run["up_spec"] == "P(None, 'tensor')" and run["down_spec"] == "P('tensor', None)"
    assert run["layout"] == "tensor_parallel=4: sharded MLP; replicated attention, KV cache, vocabulary"


def test_smollm2_greedy_tokens_are_identical_at_tp_1_2_4(runs):
    smol = runs["smollm2"]
    assert smol["1"]["tokens"] == smol["2"]["tokens"] == smol["4"]["tokens"]
    assert all(len(t) == 8 for t in smol["1"]["tokens"])
    for tp in ("2", "4"):  # 9 query / 3 KV heads split over neither: MLP and the 49152-row vocabulary do
        assert smol[tp]["q_spec"] == "P()"
        assert smol[tp]["up_spec"] == "P(None, 'tensor')" and smol[tp]["embed_spec"] == "P('tensor', None)"


def test_a_degree_above_the_devices_or_that_shards_nothing_is_refused(runs):
    assert runs["refusals"]["8"] == (
        "tensor_parallel=8 needs 8 devices but jax sees 4 (cpu); use tensor_parallel <= 4 (on CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported fakes more devices)")
    assert runs["refusals"]["3"] == (
        "tensor_parallel=3 cannot shard this model: num_heads=6 (with num_kv_heads=2) and intermediate_size=160 "
        "do not divide by 3, so every shard would hold and compute the whole model; use tensor_parallel in [1, 2, 4]")


# ---------------------------------------------------------------- no devices needed
def test_plan_layout_decides_by_head_counts():
    cfg = tiny_config("llama", num_heads=8, num_kv_heads=2)  # intermediate 160, vocab 301
    assert plan_layout(cfg, 1, 1).tensor_parallel == 1
    two = plan_layout(cfg, 2, 8)
    assert (two.attention, two.kv_heads, two.mlp, two.vocab) == (True, True, True, False)
    four = plan_layout(cfg, 4, 8)
    assert (four.attention, four.kv_heads, four.mlp) == (True, False, True)
    eight = plan_layout(cfg, 8, 8)  # 8 query heads, one a shard; 160 / 8 splits too
    assert (eight.attention, eight.kv_heads, eight.mlp) == (True, False, True)
    # 12 query / 3 KV heads at 2: each shard's query heads would straddle KV heads -> replicated attention
    odd = plan_layout(tiny_config("llama", num_heads=12, num_kv_heads=3), 2, 2)
    assert (odd.attention, odd.mlp) == (False, True)


def test_the_vocabulary_is_sharded_only_when_large_and_divisible():
    big = tiny_config("llama", vocab_size=1 << 16, hidden_size=96)  # 24 MiB of fp32 embedding
    assert plan_layout(big, 2, 2).vocab
    assert not plan_layout(big.replace(vocab_size=(1 << 16) + 1), 2, 2).vocab
    assert not plan_layout(tiny_config("llama"), 2, 2).vocab  # 301 x 96: replicated


@pytest.mark.parametrize("tp, match", [
    (0, r"tensor_parallel=0 must be an int >= 1"),
    (2, r"tensor_parallel=2 needs 2 devices but jax sees 1 \(cpu\); use tensor_parallel <= 1"),
])
def test_a_single_device_process_refuses_tensor_parallelism_naming_the_numbers(tp, match):
    with pytest.raises(TensorParallelError, match=match):
        tiny_model("llama", 0, tensor_parallel=tp)


def test_tensor_parallel_one_keeps_the_single_device_path():
    m = tiny_model("llama", 0)
    assert m.sharding is None and m.kv_sharding is None and m.tensor_parallel == 1
    assert m.with_tensor_parallel(1) is m


def _serve_config(argv):
    import argparse

    from jkv.serving.config import add_serve_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("argv, match", [
    (["--tensor-parallel", "0"], r"tensor_parallel=0 must be >= 1"),
    (["--tensor-parallel", "2", "--role", "router", "--upstream", "http://a:8000"], r"not --role router"),
])
def test_serve_refuses_a_degree_below_one_or_on_the_router(argv, match):
    with pytest.raises(ValueError, match=match):
        _serve_config(argv)


@pytest.mark.parametrize("argv", [
    [], ["--role", "prefill"], ["--disaggregation", "full"],
    ["--role", "decode", "--prefill-worker", "127.0.0.1:7100|127.0.0.1:7101", "--strategy", "sequential"],
])
def test_every_role_that_loads_a_model_takes_a_degree(argv):
    """The SmartGen roles too: prefill and decode may run different degrees
    (tests/smartgen/test_smartgen_tensor_parallel.py)."""
    assert _serve_config(["--tensor-parallel", "2", *argv]).tensor_parallel == 2


def test_local_prefill_workers_start_at_the_decode_models_degree(monkeypatch):
    from jkv.disagg import cluster

    started = []
    monkeypatch.setattr(cluster.LocalPrefillWorkers, "_spawn", lambda self, i: started.append(self._args))
    monkeypatch.setattr(cluster.LocalPrefillWorkers, "_wait_ready", staticmethod(lambda i, proc, t: "a|b"))
    cluster.LocalPrefillWorkers(1, "tiny:qwen2:0", "sel.pkl", secret="s" * 8, tensor_parallel=2)
    args = started[0]
    assert args[args.index("--tensor-parallel") + 1] == "2"
    import argparse

    from jkv.disagg.prefill_worker import add_args

    p = argparse.ArgumentParser()
    add_args(p)  # the worker process parses what it was given
    assert p.parse_args(args).tensor_parallel == 2


def test_jkv_generate_refuses_a_degree_above_the_devices(capsys):
    from jkv.cli import main

    rc = main(["generate", "--model", "smollm2-135m-instruct", "--tensor-parallel", "2", "--prompt", "hi",
               "--max-tokens", "1"])
    assert rc == 2
    assert "tensor_parallel=2 needs 2 devices but jax sees 1" in capsys.readouterr().err
