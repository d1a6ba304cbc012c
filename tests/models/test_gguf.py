"""GGUF loading: a tiny Llama written with gguf's own writer in F32/F16/BF16/Q8_0/Q4_0/Q4_1 (Q/K rows
permuted the way llama.cpp's converter does) loads in jkv and matches transformers running the
same dequantized weights."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch", reason="needs the compare extra (torch)")
transformers = pytest.importorskip("transformers", reason="needs the compare extra (transformers)")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from models import load_model  # noqa: E402

N_HEAD, N_KV = 4, 2


def _llamacpp_permute(w, n_head):
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, hf, qtype, extra=()):
    """extra: (gguf name, f32 array) tensors to add unmapped."""
    cfg = hf.config
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    dequantized = {}

    def put(name, hf_name, a, quantize=True, permute_heads=None):
        t = qtype if quantize else Q.F32
        q = gguf.quants.quantize(a, t)
        deq = gguf.quants.dequantize(q, t).reshape(a.shape)
        dequantized[hf_name] = deq
        if permute_heads:
            q = gguf.quants.quantize(_llamacpp_permute(a, permute_heads), t)
        w.add_tensor(name, q, raw_dtype=t)

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], quantize=False)
    put("output.weight", "lm_head.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", sd[p + "input_layernorm.weight"], False)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight",
            sd[p + "post_attention_layernorm.weight"], False)
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", sd[p + "self_attn.q_proj.weight"], True, N_HEAD)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", sd[p + "self_attn.k_proj.weight"], True, N_KV)
        for g, h in [("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                     ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            put(f"blk.{i}.{g}.weight", p + h + ".weight", sd[p + h + ".weight"])
        # biases (attention_bias / mlp_bias): F32, q/k rows permuted like their weights
        for g, h, heads in [("attn_q", "self_attn.q_proj", N_HEAD), ("attn_k", "self_attn.k_proj", N_KV),
                            ("attn_v", "self_attn.v_proj", None), ("attn_output", "self_attn.o_proj", None),
                            ("ffn_gate", "mlp.gate_proj", None), ("ffn_up", "mlp.up_proj", None),
                            ("ffn_down", "mlp.down_proj", None)]:
            if p + h + ".bias" in sd:
                put(f"blk.{i}.{g}.bias", p + h + ".bias", sd[p + h + ".bias"], False, heads)
    for name, a in extra:
        w.add_tensor(name, a.astype(np.float32), raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dequantized


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_quant_types_match_transformers_on_dequantized_weights(tmp_path, hf_model, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    deq = _write(path, hf_model, qtype)
    ref = transformers.LlamaForCausalLM(hf_model.config).eval()
    ref.load_state_dict({k: torch.tensor(v) for k, v in deq.items()}, strict=False)
    m = load_model(path, use_cache=False)
    assert m.tokenizer is None and m.cfg.num_kv_heads == N_KV and not m.cfg.tie_word_embeddings
    tokens = np.array([[3, 17, 99, 5, 42, 8, 150, 1, 77]], np.int32)
    ours, _ = m.prefill(tokens, np.array([9]), all_logits=True)
    with torch.no_grad():
        theirs = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    scale = np.abs(theirs).max()
    assert np.abs(np.asarray(ours) - theirs).max() <= 1e-4 * scale


@pytest.fixture(scope="module")
def hf_biased():
    """Llama with attention_bias (q/k/v AND o_proj) and mlp_bias, the biases randomised."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=128,
                                   tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, prm in hf.named_parameters():
            if n.endswith("bias"):
                prm.add_(0.5 * torch.randn_like(prm))
    return hf


def test_gguf_attn_output_and_ffn_biases_are_applied(tmp_path, hf_biased):
    """Issue 23 defect 8: attn_output.bias and ffn_*.bias were dropped silently."""
    path = tmp_path / "tiny-bias.gguf"
    deq = _write(path, hf_biased, Q.F32)
    assert "model.layers.0.self_attn.o_proj.bias" in deq and "model.layers.1.mlp.down_proj.bias" in deq
    m = load_model(path, use_cache=False)
    assert m.cfg.qkv_bias and m.cfg.o_bias and m.cfg.mlp_bias
    tokens = np.array([[3, 17, 99, 5, 42, 8, 150, 1, 77]], np.int32)
    ours, _ = m.prefill(tokens, np.array([9]), all_logits=True)
    with torch.no_grad():
        theirs = hf_biased(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(ours) - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_gguf_unknown_layer_tensor_is_an_error_naming_it(tmp_path, hf_model):
    from models import ModelLoadError

    path = tmp_path / "tiny-extra.gguf"
    _write(path, hf_model, Q.F32, extra=[("blk.1.attn_gate.weight", np.ones(64, np.float32))])
    with pytest.raises(ModelLoadError, match=r"blk\.1\.attn_gate\.weight"):
        load_model(path, use_cache=False)
