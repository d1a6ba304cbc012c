"""Eval harness: task generators, metrics, and an end-to-end run on a tiny model."""
import argparse
import math

import numpy as np
import pytest

import copy

from tests.selection.tiny import shared_tiny_model

from jkv.eval import cli
from jkv.eval.fidelity import fidelity_metrics, fidelity_sample, fidelity_windows
from jkv.eval.harness import EvalConfig, evaluate, format_table, metadata_bytes_per_token, summarize, write_csv
from jkv.eval.tasks import TASKS, edit_similarity
from jkv.selection import get_selector
from jkv.selection.calibration import collect_calibration
from jkv.selection.simple import Dense


class ByteTokenizer:
    """Bytes + 3 (ids 3..258); a chat template that just wraps the text."""

    eos_id = 2

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages):
        return self.encode("<user>" + messages[0]["content"] + "<assistant>")


def with_tokenizer(tokenizer):
    """The shared tiny model (compiled pieces reused) with a byte tokenizer attached to a copy."""
    model = copy.copy(shared_tiny_model())
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_are_deterministic_fit_the_length_and_score_their_answer(task, tokenizer):
    a, b = TASKS[task](tokenizer, 600, 3), TASKS[task](tokenizer, 600, 3)
    assert a.prompt == b.prompt and a.answer == b.answer
    assert TASKS[task](tokenizer, 600, 4).prompt != a.prompt
    assert abs(len(a.prompt) - 600) <= 120, len(a.prompt)
    assert a.score(a.answer) == 1.0
    assert a.score("") < 1.0 or task == "code_completion" and a.answer == ""
    if task != "code_completion":
        # The answer is actually in the prompt (a retrievable needle), for the chat tasks.
        assert a.answer.split()[0] in tokenizer.decode(a.prompt)


def test_edit_similarity():
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert edit_similarity("", "") == 1.0 and edit_similarity("", "ab") == 0.0


def test_fidelity_metrics_by_hand(tokenizer):
    dense = np.log(np.asarray([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    sparse = np.log(np.asarray([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    metrics = fidelity_metrics(dense, sparse, np.asarray([0, 1]))
    kl_first = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert metrics["kl"] == pytest.approx(kl_first / 2)
    assert metrics["top1"] == 0.5
    assert metrics["agree"] == "01"  # per position, for paired comparisons of two selectors
    assert metrics["acc"] == 0.5  # the sparse side's argmax [1, 1] against the true tokens [0, 1]
    assert fidelity_metrics(sparse, dense, np.asarray([0, 1]))["acc"] == 1.0
    assert metrics["ppl_ratio"] == pytest.approx(math.exp((math.log(4) - math.log(2)) / 2))
    assert fidelity_metrics(dense, dense, np.asarray([0, 1]))["kl"] == 0.0
    prompt, targets = fidelity_sample(tokenizer, 300, 16, 2)
    assert len(prompt) == 300 and targets.shape == (16,)
    windows = fidelity_windows(tokenizer, 300, 16)  # distinct samples, then the index wraps
    assert windows > 2 and fidelity_sample(tokenizer, 300, 16, windows)[0] == fidelity_sample(tokenizer, 300, 16, 0)[0]
    assert fidelity_sample(tokenizer, 300, 16, windows - 1)[0] != fidelity_sample(tokenizer, 300, 16, 0)[0]
    with pytest.raises(ValueError, match="shape mismatch"):
        fidelity_metrics(dense, sparse[:1], np.asarray([0, 1]))


def test_calibration_windows_are_disjoint_and_the_first_is_the_single_window(tokenizer):
    from jkv.selection.calibration import calibration_tokens, calibration_windows

    model = with_tokenizer(tokenizer)
    windows = calibration_windows(model, 2, 72, 8)
    single = collect_calibration(model, calibration_tokens(model, 80), 72, 8)
    np.testing.assert_array_equal(windows[0].queries[3], single.queries[3])
    assert not np.allclose(windows[1].keys[3], windows[0].keys[3])  # the next 80 tokens, not the same ones
    with pytest.raises(ValueError, match="windows=0"):
        calibration_windows(model, 0, 72, 8)


def test_harness_at_full_ratio_matches_dense_everywhere(tokenizer):
    model = with_tokenizer(tokenizer)
    rng = np.random.default_rng(0)
    calibration = collect_calibration(model, list(rng.integers(3, 259, size=80)), 72, 8)
    selectors = {(n, 1.0): get_selector(n, max_ratio=1.0) for n in ("oracle", "quest", "streamingllm")}
    selectors[("infinigen", 1.0)] = get_selector("infinigen", max_ratio=1.0, alpha=math.inf, calibration=calibration)
    config = EvalConfig(tasks=("passkey", "fidelity"), lengths=(256,), limit=2, fidelity_tokens=6,
                        selectors=("oracle", "quest", "streamingllm", "infinigen"), ratios=(1.0,))
    rows = evaluate(model, config, selectors, progress=False)
    assert len(rows) == 2 * 2 * 5
    dense_output = {(r["task"], r["index"]): r.get("output") for r in rows if r["selector"] == "dense"}
    for row in rows:
        assert row["kv_fraction"] == pytest.approx(1.0)
        if row["task"] == "fidelity":
            assert row["score"] == 1.0 and row["kl"] < 1e-6 and row["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
        else:
            assert row["output"] == dense_output[(row["task"], row["index"])]
    summary = summarize(rows)
    assert {s["selector"] for s in summary} == {"dense", "oracle", "quest", "streamingllm", "infinigen"}
    assert all(s["relative_score"] == pytest.approx(1.0) for s in summary if s["task"] == "fidelity")
    assert "infinigen" in format_table(summary)


def test_low_ratio_on_tiny_model_reports_less_kv(tokenizer, tmp_path):
    model = with_tokenizer(tokenizer)
    config = EvalConfig(tasks=("fidelity",), lengths=(256,), limit=1, fidelity_tokens=4,
                        selectors=("oracle", "streamingllm"), ratios=(0.2,))
    rows = evaluate(model, config, progress=False)
    sparse = [r for r in rows if r["selector"] != "dense"]
    # 4 layers, 2 dense: two layers at ~20% -> (2 + 2 * 0.2) / 4 of the KV.
    assert all(r["kv_fraction"] == pytest.approx((2 + 2 * 0.2) / 4, abs=0.01) for r in sparse)
    assert all(0 < r["score"] <= 1 and r["kl"] >= 0 for r in sparse)
    write_csv(str(tmp_path / "rows.csv"), rows)
    assert (tmp_path / "rows.csv").read_text().startswith("task,length")


def test_first_offsets_the_samples_and_relative_scores_pair_the_dense_samples(tokenizer):
    model = with_tokenizer(tokenizer)
    selectors = {("streamingllm", 0.2): get_selector("streamingllm", max_ratio=0.2)}
    config = EvalConfig(tasks=("fidelity",), lengths=(256,), limit=1, first=3, fidelity_tokens=3,
                        selectors=("streamingllm",))
    rows = evaluate(model, config, selectors, progress=False)
    assert {r["index"] for r in rows} == {3}
    # Hand-made rows: the 0.1 group covers sample 0 only, so its reference is dense sample 0.
    def row(selector, ratio, index, score):
        return {"task": "passkey", "length": 256, "selector": selector, "max_ratio": ratio, "index": index,
                "score": score, "kv_fraction": 1.0, "sparse_kv_fraction": 1.0, "select_ms": 0.0, "step_ms": 1.0}
    summary = summarize([row("dense", 1.0, 0, 0.5), row("dense", 1.0, 1, 1.0), row("oracle", 0.2, 0, 0.5),
                         row("oracle", 0.2, 1, 0.5), row("oracle", 0.1, 0, 0.25)])
    by = {(s["selector"], s["max_ratio"]): s for s in summary}
    assert by[("oracle", 0.2)]["relative_score"] == pytest.approx(0.5 / 0.75)
    assert by[("oracle", 0.1)]["relative_score"] == pytest.approx(0.5) and by[("oracle", 0.1)]["dense_score"] == 0.5
    assert by[("dense", 1.0)]["relative_score"] == pytest.approx(1.0)


def test_eval_config_and_cli_errors():
    with pytest.raises(ValueError, match="unknown task.*valid: passkey"):
        EvalConfig(tasks=("summarize",))
    with pytest.raises(ValueError, match="valid names: dense, hata"):
        EvalConfig(selectors=("h2o",))
    with pytest.raises(ValueError, match=r"ratios=\(1.5,\)"):
        EvalConfig(ratios=(1.5,))
    with pytest.raises(ValueError, match="first=-1"):
        EvalConfig(first=-1)
    with pytest.raises(ValueError, match="hata_windows=0"):
        EvalConfig(hata_windows=0)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", "--tasks", "passkey,fidelity", "--lengths", "512,1024", "--ratios", "0.1,0.2",
                              "--limit", "3"])
    assert args.tasks == ("passkey", "fidelity") and args.lengths == (512, 1024) and args.ratios == (0.1, 0.2)
    assert args.func is cli.run and args.limit == 3


def test_batched_samples_match_one_at_a_time_and_metadata_bytes_are_reported(tokenizer):
    model = with_tokenizer(tokenizer)
    cfg = model.cfg
    selectors = {("quest", 0.3): get_selector("quest", max_ratio=0.3, metadata_dtype="int8", page_size=2),
                 ("streamingllm", 0.3): get_selector("streamingllm", max_ratio=0.3)}
    base = dict(tasks=("passkey", "fidelity"), lengths=(256,), limit=2, fidelity_tokens=4,
                selectors=("quest", "streamingllm"), ratios=(0.3,))
    single = evaluate(model, EvalConfig(**base), selectors, progress=False)
    batched = evaluate(model, EvalConfig(**base, batch=2), selectors, progress=False)  # one chunk [0, 1]
    key = lambda r: (r["task"], r["index"], r["selector"])  # noqa: E731
    assert sorted(map(key, single)) == sorted(map(key, batched)) and len(single) == 2 * 2 * 3
    by_key = {key(r): r for r in single}
    for row in batched:
        alone = by_key[key(row)]
        assert row["batch"] == 2 and alone["batch"] == 1
        if row["task"] == "fidelity":
            assert row["score"] == alone["score"]
            assert row["kl"] == pytest.approx(alone["kl"], abs=1e-5)
        else:
            assert row["output"] == alone["output"] and row["score"] == alone["score"]
    per_token = {r["selector"]: r["metadata_bytes_per_token"] for r in batched}
    assert per_token["dense"] == per_token["streamingllm"] == 0.0
    kv_bytes = cfg.num_kv_heads * cfg.head_dim * 4  # one token's K, float32, all KV heads
    assert metadata_bytes_per_token(get_selector("oracle"), cfg) == kv_bytes  # Oracle reads K itself
    # int8 min + max per 2-token page: head_dim bytes per token and KV head (+ the grid); N_cap travels
    # in the shape of an empty [B, N_cap, 0] leaf (0 bytes; it was 1 B per token before issue 23's fix).
    assert per_token["quest"] == pytest.approx(cfg.num_kv_heads * cfg.head_dim * (1 + 4 / 1024))
    assert {s["selector"]: s["metadata_bytes_per_token"] for s in summarize(batched)} == per_token
