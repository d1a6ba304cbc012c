"""`get_selector(name, **config)`: build a selector by name with its frozen config."""
from __future__ import annotations

import dataclasses

from jkv.selection.base import Selector, SelectorConfig
from jkv.selection.hata import HATA, HATAConfig
from jkv.selection.infinigen import InfiniGen, InfiniGenConfig
from jkv.selection.quest import Quest, QuestConfig
from jkv.selection.simple import Dense, Oracle, OracleConfig, Random, RandomConfig, Sequential, StreamingConfig, StreamingLLM

# name -> (class, config class)
SELECTORS: dict[str, tuple[type[Selector], type[SelectorConfig]]] = {
    "dense": (Dense, SelectorConfig),
    "oracle": (Oracle, OracleConfig),
    "infinigen": (InfiniGen, InfiniGenConfig),
    "quest": (Quest, QuestConfig),
    "hata": (HATA, HATAConfig),
    "streamingllm": (StreamingLLM, StreamingConfig),
    "sequential": (Sequential, SelectorConfig),
    "random": (Random, RandomConfig),
}


def selector_config(name: str, **config) -> SelectorConfig:
    """The validated config of selector `name`; unknown keys name the valid ones."""
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; valid names: {', '.join(sorted(SELECTORS))}")
    config_cls = SELECTORS[name][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for selector {name!r}; valid: {sorted(fields)}")
    return config_cls(**config)


def get_selector(name: str, *, calibration=None, projection=None, skew=None, **config) -> Selector:
    """Build selector `name` (see SELECTORS) from config keywords.

    InfiniGen needs `calibration` (jkv.selection.calibration.Calibration, from
    `collect_calibration(model, ...)`) or a fitted `skew`; HATA needs trained weights
    (`weights_path=DIR` or `projection`).
    """
    cfg = selector_config(name, **config)
    if name == "dense":
        return Dense(dataclasses.replace(cfg, max_ratio=1.0))
    if name == "infinigen":
        if skew is None and calibration is not None:
            return InfiniGen.from_calibration(cfg, calibration)
        return InfiniGen(cfg, skew)
    if name == "hata":
        return HATA(cfg, projection)
    return SELECTORS[name][0](cfg)
