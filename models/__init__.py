"""Flax Llama / Qwen2 / Qwen3 models, weight loading (safetensors, GGUF) and tokenizers."""
from .config import ModelConfig, RopeScaling
from .loader import DEFAULT_MODEL, known_models, load_model, load_model_spec, resolve_model_path
from .model import Model, tiny_config, tiny_model
from .tokenizer import Tokenizer
from .weights import ModelLoadError

__all__ = ["DEFAULT_MODEL", "Model", "ModelConfig", "ModelLoadError", "RopeScaling", "Tokenizer",
           "known_models", "load_model", "load_model_spec", "resolve_model_path", "tiny_config", "tiny_model"]
