"""Flax Llama / Qwen2 / Qwen3 models, weight loading (safetensors, GGUF) and tokenizers."""
from .config import ModelConfig, RopeScaling
from .loader import DEFAULT_MODEL, known_models, load_model, load_model_spec, resolve_model_path
from .model import Model, tiny_config, tiny_model
from .sharding import TensorLayout, TensorParallelError, plan_layout
from .tokenizer import Tokenizer
from .weights import ModelLoadError

__all__ = ["DEFAULT_MODEL", "Model", "ModelConfig", "ModelLoadError", "RopeScaling", "TensorLayout",
           "TensorParallelError", "Tokenizer",
           "known_models", "load_model", "load_model_spec", "plan_layout", "resolve_model_path",
           "tiny_config", "tiny_model"]
