"""LSTF variants and instrumented policies the CALVO experiments compare (no model, no timing).

`experiments/calvo_lstf_variants.py` A/Bs the LSTF variants below against EDF on the simulator
(docs/calvo.md "LSTF vs EDF"); `experiments/calvo.py` wraps each run's policy in
`recording_demotions` to count how often the cost model demotes a request that then meets its
deadline anyway. They live in the package (not in the scripts) so tests can pin their keys
without importing `experiments`.

    lstf-margin   demote only if the request misses even with `margin` less work than modelled
    lstf-freeze   once a request's first chunk is in L1 its key is frozen (MLLF-style)
    lstf-mono     once started, a request's slack may fall but never rise (hysteresis)
"""
from __future__ import annotations

import dataclasses

from jkv.scheduling.policies import Policy, make_policy

VARIANTS = ("edf", "lstf-static", "lstf", "lstf-reeval", "lstf-margin", "lstf-freeze",
            "lstf-mono")


def margin_lstf(cost_model, margin: float) -> Policy:
    """Hopeless only if deadline - now < (1 - margin) * modelled remaining work."""
    def key(r, remaining_load_tokens, now):
        remaining = (cost_model.t_load(remaining_load_tokens)
                     + cost_model.t_comp(r.compute_tokens, r.cached_tokens))
        if r.deadline_s - now < (1.0 - margin) * remaining:
            return (1, remaining, r.arrival_s)
        return (0, r.deadline_s - now - remaining, r.arrival_s)

    base = make_policy("lstf-reeval", cost_model)
    return Policy("lstf-margin", base.key, progress_key=key)


def sticky_lstf(cost_model, mode: str) -> Policy:
    """mode 'freeze': a started request (some prefix chunk in L1) keeps the key it had then;
    'mono': its key may only decrease from then on."""
    base = make_policy("lstf-reeval", cost_model)
    held: dict = {}

    def key(r, remaining_load_tokens, now):
        k = base.progress_key(r, remaining_load_tokens, now)
        if remaining_load_tokens >= r.cached_tokens:        # nothing in L1 yet
            return k
        if r.request_id not in held:
            held[r.request_id] = k
        elif mode == "freeze":
            k = held[r.request_id]
        else:
            k = held[r.request_id] = min(k, held[r.request_id])
        return k

    return Policy(f"lstf-{mode}", base.key, progress_key=key)


def variant_policies(cost_model, margin: float) -> dict[str, Policy]:
    """Every name in VARIANTS -> its policy over `cost_model`."""
    return {"edf": make_policy("edf"),
            "lstf-static": make_policy("lstf-static", cost_model),
            "lstf": make_policy("lstf", cost_model),
            "lstf-reeval": make_policy("lstf-reeval", cost_model),
            "lstf-margin": margin_lstf(cost_model, margin),
            "lstf-freeze": sticky_lstf(cost_model, "freeze"),
            "lstf-mono": sticky_lstf(cost_model, "mono")}


def recording_demotions(policy: Policy, demoted: set) -> Policy:
    """`policy` whose dynamic key also records the ids it ever ranked as hopeless (LSTF's
    key[0] == 1: modelled remaining work exceeds the time left), to measure how often the cost
    model's prediction demotes a request that then meets its deadline anyway."""
    if policy.progress_key is None:
        return policy

    def key(info, remaining_load_tokens, now):
        k = policy.progress_key(info, remaining_load_tokens, now)
        if k[0] == 1:
            demoted.add(info.request_id)
        return k

    return dataclasses.replace(policy, progress_key=key)
