"""Bad model input gives clear errors naming the problem, not a stack trace from a library."""
import json

import numpy as np
import pytest

from models import ModelLoadError, load_model, resolve_model_path
from models.config import ModelConfig


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        resolve_model_path("no-such-model-xyz")


def test_truncated_gguf_is_rejected_clearly(tmp_path):
    src = resolve_model_path("smollm2-135m-instruct")
    bad = tmp_path / "broken.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # header and part of the metadata only
    with pytest.raises(ModelLoadError, match="broken.gguf.*(truncated|corrupt)"):
        load_model(bad, use_cache=False)


def test_garbage_gguf_is_rejected_clearly(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        load_model(bad, use_cache=False)


def _tiny_hf_config(tmp_path):
    cfg = dict(model_type="llama", vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_corrupt_safetensors_is_rejected_clearly(tmp_path):
    _tiny_hf_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ModelLoadError, match="model.safetensors.*(truncated|corrupt)"):
        load_model(tmp_path, use_cache=False)


def test_incomplete_checkpoint_names_missing_weights(tmp_path):
    from safetensors.numpy import save_file

    _tiny_hf_config(tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((50, 16), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing weights"):
        load_model(tmp_path, use_cache=False)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2'.*not supported"):
        load_model(tmp_path, use_cache=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(tmp_path, use_cache=False)


@pytest.mark.parametrize("field,value", [("num_heads", 5), ("head_dim", 7), ("family", "gpt2"), ("dtype", "int8")])
def test_config_validation_names_field(field, value):
    base = dict(family="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=4)
    base[field] = value
    with pytest.raises(ValueError, match=field):
        ModelConfig(**base)
