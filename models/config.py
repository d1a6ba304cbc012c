"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 families.

The three families share one decoder architecture (pre-norm, RoPE, GQA, SwiGLU MLP) and differ
only by flags, so there is one config type and one model implementation:

- llama  (Llama-3.x, SmolLM2): optional `llama3` RoPE frequency scaling; `attention_bias` puts a
                               bias on q/k/v AND o_proj, `mlp_bias` on gate/up/down (as transformers).
- qwen2  (Qwen2 / Qwen2.5):   bias on the q/k/v projections (never o_proj or the MLP).
- qwen3  (Qwen3):             RMSNorm over head_dim applied to q and k (per head) before RoPE;
                               `attention_bias` biases q/k/v and o_proj; never the MLP.

Every bias the reference (transformers) applies is applied here: `qkv_bias`, `o_bias`, `mlp_bias`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"invalid llama3 rope scaling {self}: need factor > 0 and "
                "high_freq_factor > low_freq_factor > 0"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # bias on o_proj (Llama / Qwen3 attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"{self.family=} is not supported; known families: {', '.join(FAMILIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.dtype=} is not supported; use one of {', '.join(DTYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict, dtype: str = "float32") -> "ModelConfig":
        """Build from a Hugging Face `config.json` (a path to it, its directory, or the parsed dict)."""
        if isinstance(path_or_dict, dict):
            hf = path_or_dict
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            try:
                hf = json.loads(p.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"no config.json at {p}: a Hugging Face model directory needs one") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{p} is not valid JSON ({e}); re-download or re-save the model") from None
        model_type = hf.get("model_type", "")
        family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if family is None:
            raise ValueError(
                f"model_type={model_type!r} in config.json is not supported; jkv runs {', '.join(FAMILIES)}"
            )
        if hf.get("use_sliding_window"):
            raise ValueError("config.json enables use_sliding_window, which jkv does not implement")
        # transformers >= 5 writes rope settings under `rope_parameters`; older versions use
        # `rope_theta` + `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
        scaling_src = rope if rope.get("rope_type") else legacy
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling_src["factor"]),
                low_freq_factor=float(scaling_src["low_freq_factor"]),
                high_freq_factor=float(scaling_src["high_freq_factor"]),
                original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported; jkv supports 'default' and 'llama3'")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        # transformers: Qwen2 always biases q/k/v and never o_proj; Llama and Qwen3 bias q/k/v/o when
        # attention_bias is set; only Llama reads mlp_bias (Qwen2/Qwen3 MLPs have no bias).
        attention_bias = bool(hf.get("attention_bias", False)) and family != "qwen2"
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=family == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
        )


def llama3_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None):
    """RoPE inverse frequencies [head_dim/2] as python floats, with optional llama3 scaling."""
    inv = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    if scaling is None:
        return inv
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / scaling.factor)
        else:
            smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
            out.append((1 - smooth) * f / scaling.factor + smooth * f)
    return out
