"""Build the serving selector once and ship it to worker processes.

Prefill and decode must use the *same* selector (the prefill side prepares its metadata, the
decode side selects with it), so the decode side builds it — fitting InfiniGen's skew on
calibration tokens kept apart from evaluation prompts — and saves it to a file every prefill
worker loads.
"""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from jkv.selection.registry import SELECTORS, get_selector, selector_config

CALIBRATION_PROMPT = 256
CALIBRATION_STEPS = 32


def calibration_ids(model, num_tokens: int, seed: int = 1234) -> list[int]:
    """Calibration tokens: the documentation corpus' calibration split for real models, seeded
    random ids for tokenizer-less test models (never the evaluation prompts)."""
    if model.tokenizer is not None:
        from jkv.selection.calibration import calibration_tokens
        return calibration_tokens(model, num_tokens)
    return np.random.default_rng(seed).integers(3, model.cfg.vocab_size, num_tokens).tolist()


def build_selector(model, name: str, **options):
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; valid names: {', '.join(sorted(SELECTORS))}")
    if name == "infinigen" and "skew" not in options:
        from jkv.selection.calibration import collect_calibration
        ids = calibration_ids(model, CALIBRATION_PROMPT + CALIBRATION_STEPS)
        calibration = collect_calibration(model, ids, CALIBRATION_PROMPT, CALIBRATION_STEPS)
        return get_selector(name, calibration=calibration, **options)
    return get_selector(name, **options)


def save_selector(selector, path) -> None:
    """Pickles what a prefill worker needs to rebuild `selector`: its config plus InfiniGen's
    skew or HATA's trained hash projection (f32[L, H_kv, D, bits]), so no worker needs the
    weights directory of the process that trained them."""
    state = dict(name=selector.name, config=dataclasses.asdict(selector.config),
                 skew=[np.asarray(s) for s in selector.skew] if hasattr(selector, "skew") else None,
                 projection=np.asarray(selector.projection) if selector.name == "hata" else None)
    with open(path, "wb") as f:
        pickle.dump(state, f)


def load_selector(path):
    with open(path, "rb") as f:
        state = pickle.load(f)
    config = dict(state["config"])
    if state["skew"] is not None:
        return get_selector(state["name"], skew=state["skew"], **config)
    if state.get("projection") is not None:  # HATA: the shipped weights, not a local weights_path
        config.pop("weights_path", None)
        return get_selector(state["name"], projection=state["projection"], **config)
    if state["name"] == "dense":
        config.pop("max_ratio", None)
    return get_selector(state["name"], **config)


def needs_metadata(selector) -> bool:
    """Whether the prefill side must ship metadata (length-only selectors rebuild it locally)."""
    return selector.ships_metadata


__all__ = ["build_selector", "save_selector", "load_selector", "needs_metadata", "selector_config"]
