"""Request-ordering policies for the loading pipeline (CALVO §3.2, §4.3).

A policy maps a request's static description to a priority key; smaller keys are served first
by every stage's dispatcher, ties broken by submission order. Keys are computed once at
admission (the paper computes LST "for each incoming request"), so dispatch never re-sorts.

    fifo    arrival time                                 (vLLM default)
    sjf-pt  prefill (uncached) tokens only               (PrefillOnly-style, blind to loading)
    sjf     modelled cost T_load + T_comp                (minimises mean TTFT, §3.2 (1))
    edf     deadline                                     (static, cost-blind)
    lstf    slack = deadline - T_load - T_comp           (maximises SLO attainment, §3.2 (2))
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable

from jkv.scheduling.cost_model import CostModel


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """What scheduling knows about a request.

    cached_tokens: prompt tokens whose KV is loaded from the pool (longest prefix match).
    compute_tokens: prompt tokens prefilled on the device (the uncached suffix).
    deadline_s: absolute TTFT deadline on the same clock as arrival_s (inf: none).
    """

    request_id: Hashable
    arrival_s: float
    cached_tokens: int
    compute_tokens: int
    deadline_s: float = math.inf

    def __post_init__(self):
        if self.cached_tokens < 0 or self.compute_tokens < 0:
            raise ValueError(f"{self.cached_tokens=} and {self.compute_tokens=} must be >= 0")
        if math.isnan(self.arrival_s) or math.isnan(self.deadline_s):
            raise ValueError(f"{self.arrival_s=} and {self.deadline_s=} must not be NaN")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named priority function: `key(info)` -> tuple, smaller first."""

    name: str
    key: Callable[[RequestInfo], tuple]


def _needs_cost_model(name: str, cost_model: CostModel | None) -> CostModel:
    if cost_model is None:
        raise ValueError(f"policy {name!r} orders by modelled cost; pass cost_model= "
                         "(CostModel.fit from profiling, or CostModel.load(path))")
    return cost_model


def fifo() -> Policy:
    return Policy("fifo", lambda r: (r.arrival_s,))


def sjf_pt() -> Policy:
    return Policy("sjf-pt", lambda r: (r.compute_tokens, r.arrival_s))


def sjf(cost_model: CostModel) -> Policy:
    return Policy("sjf", lambda r: (cost_model.cost(r.cached_tokens, r.compute_tokens),
                                    r.arrival_s))


def edf() -> Policy:
    return Policy("edf", lambda r: (r.deadline_s, r.arrival_s))


def lstf(cost_model: CostModel) -> Policy:
    # CALVO §3.2: LST = DDL - T_load - T_comp. "now" is common to all requests, so ordering by
    # this static value equals ordering by the remaining slack at any instant.
    return Policy("lstf", lambda r: (r.deadline_s - cost_model.cost(r.cached_tokens,
                                                                     r.compute_tokens),
                                     r.arrival_s))


POLICY_NAMES = ("fifo", "sjf-pt", "sjf", "edf", "lstf")


def make_policy(name: str, cost_model: CostModel | None = None) -> Policy:
    """The policy called `name` (one of POLICY_NAMES); sjf and lstf need a cost model."""
    key = name.strip().lower().replace("_", "-")
    if key == "fifo":
        return fifo()
    if key == "sjf-pt":
        return sjf_pt()
    if key == "sjf":
        return sjf(_needs_cost_model(key, cost_model))
    if key == "edf":
        return edf()
    if key == "lstf":
        return lstf(_needs_cost_model(key, cost_model))
    raise ValueError(f"unknown scheduling policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
