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


def _write(path, hf, qtype):
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
