"""CLI behaviour on tiny HF checkpoints: compare exit codes, user errors exit 2 with one line."""
import pytest

torch = pytest.importorskip("torch", reason="needs the compare extra (torch)")
transformers = pytest.importorskip("transformers", reason="needs the compare extra (transformers)")

from jkv.cli import main  # noqa: E402


def _train_tokenizer(path, vocab_size):
    """A real byte-level BPE tokenizer.json trained on a few sentences (deterministic)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"}))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   eos_token_id=1, bos_token_id=0)
    d = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    _train_tokenizer(d, 300)
    return d


def test_compare_passes_and_fails_by_tolerance(tiny_dir, capsys):
    args = ["compare", "--model", str(tiny_dir), "--greedy-tokens", "4"]
    assert main(args) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(args + ["--max-abs-logit-diff", "0"]) == 1
    assert "FAIL: max |Δlogit|" in capsys.readouterr().out


def test_generate_cli_on_hf_dir_with_chat_template(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "the fox", "--chat", "--max-tokens", "3",
                 "--json"]) == 0
    import json

    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["prompt_tokens"] > 3 and len(rec["token_ids"]) <= 3


def test_unknown_model_exits_2_with_known_names(capsys):
    assert main(["generate", "--model", "nope", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "smollm2-135m-instruct" in err


def test_invalid_sampling_flag_exits_2(capsys):
    assert main(["generate", "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["eval", "train-hata"])
def test_selection_commands_are_wired_and_report_bad_models(cmd, capsys, tmp_path):
    args = [cmd, "--model", "no-such-model"] + (["--out", str(tmp_path)] if cmd == "train-hata" else [])
    assert main(args) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
