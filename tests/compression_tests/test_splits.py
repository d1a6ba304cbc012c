"""The calibration / evaluation split of Table 1 (`jkv.compression.splits`), the generated-token
agreement (`jkv.eval.fidelity.generation_agreement`, `ModelObjective.figures`) and the controller's
profile file built from the evaluation rows (`jkv.compression.table_profile`)."""
import csv
import dataclasses
import json
import pathlib

import numpy as np
import pytest

from jkv.compression.controller import BASELINE
from jkv.compression.policy import CompressionConfig, CompressionPolicy
from jkv.compression.profiling import load_profile, save_profile
from jkv.compression.spec import PipelineSpec
from jkv.compression.splits import (HELDOUT, assert_disjoint, relative_interval, split_pair, split_samples,
                                    spread_windows, window_key)
from jkv.compression.table_profile import read_rows, table_points, table_profile
from jkv.compression.workloads import ModelObjective, WorkloadSample
from jkv.eval.fidelity import generation_agreement

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "results"


class ByteTokenizer:
    """Token id = byte value: enough for the split builders (they only encode and decode text)."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages):
        return self.encode("".join(m["content"] for m in messages))


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer()


@pytest.mark.parametrize("workload", ["continuation", "code", "qa"])
def test_calibration_and_evaluation_share_no_window(tokenizer, workload):
    calibration, evaluation = split_pair(tokenizer, workload, 4, 4, 256)
    assert len(calibration) == len(evaluation) == 4
    keys = {window_key(s) for s in calibration}
    assert not keys & {window_key(s) for s in evaluation}
    # and no evaluation window's scored tokens (with their context) occur anywhere in a calibration prompt
    for s in evaluation:
        span = bytes(window_key(s)[-32:])
        assert not any(span in bytes(c.prompt + c.continuation.tolist()) for c in calibration)


def test_assert_disjoint_rejects_a_window_in_both_splits(tokenizer):
    calibration, evaluation = split_pair(tokenizer, "continuation", 3, 3, 128)
    with pytest.raises(ValueError, match="calibration sample 1"):
        assert_disjoint(calibration, evaluation[:2] + [calibration[1]])
    # the same window with another prompt start is still the same scored window
    shifted = dataclasses.replace(calibration[2], prompt=[7] + calibration[2].prompt[1:])
    with pytest.raises(ValueError, match="calibration sample 2"):
        assert_disjoint(calibration, [shifted])
    with pytest.raises(ValueError, match="repeats"):
        assert_disjoint(calibration, [evaluation[0], evaluation[0]])


def test_heldout_domain_is_evaluation_only_and_unlike_the_corpus(tokenizer):
    with pytest.raises(ValueError, match="only split='eval'"):
        split_samples(tokenizer, HELDOUT, "calibration", 2, 128)
    held = split_samples(tokenizer, HELDOUT, "eval", 3, 128)
    calibration = {w: split_samples(tokenizer, w, "calibration", 3, 128) for w in ("continuation", "code", "qa")}
    for samples in calibration.values():
        assert_disjoint(samples, held)
    assert any("License" in tokenizer.decode(s.prompt) or "LICENSE" in tokenizer.decode(s.prompt) for s in held)


def test_spread_windows_do_not_overlap_and_too_short_text_raises():
    ids = list(range(1000))
    wins = spread_windows(ids, 90, 10, 5)
    starts = [w[0][0] for w in wins]
    assert starts == [0, 200, 400, 600, 800] and all(len(p) == 90 and len(t) == 10 for p, t in wins)
    with pytest.raises(ValueError, match="disjoint windows"):
        spread_windows(ids, 190, 20, 5)


def test_generation_agreement_prefix_and_fraction():
    assert generation_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == {"prefix": 4, "fraction": 1.0}
    assert generation_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == {"prefix": 1, "fraction": 0.75}
    # a generation that stopped early disagrees where the other went on
    assert generation_agreement([1, 2, 3, 4], [1, 2]) == {"prefix": 2, "fraction": 0.5}
    assert generation_agreement([], []) == {"prefix": 0, "fraction": 1.0}


def test_figures_report_generated_token_agreement_against_the_float32_cache():
    from models import tiny_model

    model = tiny_model("llama", 0)
    rng = np.random.default_rng(5)
    samples = [WorkloadSample("continuation", rng.integers(3, model.cfg.vocab_size, 150).tolist(),
                              rng.integers(3, model.cfg.vocab_size, 8).astype(np.int32)) for _ in range(2)]
    obj = ModelObjective(model, samples, chunk_tokens=64, gen_tokens=12)
    assert [len(g) for g in obj.greedy_reference] == [12, 12]
    lossless = obj.figures(PipelineSpec.parse("identity+none+zstd3"))
    original = obj.figures(None)
    # the lossless codec on fp16 KV is exactly the fp16 original: same generations, same scores
    np.testing.assert_array_equal(lossless.gen_fraction, original.gen_fraction)
    np.testing.assert_array_equal(lossless.top1, np.ones(2))
    np.testing.assert_array_equal(lossless.acc, original.acc)  # next-token accuracy vs the true tokens
    assert original.acc.shape == (2,) and np.all((original.acc >= 0) & (original.acc <= 1))
    lossy = obj.figures(PipelineSpec.parse("identity+kivi1g64+none"))
    assert lossy.cr > 3 and lossy.gen_fraction.mean() < original.gen_fraction.mean()
    assert np.all(lossy.gen_prefix <= 12) and lossy.kl.mean() > 100 * max(original.kl.mean(), 1e-9)


def test_relative_interval_brackets_the_ratio_and_narrows_with_samples():
    rng = np.random.default_rng(3)
    base = rng.uniform(0.2, 1.0, 400)
    scores = np.clip(base - rng.normal(0.05, 0.2, 400), 0, 1)  # a lossy pipeline: noisy per sample
    rel, lo, hi = relative_interval(scores, base)
    assert rel == pytest.approx(scores.mean() / base.mean()) and lo < rel < hi
    few = relative_interval(scores[:10], base[:10])
    assert few[2] - few[1] > 2.5 * (hi - lo)  # ~sqrt(40) wider at 10 samples than at 400
    # a pipeline that scales every sample's score by 0.9 reads 0.9 whatever the draw
    assert relative_interval(0.9 * base, base) == pytest.approx((0.9, 0.9, 0.9))
    assert all(np.isnan(relative_interval([1.0, 0.0], [0.0, 0.0])))  # no uncompressed score: no ratio
    with pytest.raises(ValueError, match="equal 1-d"):
        relative_interval([1.0, 0.5], [1.0])
    with pytest.raises(ValueError, match="level"):
        relative_interval([1.0], [1.0], level=95)


def test_profile_floor_on_the_lower_interval_bound(tmp_path):
    """quality='task_lo': a pipeline whose point estimate clears 0.97 but whose interval reaches
    below it does not pass the floor; the profile records which quality it holds."""
    safe, lucky = "identity+tok8g64+zstd3", "hadamard+kivi4g128+zstdh3"
    fields = ["workload", "split", "method", "spec", "streaming", "cr_fp16", "top1", "rel_task_accuracy",
              "rel_task_lo", "rel_task_hi", "rel_acc", "rel_acc_lo", "codec_MBps_fp16"]
    rows = [(w, s, "m", spec, "", cr, 0.99, rel, lo, 1.05, rel, lo, 10) for w, s in
            (("code", "eval"), ("qa", "eval"), ("continuation", "eval"), ("heldout", "heldout"))
            for spec, cr, rel, lo in ((safe, 1.9, 1.0, 0.98), (lucky, 3.9, 0.99, 0.90))]
    # next-token accuracy 0.99 on prose, but the task score's whole interval below the floor there
    rows += [(w, s, "m", "identity+kivi4g128+zstdh3", "", 3.8, 0.95, task, task - 0.2, task + 0.15, 0.99, 0.9, 10)
             for w, s, task in (("code", "eval", 1.3), ("qa", "eval", 1.0), ("continuation", "eval", 0.78),
                                ("heldout", "heldout", 1.2))]
    table = tmp_path / "t.csv"
    with open(table, "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(dict(zip(fields, r)) for r in rows)
    path = tmp_path / "p.json"
    save_profile(path, table_profile(str(table), 1000, "task_lo"))
    assert json.loads(path.read_text())["search"]["quality"] == "task_lo"
    for q_min, chosen in ((0.97, safe), (0.9, lucky)):
        policy = CompressionPolicy(CompressionConfig("auto", profiles=(str(path),), q_min=q_min), bandwidth_bps=1e6)
        assert policy.choose(kv_bytes=50 << 20).spec_id == chosen
    point = {p.spec_id: p.accuracy for p in table_points(read_rows(str(table)), 1000, "task")}
    assert point[safe] == 1.0 and point[lucky] == 0.99  # by the point estimate both would pass 0.97
    by_acc = {p.spec_id: p.accuracy for p in table_points(read_rows(str(table)), 1000, "acc")}
    both = {p.spec_id: p.accuracy for p in table_points(read_rows(str(table)), 1000, "acc_task")}
    assert by_acc["identity+kivi4g128+zstdh3"] == 0.99 and both["identity+kivi4g128+zstdh3"] == pytest.approx(0.93)
    assert both[safe] == 1.0 and both[lucky] == 0.99
    old = tmp_path / "old.csv"
    _write_table(old, [("code", "eval", "m", safe, "", 1.9, 0.99, 1.0, 10)])
    with pytest.raises(ValueError, match="rel_task_lo"):
        table_points(read_rows(str(old)), 1000, "task_lo")


def _write_table(path, rows):
    fields = ["workload", "split", "method", "spec", "streaming", "cr_fp16", "top1", "rel_task_accuracy",
              "codec_MBps_fp16"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(fields, r)))


def test_controller_floor_reads_the_worst_evaluation_domain(tmp_path):
    hi, lo = "hadamard+kivi2g128+zstdh3", "hadamard+kivi4g128+zstdh3"
    rows = [(w, "eval", "m", hi, "", 8.0, 0.9, 0.99, 10) for w in ("code", "qa", "continuation")]
    rows += [("heldout", "heldout", "m", hi, "", 7.9, 0.8, 0.95, 10)]  # fails only on the held-out prose
    rows += [(w, s, "m", lo, "", 3.9, 0.97, 0.98, 10) for w, s in
             (("code", "eval"), ("qa", "eval"), ("continuation", "eval"), ("heldout", "heldout"))]
    rows += [("code", "calibration", "m", hi, "", 8.0, 1.0, 1.0, 10)]  # the search's own samples: ignored
    table = tmp_path / "t.csv"
    _write_table(table, rows)
    points = {p.spec_id: p for p in table_points(read_rows(str(table)), 1000)}
    assert points[hi].accuracy == 0.95 and points[hi].cr == 7.9 and points[lo].accuracy == 0.98
    assert {p.spec_id: p.accuracy for p in table_points(read_rows(str(table)), 1000, "top1")} == {hi: 0.8, lo: 0.97}
    path = tmp_path / "p.json"
    save_profile(path, table_profile(str(table), 1000))
    policy = CompressionPolicy(CompressionConfig("auto", profiles=(str(path),), q_min=0.97), bandwidth_bps=1e6)
    # a slow link: the 8x pipeline would win on time, but its held-out score is under the floor
    assert policy.choose(kv_bytes=50 << 20).spec_id == lo
    loose = CompressionPolicy(CompressionConfig("auto", profiles=(str(path),), q_min=0.9), bandwidth_bps=1e6)
    assert loose.choose(kv_bytes=50 << 20).spec_id == hi


def test_committed_profile_file_holds_the_committed_split_table():
    table, profile = RESULTS / "kvserve_table1_split.csv", RESULTS / "kvserve_profile_table1_split.json"
    stored = load_profile(profile)
    rebuilt = table_profile(str(table), stored.probe_bytes, stored.search["quality"])
    assert {p.spec_id: (p.accuracy, p.cr) for p in stored.points} == \
        {p.spec_id: (p.accuracy, p.cr) for p in rebuilt.points}
    assert set(json.loads(profile.read_text())["search"]["domains"]) == {"code", "qa", "continuation", HELDOUT}
    assert stored.points and BASELINE not in {p.spec_id for p in stored.points}
