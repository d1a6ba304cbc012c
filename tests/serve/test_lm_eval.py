"""lm-evaluation-harness against `jkv serve`: its `local-completions` model runs a small
generation task and a small log-likelihood task (task YAML over JSONL files written here; no
dataset hub is reachable), and the log-likelihoods it gets match transformers' on the same GGUF
weights within 1e-3 per token, compared on token ids.

Needs the `compare` extra (lm-eval, transformers, torch) and the default model's package."""
import json
import math
import os

import httpx
import numpy as np
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (the compare extra: pip install '.[compare]')")
pytest.importorskip("transformers", reason="needs transformers (the compare extra)")

MODEL = "smollm2-135m-instruct"
# Every request here is under 32 tokens. A server's warm-up compiles a SmolLM2 decode program per
# page-table width up to --max-model-len's (x each row bucket); test servers skip it (JKV_WARMUP=0,
# tests/serve/conftest.py) and compile on first use, but the prefill and decode shapes still follow
# --max-model-len's pool: 128 tokens keeps them small.
MAX_MODEL_LEN = 128
PER_TOKEN_TOL = 1e-3
SENTENCES = [
    "The capital of France is Paris", "Water freezes at zero degrees", "The sun rises in the east",
    "Cats like to chase mice", "A week has seven days", "Bread is made from flour",
    "The opposite of hot is cold", "Birds build their nests in trees", "Ice cream tastes sweet",
    "The moon orbits the earth", "Rain falls from the clouds", "Fish live in the water",
    "A triangle has three sides", "Snow is white and cold", "Bees make honey",
    "The grass is green", "Dogs are loyal animals", "Books are full of words",
    "Trains run on tracks", "The ocean is very deep", "Apples grow on trees",
    "Night follows the day", "Summer is the warmest season", "Music can make people happy",
]
QUESTIONS = [("What is two plus two?", "four"), ("What color is the sky on a clear day?", "blue"),
             ("What animal says moo?", "cow"), ("How many legs does a spider have?", "eight"),
             ("What is the capital of Japan?", "Tokyo"), ("What do bees make?", "honey"),
             ("What is frozen water called?", "ice"), ("Which planet do we live on?", "Earth"),
             ("What is the opposite of up?", "down"), ("How many days are in a week?", "seven"),
             ("What color are bananas?", "yellow"), ("What do cows drink?", "water")]

LL_TASK = """task: jkv_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
GEN_TASK = """task: jkv_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
"""


def write_tasks(root):
    """The two task YAMLs and their JSONL data under `root`; returns the include path."""
    ll_data, gen_data = root / "ll.jsonl", root / "gen.jsonl"
    ll_data.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    gen_data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    (root / "jkv_ll.yaml").write_text(LL_TASK.format(data=ll_data))
    (root / "jkv_gen.yaml").write_text(GEN_TASK.format(data=gen_data))
    return root


def hf_token_logprobs(hf, ids: list[int]) -> np.ndarray:
    """transformers' log p(ids[i] | ids[:i]) for i >= 1: f32[len(ids) - 1]."""
    import torch

    logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return np.array([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])


@pytest.fixture(scope="module")
def starting_server():
    """The server process, started without waiting: its start-up (jax import, SmolLM2 load)
    overlaps the transformers load below. Same flags as test_min_budget_http's single-process server (the
    default --max-slots), so the run's shared XLA cache (tests/conftest.py) serves one's programs
    to the other."""
    s = ServerProcess(["--model", MODEL, "--port", "0", "--max-model-len", str(MAX_MODEL_LEN)], ready_timeout=300,
                      wait=False)
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(starting_server, tmp_path_factory):
    from transformers import AutoTokenizer

    from jkv.compare import load_hf_reference
    from models import resolve_model_path

    src = resolve_model_path(MODEL)
    tok_dir = tmp_path_factory.mktemp("hf-tokenizer")
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(tok_dir))
    return load_hf_reference(MODEL), tok_dir


@pytest.fixture(scope="module")
def model_server(starting_server, hf_model_and_tokenizer):
    return starting_server.wait_ready()


def test_lm_eval_local_completions_runs_and_matches_transformers(model_server, hf_model_and_tokenizer, tmp_path,
                                                                 monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hf, tok_dir = hf_model_and_tokenizer
    model_args = dict(model=MODEL, base_url=model_server.url + "/v1/completions", tokenizer_backend="huggingface",
                      tokenizer=str(tok_dir), tokenized_requests=True, num_concurrent=4, max_retries=1,
                      max_length=MAX_MODEL_LEN)
    out = simple_evaluate(model="local-completions", model_args=model_args, tasks=["jkv_ll", "jkv_gen"],
                          task_manager=TaskManager(include_path=str(write_tasks(tmp_path))), log_samples=True,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    results, samples = out["results"], out["samples"]
    assert len(samples["jkv_ll"]) == len(SENTENCES) and len(samples["jkv_gen"]) == len(QUESTIONS)
    assert math.isfinite(results["jkv_ll"]["perplexity,none"]) and "exact_match,none" in results["jkv_gen"]
    generated = [s["resps"][0][0] for s in samples["jkv_gen"]]
    assert sum(bool(g.strip()) for g in generated) >= len(QUESTIONS) // 2, generated

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for s in samples["jkv_ll"]:
        context, continuation = s["arguments"][0]
        ctx_ids = tok(context, add_special_tokens=False)["input_ids"]
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        assert whole[:len(ctx_ids)] == ctx_ids, (context, continuation)
        n_cont = len(whole) - len(ctx_ids)
        ref = hf_token_logprobs(hf, whole)
        ll, _greedy = s["resps"][0][0]
        assert abs(ll - ref[-n_cont:].sum()) <= PER_TOKEN_TOL * n_cont, (context, continuation, ll, ref[-n_cont:])
        # per token, on the same ids: the echo + logprobs request lm-eval sends
        r = httpx.post(model_server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0})
        got = np.array(r.json()["choices"][0]["logprobs"]["token_logprobs"][1:], np.float64)
        np.testing.assert_allclose(got, ref, atol=PER_TOKEN_TOL, err_msg=context + continuation)
