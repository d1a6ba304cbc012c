"""The lookahead's cheap hint (jkv/disagg/hint.py): InfiniGen's selected *set* without the ordered
top-k. For the same inputs it must be the selector's own set, row by row; the decode worker must
use it in lookahead mode; and a selector without a hint falls back to `select`."""
import numpy as np
import pytest

from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.hint import InfiniGenHint, make_hint
from jkv.selection.infinigen import InfiniGen, InfiniGenConfig
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET


def _inputs(model, selector, lengths, capacity, seed):
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    K = rng.standard_normal((len(lengths), cfg.num_kv_heads, capacity, cfg.head_dim)).astype(np.float32)
    q = rng.standard_normal((len(lengths), cfg.num_heads, cfg.head_dim)).astype(np.float32)
    lengths = np.asarray(lengths, np.int32)
    layer = selector.config.dense_layers
    return layer, q, selector.prepare(layer, K, lengths), lengths


@pytest.mark.parametrize("group_score,sinks,recent,alpha", [("mass", 4, 16, 10.0), ("max", 0, 0, 0.3),
                                                           ("sum", 2, 5, 10.0), ("mass", 4, 16, 0.3)])
def test_hint_is_the_selectors_set_row_by_row(model, selectors, group_score, sinks, recent, alpha):
    base = selectors["infinigen"]
    sel = InfiniGen(InfiniGenConfig(group_score=group_score, keep_sinks=sinks, keep_recent=recent, alpha=alpha),
                    skew=base.skew)
    hint, wide, short = InfiniGenHint(sel, margin=0), InfiniGenHint(sel, margin=8), 0
    for seed, lengths in enumerate(([300, 77, 512, 190], [40, 41, 512, 7])):  # one B: one compile
        layer, q, meta, n = _inputs(model, sel, lengths, 512, seed)
        want = np.asarray(sel.select(layer, q, meta, n))
        got, more = hint(layer, q, meta, n), wide(layer, q, meta, n)
        assert got.shape == want.shape and got.dtype == np.int32 and more.shape[1] == want.shape[1] + 8
        for r in range(want.shape[0]):
            w, g, m = want[r][want[r] >= 0], got[r][got[r] >= 0], more[r][more[r] >= 0]
            assert sorted(g.tolist()) == sorted(w.tolist()), (seed, r)
            assert (got[r][len(g):] == -1).all()  # the set is a prefix, -1 after it
            # the margin: the set plus the next 8 rows of the ranking (valid tokens only)
            assert set(w.tolist()) <= set(m.tolist()) and len(set(m.tolist())) == min(len(w) + 8, n[r // model.cfg.num_kv_heads])
        short += int(((got >= 0).sum(1) < (n.repeat(model.cfg.num_kv_heads) * 0.2).astype(int)).sum())
    # a small alpha cuts rows below their budget (random keys are flat: alpha 10 keeps the budget)
    assert short > 0 if alpha < 10 else short == 0


def test_only_infinigen_has_a_hint_and_the_decode_worker_uses_it_with_lookahead(model, selectors):
    assert isinstance(make_hint(selectors["infinigen"]), InfiniGenHint)
    assert make_hint(selectors["oracle"]) is None  # the lookahead calls select
    on = DecodeWorker(model, selectors["infinigen"], TransferConfig(mode="smartgen", kr_fraction=0.3), secret=SECRET)
    off = DecodeWorker(model, selectors["infinigen"], TransferConfig(mode="smartgen", kr_fraction=0.3,
                                                                     lookahead=False), secret=SECRET)
    plain = DecodeWorker(model, selectors["infinigen"], TransferConfig(mode="smartgen", kr_fraction=0.3,
                                                                       hint_margin=None), secret=SECRET)
    try:
        assert isinstance(on._hint, InfiniGenHint) and on._hint.margin == 8 and off._hint is None
        assert plain._hint is None  # hint_margin=None: the lookahead hints with the selector's select
    finally:
        on.close(), off.close(), plain.close()
    assert make_hint(selectors["infinigen"], 0).margin == 0
    with pytest.raises(ValueError, match="hint_margin=-1"):
        TransferConfig(hint_margin=-1)
    with pytest.raises(ValueError, match="lookahead_gate='never'"):
        TransferConfig(lookahead_gate="never")


def test_step_cpu_counters_follow_the_process_and_the_probe():
    from jkv.disagg.decode_state import StepPhases

    other = [10.0]
    clock = StepPhases(probe=lambda: other[0])
    clock.new_step()
    x = 0
    for i in range(300_000):  # burn a little CPU in this process
        x += i * i
    other[0] += 0.25  # the probed processes used 0.25 s meanwhile
    clock.end_step()
    step = clock.steps[-1]
    assert step["cpu_us_n"] > 1000 and step["probe_cpu_us_n"] == 250_000
    assert 1000 < step["engine_cpu_us_n"] <= step["cpu_us_n"] + 10_000  # this thread's share (tick rounding)
    bare = StepPhases()
    bare.new_step(), bare.end_step()
    assert "probe_cpu_us_n" not in bare.steps[-1] and "cpu_us_n" in bare.steps[-1]
