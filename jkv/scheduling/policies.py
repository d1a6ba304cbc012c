"""Request-ordering policies for the loading pipeline (CALVO §3.2, §4.3).

A policy maps a request's static description to a priority key; smaller keys are served first
by every stage's dispatcher, ties broken by submission order. Keys are computed once at
admission (the paper computes LST "for each incoming request"), so dispatch never re-sorts.

    fifo    arrival time                                 (vLLM default)
    sjf-pt  prefill (uncached) tokens only               (PrefillOnly-style, blind to loading)
    sjf     modelled cost T_load + T_comp                (minimises mean TTFT, §3.2 (1))
    srpt    the same modelled cost, *remaining*: T_load(prefix tokens not yet in L1) + T_comp,
            re-evaluated at every dispatch (shortest remaining processing time). A request's
            own loading progress only lowers its key, so a partly loaded request keeps its
            place (no interleaved loads), and among requests whose prefix is in L1 the compute
            stage goes by T_comp alone, the order that stage's queue needs
    edf     deadline                                     (static, cost-blind)
    lstf    orders by LST = deadline - T_load - T_comp fixed at admission (§3.2 (2): computed
            "for each incoming request"); at every dispatch a request that can no longer meet
            its deadline even if served now (deadline - now - T_load_remaining - T_comp < 0)
            goes behind every feasible one (shortest remaining cost first among them), so one
            late request does not make the ones behind it late too (the EDF/LSTF domino effect
            under overload)
    lstf-reeval  the same demotion, but feasible requests ordered by the slack re-evaluated at
            every dispatch (deadline - now - T_load_remaining - T_comp): jkv's earlier `lstf`.
            A request's own loading progress raises its slack, so requests of similar slack
            overtake one another chunk by chunk (laxity-tie thrashing): their loads interleave,
            neither computes until both are nearly loaded, and the fetch/compute overlap is
            lost (docs/calvo.md "LSTF vs EDF")
    lstf-static  slack = deadline - T_load - T_comp fixed at admission, no demotion (the
            paper's key alone; the A/B reference)

Dynamic keys: a policy may carry `progress_key(info, remaining_load_tokens, now)`; the pipeline
core then re-sorts by it whenever a dispatcher picks (`now` on the requests' clock).
"""
from __future__ import annotations

import dataclasses
import functools
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
    progress_key: Callable[[RequestInfo, float, float], tuple] | None = None


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


def _remaining_cost(cost_model: CostModel) -> Callable[[RequestInfo, float], float]:
    """(info, prefix tokens not yet in L1) -> T_load(those tokens) + T_comp, in modelled seconds.

    Dynamic keys run this for every queued request at every dispatch, under the pipeline's lock
    and the GIL: T_comp (fixed per request) is computed once and cached, T_load takes the cost
    model's scalar path. (Through numpy each key cost ~13 us; with 60 queued requests the
    pipeline spent 10x EDF's CPU dispatching, CPU the fetch and compute stages needed.)"""
    t_load = cost_model.t_load
    t_comp = functools.lru_cache(maxsize=1 << 16)(
        lambda r: float(cost_model.t_comp(r.compute_tokens, r.cached_tokens)))
    return lambda r, remaining_load_tokens: t_load(remaining_load_tokens) + t_comp(r)


def srpt(cost_model: CostModel) -> Policy:
    """SJF on the remaining modelled cost (see the module docstring)."""
    remaining = _remaining_cost(cost_model)

    def key(r: RequestInfo, remaining_load_tokens: float, now: float) -> tuple:
        return (remaining(r, remaining_load_tokens), r.arrival_s)

    return Policy("srpt", lambda r: (cost_model.cost(r.cached_tokens, r.compute_tokens),
                                     r.arrival_s), progress_key=key)


def edf() -> Policy:
    return Policy("edf", lambda r: (r.deadline_s, r.arrival_s))


def _lstf(name: str, cost_model: CostModel, reevaluate: bool) -> Policy:
    """`lstf` / `lstf-reeval`: both demote a request that can no longer meet its deadline even if
    served now (deadline - now - T_load_remaining - T_comp < 0) behind every feasible one
    (shortest remaining cost first among them); feasible requests go by the admission-time
    LST (CALVO §3.2 (2)) or, with `reevaluate`, by that slack re-evaluated now. The admission
    LST is cached per request, like T_comp (`_remaining_cost`)."""
    remaining_cost = _remaining_cost(cost_model)
    admission = functools.lru_cache(maxsize=1 << 16)(
        lambda r: r.deadline_s - remaining_cost(r, float(r.cached_tokens)))

    def key(r: RequestInfo, remaining_load_tokens: float, now: float) -> tuple:
        remaining = remaining_cost(r, remaining_load_tokens)
        lst = r.deadline_s - now - remaining
        if lst < 0:                      # already hopeless: after every feasible request
            return (1, remaining, r.arrival_s)
        return (0, lst if reevaluate else admission(r), r.arrival_s)

    return Policy(name, lambda r: (0, admission(r), r.arrival_s), progress_key=key)


def lstf(cost_model: CostModel) -> Policy:
    """Admission-time LST plus the dispatch-time demotion of hopeless requests."""
    return _lstf("lstf", cost_model, reevaluate=False)


def lstf_reeval(cost_model: CostModel) -> Policy:
    """LSTF with the slack re-evaluated at every dispatch (jkv's earlier `lstf`; thrashes)."""
    return _lstf("lstf-reeval", cost_model, reevaluate=True)


def lstf_static(cost_model: CostModel) -> Policy:
    """LSTF with the slack fixed at admission (whole T_load), never re-evaluated."""
    return Policy("lstf-static", lambda r: (r.deadline_s - cost_model.cost(r.cached_tokens,
                                                                            r.compute_tokens),
                                            r.arrival_s))


POLICY_NAMES = ("fifo", "sjf-pt", "sjf", "srpt", "edf", "lstf", "lstf-reeval", "lstf-static")
_COST_BLIND = {"fifo": fifo, "sjf-pt": sjf_pt, "edf": edf}
_COST_AWARE = {"sjf": sjf, "srpt": srpt, "lstf": lstf, "lstf-reeval": lstf_reeval,
               "lstf-static": lstf_static}
assert set(_COST_BLIND) | set(_COST_AWARE) == set(POLICY_NAMES)


def make_policy(name: str, cost_model: CostModel | None = None) -> Policy:
    """The policy called `name` (one of POLICY_NAMES); sjf, srpt and the lstf variants need a cost model."""
    key = name.strip().lower().replace("_", "-")
    if key in _COST_BLIND:
        return _COST_BLIND[key]()
    if key in _COST_AWARE:
        return _COST_AWARE[key](_needs_cost_model(key, cost_model))
    raise ValueError(f"unknown scheduling policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
