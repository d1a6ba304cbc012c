"""Every registered selector x every transfer mode through the disaggregated engine (the one `LLM`
and `jkv serve` run: DisaggregatedEngine over real TCP prefill workers) generates, and each
selector's tokens are the same in every mode (the invariant). Issue 23: `quest` could not run
disaggregated at all (its metadata had a leaf without the request axis), and no selector but
streamingllm ever ran through the engine.

One prefill worker per selector (threads of this process, a real TCP endpoint) serves all five
modes. A budget floor of 64 tokens: the 45-token prompt (50 tokens after 6 generated) decodes
densely in the same batch as the longer, sparsely decoded ones."""
import numpy as np
import pytest

from jkv.disagg.cluster import DisaggregatedEngine
from jkv.disagg.config import Disaggregation
from jkv.disagg.selectors import build_selector
from jkv.selection.registry import SELECTORS
from jkv.selection.sparse_decode import generate_sparse
from jkv.transfer.plan import MODES, TransferConfig
from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

FLOOR = 64
MAX_TOKENS = 6


def matrix_selector(model, name):
    if name == "hata":  # hash projections need training: random ones select (badly) but deterministically
        cfg = model.cfg
        projection = np.random.default_rng(0).normal(size=(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256))
        return build_selector(model, name, projection=projection.astype(np.float32))
    return build_selector(model, name)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_in_every_mode_generates_the_same_tokens(model, prompts, name):
    prompts = [prompts[2], prompts[0], prompts[1]]  # 45, 70 and 130 tokens
    selector = matrix_selector(model, name).with_min_budget(FLOOR)
    workers = InProcessWorkers(model, selector, 1)
    tokens, on_demand = {}, {}
    try:
        for mode in MODES:
            dis = Disaggregation(TransferConfig(mode=mode, strategy="random", kr_fraction=0.3, max_blocks=16),
                                 selector=name, bandwidth=None, addresses=tuple(workers.addresses), secret=SECRET,
                                 min_budget=FLOOR)
            engine = DisaggregatedEngine(model, dis, selector=selector)
            try:
                assert engine.selector is selector  # the floor it was built with is the engine's
                outs = engine.generate(make_requests(prompts, MAX_TOKENS, tag=f"{name}{mode}"))
                assert engine.decode.pool.live() == [] and engine.decode.pages.cache.pages_in_use == 0
            finally:
                engine.close()
            assert all(o.finish_reason == "length" for o in outs), (mode, [o.metrics.extra.get("error") for o in outs])
            tokens[mode] = [o.token_ids for o in outs]
            on_demand[mode] = sum(o.metrics.extra["on_demand_ratio"] for o in outs)
    finally:
        workers.close()
    for worker in workers.workers:
        assert worker.held() == [] and worker.pool.bytes_in_use == 0
    for mode in MODES[1:]:
        assert tokens[mode] == tokens["full"], (name, mode)
    if name != "dense":  # partial transfer really fetched rows on demand
        assert on_demand["full"] == 0 and on_demand["partial"] > 0, on_demand
    # and the tokens are the colocated host-offloaded sparse decode's (the same selector, floor included)
    ref = generate_sparse(model, prompts, selector, MAX_TOKENS).tokens.tolist()
    assert tokens["full"] == ref, name
