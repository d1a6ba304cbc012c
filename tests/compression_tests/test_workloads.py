"""The model-based objective and `jkv compress-profile` on a tiny random model (no tokenizer:
samples are token ids; the text workloads themselves are exercised by the benchmark)."""
import argparse

import numpy as np
import pytest

from jkv.compression import cli
from jkv.compression.profiling import load_profile
from jkv.compression.spec import PipelineSpec
from jkv.compression.workloads import ModelObjective, WorkloadSample, workload_samples
from models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0)


def samples(model, n=2, length=150):
    rng = np.random.default_rng(3)
    return [WorkloadSample("continuation", rng.integers(3, model.cfg.vocab_size, length).tolist(),
                           rng.integers(3, model.cfg.vocab_size, 8).astype(np.int32)) for _ in range(n)]


def test_objective_lossless_is_exact_and_one_bit_is_not(model):
    first = ModelObjective(model, samples(model), chunk_tokens=64)
    # continuations the dense model predicts well (its own greedy tokens), so lossy KV must cost NLL
    greedy = [WorkloadSample(s.workload, s.prompt, np.asarray(first.generate(kv, i, 8), np.int32))
              for i, (s, kv) in enumerate(zip(first.samples, first.kv16))]
    obj = ModelObjective(model, greedy, chunk_tokens=64)
    exact = obj.measure(PipelineSpec.parse("identity+none+zstd3"))
    # fp16 storage of the reference cache: only the float16 rounding the reference also has
    assert exact.accuracy == 1.0 and exact.kl < 1e-6 and 0.9 < exact.cr < 1.2
    lossy = obj.measure(PipelineSpec.parse("identity+kivi1g64+none"))
    assert lossy.kl > 100 * max(exact.kl, 1e-9) and lossy.cr > 3
    assert obj.task_scores(None) == pytest.approx([1.0, 1.0])  # continuation: exp(-NLL increase)
    assert min(obj.task_scores(PipelineSpec.parse("identity+kivi1g64+none"))) < 1.0


def test_workload_samples_need_text(model):
    with pytest.raises(ValueError, match="tokenizer"):
        workload_samples(None, "qa", 1, 256)


def test_space_has_mixed_precision_tables(model):
    scores = np.random.default_rng(0).random((model.cfg.num_layers, model.cfg.num_kv_heads))
    tables = cli.mixed_tables(scores)
    assert all(len(t) == model.cfg.num_layers and len(t[0]) == model.cfg.num_kv_heads for t in tables.values())
    assert tables["first2x8"][0] == (8, 8) and tables["first2x8"][2] == (2, 2)
    space = cli.strategy_space(scores, quick=True)
    assert len({s.id for s in space}) == len(space) and any(s.quantizer.method == "mixed" for s in space)


def test_compress_profile_cli_writes_a_loadable_pareto_file(model, tmp_path, monkeypatch):
    import models

    monkeypatch.setattr(models, "load_model", lambda name: model)
    monkeypatch.setattr(cli, "workload_samples", lambda tok, w, count, length, cont: samples(model, 1, 130))
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["compress-profile", "--out", str(tmp_path), "--workloads", "qa", "--quick",
                              "--limit", "3", "--acc-threshold", "0.5"])
    assert cli.run(args) == 0
    profile = load_profile(tmp_path / "qa.json")
    assert profile.workload == "qa" and 1 <= profile.search["evaluations"] <= 3
    assert profile.points and all(p.accuracy >= 0.5 and p.cr > 1 for p in profile.points)
    with pytest.raises(ValueError, match="unknown"):
        cli.run(parser.parse_args(["compress-profile", "--out", str(tmp_path), "--workloads", "chat"]))
