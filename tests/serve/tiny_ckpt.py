"""A tiny Hugging Face Llama checkpoint with a real BPE tokenizer, written with numpy (no torch).

Weights are random but *peaked* (embedding std 1, so logit gaps are O(1)): greedy outputs do
not hinge on 1e-7 float noise, so batched and unbatched paths must agree exactly.
"""
import json
from pathlib import Path

import numpy as np

CORPUS = ["the quick brown fox jumps over the lazy dog",
          "a stitch in time saves nine, and the early bird catches the worm",
          "JAX compiles numpy programs for accelerators; tokens flow from prefill to decode"]


def train_tokenizer(path: Path, vocab_size: int):
    """A real byte-level BPE tokenizer.json trained on a few sentences (deterministic); <s>=0, </s>=1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"}))


def write_tiny_llama(path: Path, vocab_size: int = 320, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 96, max_pos: int = 1024, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    d = hidden // heads
    w = lambda *shape, std=0.2: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(vocab_size, hidden, std=1.0),
         "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(hidden, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                  p + "self_attn.q_proj.weight": w(heads * d, hidden),
                  p + "self_attn.k_proj.weight": w(kv_heads * d, hidden),
                  p + "self_attn.v_proj.weight": w(kv_heads * d, hidden),
                  p + "self_attn.o_proj.weight": w(hidden, heads * d),
                  p + "mlp.gate_proj.weight": w(ffn, hidden),
                  p + "mlp.up_proj.weight": w(ffn, hidden),
                  p + "mlp.down_proj.weight": w(hidden, ffn)})
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 0,
        "eos_token_id": 1, "hidden_act": "silu", "torch_dtype": "float32"}))
    train_tokenizer(path, vocab_size)
    return path
