"""`decode_program.programs_for` caches a decode worker's compiled layer programs by the selector's
value (`Selector.program_key`: class, config, fitted state), not by the object: every
`LLM(disaggregation=...)` builds its selector anew, and keyed by identity each one traced and
compiled its programs again. Selectors that compute differently must never share programs. (That
a worker with an equal selector also steps without compiling: test_smartgen_compiles.py.)"""
import numpy as np
import pytest

from jkv.disagg import decode_program
from jkv.selection.registry import get_selector
from models.model import tiny_config
from pallas_kernels import dispatch

CFG = tiny_config("qwen2")


def programs(selector):
    return decode_program.programs_for(CFG, selector)


@pytest.mark.parametrize("options", [dict(), dict(max_ratio=0.3), dict(group_score="sum"), dict(min_budget=8)])
def test_two_equal_selectors_share_programs(options):
    first, second = get_selector("oracle", **options), get_selector("oracle", **options)
    assert first is not second and programs(first) is programs(second)


def test_selectors_that_compute_differently_never_share_programs():
    base = get_selector("oracle")
    different = [get_selector("oracle", max_ratio=0.3), get_selector("oracle", group_score="sum"),
                 get_selector("oracle", min_budget=8), base.with_min_budget(4), get_selector("oracle", keep_sinks=2),
                 get_selector("quest")]
    got = [programs(s) for s in [base] + different]
    assert len({id(p) for p in got}) == len(got)  # each its own
    # the class alone: Sequential and Dense with one config (SelectorConfig(max_ratio=1.0))
    dense, sequential = get_selector("dense"), get_selector("sequential", max_ratio=1.0)
    assert dense.config == sequential.config and programs(dense) is not programs(sequential)


@pytest.mark.parametrize("name", ["infinigen", "hata"])
def test_fitted_state_is_part_of_the_value(name):
    """InfiniGen's skew, HATA's hash projection: equal values share (new arrays, same bytes), one
    changed entry does not."""
    rng = np.random.default_rng(0)
    if name == "infinigen":
        state = [rng.standard_normal((CFG.num_kv_heads, CFG.head_dim, 4)).astype(np.float32)
                 for _ in range(CFG.num_layers)]
        make = lambda s: get_selector("infinigen", skew=s)  # noqa: E731
        changed = [s.copy() for s in state]
        changed[-1][0, 0, 0] += 1.0
    else:
        state = rng.standard_normal((CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 32)).astype(np.float32)
        make = lambda p: get_selector("hata", projection=p, bits=32)  # noqa: E731
        changed = state.copy()
        changed[-1, 0, 0, 0] += 1.0
    first = programs(make(state))
    assert programs(make([s.copy() for s in state] if name == "infinigen" else state.copy())) is first
    assert programs(make(changed)) is not first


def test_the_dispatch_backend_and_duck_typed_selectors_are_keyed_apart():
    """The backend is read when the programs trace, so another backend gets other programs; an object
    that is not a Selector has no value key and is equal only to itself."""
    selector = get_selector("oracle")
    first = programs(selector)
    with dispatch.backend("interpret"):
        assert programs(get_selector("oracle")) is not first
    assert programs(get_selector("oracle")) is first

    class Duck:  # what decode_program reads of a selector, nothing else
        config, is_dense = selector.config, False

    duck = Duck()
    assert programs(duck) is programs(duck) and programs(Duck()) is not programs(duck)
