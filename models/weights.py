"""Weight loading: Hugging Face safetensors directories and single GGUF files -> jkv params.

Both paths produce the params tree documented in `models/transformer.py`. Corrupt or truncated
files raise `ModelLoadError` naming the file and what to do, never a stack trace from inside
`gguf` / `safetensors`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model file is missing, corrupt, truncated or of an unsupported kind."""


# HF tensor name (per layer, after `model.layers.{i}.`) -> (linen module, param, transpose?)
_HF_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm", "scale", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm", "scale", False),
    "self_attn.q_proj.weight": ("q_proj", "kernel", True),
    "self_attn.k_proj.weight": ("k_proj", "kernel", True),
    "self_attn.v_proj.weight": ("v_proj", "kernel", True),
    "self_attn.o_proj.weight": ("o_proj", "kernel", True),
    "self_attn.q_proj.bias": ("q_proj", "bias", False),
    "self_attn.k_proj.bias": ("k_proj", "bias", False),
    "self_attn.v_proj.bias": ("v_proj", "bias", False),
    "self_attn.o_proj.bias": ("o_proj", "bias", False),
    "self_attn.q_norm.weight": ("q_norm", "scale", False),
    "self_attn.k_norm.weight": ("k_norm", "scale", False),
    "mlp.gate_proj.weight": ("gate_proj", "kernel", True),
    "mlp.up_proj.weight": ("up_proj", "kernel", True),
    "mlp.down_proj.weight": ("down_proj", "kernel", True),
    "mlp.gate_proj.bias": ("gate_proj", "bias", False),
    "mlp.up_proj.bias": ("up_proj", "bias", False),
    "mlp.down_proj.bias": ("down_proj", "bias", False),
}

# Tensors a checkpoint may carry that do not change the math: RoPE inverse-frequency buffers
# (older transformers saved them; jkv computes the same frequencies from the config). Loading
# skips them with a warning; any other tensor jkv does not map is an error naming it, since
# dropping a weight the model uses silently changes its outputs (issue 23: a dropped o_proj bias).
HARMLESS_EXTRA_SUFFIXES = ("rotary_emb.inv_freq",)

# (config flag, modules whose bias it switches on)
_BIAS_FLAGS = (("qkv_bias", ("q_proj", "k_proj", "v_proj")), ("o_bias", ("o_proj",)),
               ("mlp_bias", ("gate_proj", "up_proj", "down_proj")))

# GGUF tensor name (after `blk.{i}.`) -> HF name (after `model.layers.{i}.`)
_GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


def _hf_name(module: str, pname: str) -> str:
    """The HF per-layer tensor name of a jkv (module, param) (inverse of _HF_LAYER_MAP)."""
    return next(k for k, (m, p, _) in _HF_LAYER_MAP.items() if (m, p) == (module, pname))


def _np_dtype(dtype: str):
    import ml_dtypes  # shipped with jax

    return {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]


def params_from_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """Map HF-named fp32 numpy tensors to the jkv params tree (numpy, cfg.dtype)."""
    dt = _np_dtype(cfg.dtype)
    conv = lambda a, t=False: np.ascontiguousarray((a.T if t else a).astype(dt))
    layers = [dict() for _ in range(cfg.num_layers)]
    unknown, harmless = [], []
    params: dict = {}
    for name, a in tensors.items():
        if name.endswith(HARMLESS_EXTRA_SUFFIXES):
            harmless.append(name)
        elif name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, sub = rest.partition(".")
            if sub not in _HF_LAYER_MAP or not idx.isdigit() or int(idx) >= cfg.num_layers:
                unknown.append(name)
                continue
            module, pname, transpose = _HF_LAYER_MAP[sub]
            layers[int(idx)].setdefault(module, {})[pname] = conv(a, transpose)
        elif name == "model.embed_tokens.weight":
            params["embed_tokens"] = {"embedding": conv(a)}
        elif name == "model.norm.weight":
            params["norm"] = {"scale": conv(a)}
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:  # tied: the reference uses the embedding, as jkv does
                params["lm_head"] = {"kernel": conv(a, True)}
        else:
            unknown.append(name)
    if unknown:
        raise ModelLoadError(f"checkpoint has {len(unknown)} tensor(s) jkv does not know, e.g. {sorted(unknown)[:5]}; "
                             f"ignoring them would change the model's outputs. jkv runs {cfg.family} layers "
                             f"0..{cfg.num_layers - 1} with the tensors of models/weights.py's maps; check that "
                             "config.json matches the checkpoint (num_hidden_layers, attention_bias, mlp_bias)")
    if harmless:
        log.warning("skipped %d tensor(s) that do not change the math (RoPE frequencies jkv computes itself): %s",
                    len(harmless), sorted(harmless)[:3])
    expected = {"input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
                "gate_proj", "up_proj", "down_proj"} | ({"q_norm", "k_norm"} if cfg.qk_norm else set())
    for i, layer in enumerate(layers):
        missing = expected - set(layer)
        if missing:
            raise ModelLoadError(f"layer {i} is missing weights for {sorted(missing)}; the checkpoint is incomplete")
        for flag, modules in _BIAS_FLAGS:
            have = [m for m in modules if "bias" in layer[m]]
            if getattr(cfg, flag) and len(have) < len(modules):
                raise ModelLoadError(f"layer {i}: the config sets {flag} (biases on {list(modules)}) but the "
                                     f"checkpoint has no bias for {sorted(set(modules) - set(have))}; it is "
                                     "incomplete or config.json's attention_bias / mlp_bias is wrong")
            if have and not getattr(cfg, flag):
                raise ModelLoadError(f"layer {i}: the checkpoint has biases for {have} "
                                     f"(e.g. model.layers.{i}.{_hf_name(have[0], 'bias')}) but the config does "
                                     f"not enable them ({flag}=False; config.json attention_bias / mlp_bias), so "
                                     "they would be dropped and the outputs change; fix config.json")
    for key in ("embed_tokens", "norm") + (() if cfg.tie_word_embeddings else ("lm_head",)):
        if key not in params:
            raise ModelLoadError(f"checkpoint has no {key} weights; it is incomplete")
    params["layers"] = layers
    return params


def load_hf_dir(path: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Load config.json + (sharded) *.safetensors + tokenizer.json from a Hugging Face directory."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg = ModelConfig.from_hf(path, dtype=dtype)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed ({e}); re-download the model") from None
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {path}; jkv loads safetensors checkpoints only")
    tensors: dict[str, np.ndarray] = {}
    for fname in files:
        fpath = path / fname
        try:
            # The flax framework reads bf16 too; convert each tensor to fp32 numpy once.
            with safe_open(str(fpath), framework="flax") as f:
                for name in f.keys():
                    tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{fpath} is not a readable safetensors file ({e}); it may be truncated or "
                                 "corrupt — re-download it") from None
    tok = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    return cfg, params_from_hf_tensors(cfg, tensors), tok


def _gguf_fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # fields with exotic types we never read
            continue
    return out


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows (interleaved -> HF rotate-half layout)."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf_fields(fields: dict, tensor_names: set[str], dtype: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(arch)
    if family is None:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; jkv runs llama, qwen2, qwen3")
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)
    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("this GGUF stores llama3 rope frequency factors, which jkv does not read from GGUF; "
                             "load the model's Hugging Face directory instead")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    vocab = g("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        family=family, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=n_heads, num_kv_heads=int(g("attention.head_count_kv", n_heads)), head_dim=head_dim,
        rope_theta=float(g("rope.freq_base", 10000.0)), rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names, o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names, qk_norm=family == "qwen3",
        max_position_embeddings=int(g("context_length", 8192)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (), dtype=dtype,
    )


def load_gguf(path: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Load a single GGUF file: dequantize (F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants via `gguf`) to cfg.dtype."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
        fields = _gguf_fields(reader)
        tensors_info = list(reader.tensors)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(f"{path} is not a valid GGUF file ({type(e).__name__}: {e}); it may be truncated or "
                             "corrupt — re-download it") from None
    names = {t.name for t in tensors_info}
    cfg = config_from_gguf_fields(fields, names, dtype)
    permute = fields.get("general.architecture") == "llama"
    hf: dict[str, np.ndarray] = {}
    for t in tensors_info:
        try:
            a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise ModelLoadError(f"tensor {t.name} uses quantization {t.tensor_type.name}, which the gguf "
                                 "package cannot dequantize") from None
        except Exception as e:
            raise ModelLoadError(f"tensor {t.name} in {path} could not be read ({e}); the file may be truncated") from None
        if t.name == "token_embd.weight":
            hf["model.embed_tokens.weight"] = a
        elif t.name == "output_norm.weight":
            hf["model.norm.weight"] = a
        elif t.name == "output.weight":
            hf["lm_head.weight"] = a
        elif t.name.startswith("blk.") and t.name.count(".") >= 2 and t.name.split(".", 2)[2] in _GGUF_LAYER_MAP:
            _, idx, sub = t.name.split(".", 2)
            if permute and sub in ("attn_q.weight", "attn_q.bias"):
                a = _unpermute_rope_rows(a, cfg.num_heads)
            elif permute and sub in ("attn_k.weight", "attn_k.bias"):
                a = _unpermute_rope_rows(a, cfg.num_kv_heads)
            hf[f"model.layers.{idx}.{_GGUF_LAYER_MAP[sub]}"] = a
        else:  # the HF-name check below refuses it, naming the GGUF tensor
            hf[f"gguf:{t.name}"] = a
    tok = Tokenizer.from_gguf_fields(fields) if "tokenizer.ggml.model" in fields else None
    if tok is None:
        log.warning("%s has no tokenizer metadata; the model accepts token ids only", path)
    return cfg, params_from_hf_tensors(cfg, hf), tok
