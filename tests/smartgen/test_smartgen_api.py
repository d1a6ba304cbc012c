"""LLM(disaggregation=...) starts and stops a local prefill worker process; results carry the
SmartGen metrics; Disaggregation validates its options."""
import pytest

import dataclasses

import numpy as np

from jkv import LLM, SamplingParams, TransferConfig
from jkv.api import Disaggregation
from jkv.selection.sparse_decode import generate_sparse
from tests.smartgen.smartgen_cases import MODEL_SPEC


def test_llm_disaggregated_smartgen_matches_colocated_sparse_decode(model, selectors, prompts):
    dis = Disaggregation(TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3, max_blocks=16),
                         selector="oracle", transport="tcp", bandwidth="50mbit", prefill_workers=1,
                         model_spec=MODEL_SPEC, min_budget=0)  # the bare 20% budget: short prompts decode sparsely
    with LLM(model, disaggregation=dis) as llm:
        procs = list(llm._engine.workers.procs)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(p.poll() is not None for p in procs)  # close() stopped the worker process
    ref = generate_sparse(model, prompts, selectors["oracle"], 6).tokens.tolist()
    assert [o.token_ids for o in outs] == ref
    for o in outs:
        m = o.metrics
        assert 0 < m.ttft <= m.ttst and len(m.tbt) == 5 and len(m.ctl) == 6 and m.ctl[-1] == pytest.approx(m.e2e)
        assert 0 < m.extra["on_demand_ratio"] < 1 and len(m.extra["step_on_demand_ratio"]) == 5
        assert m.extra["bytes"]["proactive"] > 0 and m.extra["bytes"]["on_demand"] > 0
        assert m.extra["bytes"]["metadata"] > 0 and m.extra["mode"] == "smartgen"


def test_llm_disaggregated_prefix_caching_reuses_a_shared_prefix_on_both_sides(model):
    """LLM(disaggregation=..., enable_prefix_caching=True), like `jkv serve`: a second generate()
    sharing a long prefix with the first gives the tokens of the run without prefix caching, its
    prefill (in the worker process) computes only the tokens after the cached full pages, and the
    decode side moves none of those pages' KV."""
    rng = np.random.default_rng(19)
    stem = rng.integers(3, model.cfg.vocab_size, 150).tolist()  # 9 full pages of 16 tokens + 6
    prompts = [stem + rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (9, 20)]
    shared = len(stem) // 16 * 16
    dis = Disaggregation(TransferConfig(mode="full", max_blocks=16), selector="oracle", transport="tcp",
                         prefill_workers=1, model_spec=MODEL_SPEC)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs, counters = {}, {}
    for caching in (True, False):
        with LLM(model, disaggregation=dis, enable_prefix_caching=caching) as llm:
            outs[caching], counters[caching] = [], []
            for p in prompts:
                outs[caching] += llm.generate(p, params)
                counters[caching].append(llm._engine.prefill_cache_stats())
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert counters[False] == [None, None]  # no prefix caching: the worker has no cache
    first, second = counters[True]
    assert first["prefill_computed_tokens"] == len(prompts[0]) and first["prefill_prefix_hit_tokens"] == 0
    assert second["prefill_prefix_hit_tokens"] == shared
    assert second["prefill_computed_tokens"] - first["prefill_computed_tokens"] == len(prompts[1]) - shared
    assert outs[True][1].metrics.extra["prefix_hit_tokens"] == shared  # the decode side kept the first's pages
    assert outs[False][1].metrics.extra["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("bad, match", [
    (dict(transfer=dict(mode="fastest")), "mode"), (dict(prefill_workers=0), "prefill_workers"),
    (dict(on_failure="retry"), "on_failure"), (dict(bandwidth="fast"), "bandwidth"),
    (dict(transport="udp"), "transport"), (dict(transfer=dict(spec_ratio=2.0)), "spec_ratio"),
])
def test_disaggregation_validates(bad, match):
    with pytest.raises(ValueError, match=match):
        Disaggregation(**{k: TransferConfig(**v) if k == "transfer" else v for k, v in bad.items()})


def test_disaggregation_bandwidth_is_the_one_link_setting():
    """`bandwidth` fills the nested transfer's Eq. 2 link estimate; a second, different value is an error."""
    assert Disaggregation().transfer == TransferConfig(bandwidth_bps=1e9)  # "1gbit" by default
    assert Disaggregation(bandwidth="50mbit").transfer.bandwidth_bps == 5e7
    assert Disaggregation(bandwidth=None).transfer.bandwidth_bps is None
    dis = Disaggregation(TransferConfig(mode="partial", bandwidth_bps=5e7), bandwidth="50mbit")  # agreeing: fine
    assert dataclasses.replace(dis, selector="quest").transfer == dis.transfer
    with pytest.raises(ValueError, match=r"transfer.bandwidth_bps=1000.0 disagrees with bandwidth='1gbit'"):
        Disaggregation(TransferConfig(bandwidth_bps=1e3))
    with pytest.raises(ValueError, match="disagrees"):
        dataclasses.replace(dis, bandwidth="1gbit")
    with pytest.raises(TypeError, match="must be a jkv.transfer.plan.TransferConfig"):
        Disaggregation(transfer={"mode": "full"})


def test_llm_needs_a_loadable_model_for_local_workers(model):
    with pytest.raises(ValueError, match="model_spec"):
        LLM(model, disaggregation=Disaggregation(TransferConfig(kr_fraction=0.3), selector="oracle"))


def test_prefill_worker_cli_needs_the_shared_secret(monkeypatch, capsys):
    from jkv.cli import main

    monkeypatch.delenv("JKV_SECRET", raising=False)
    assert main(["prefill-worker", "--model", MODEL_SPEC, "--selector-file", "unused.pkl"]) == 2
    assert "JKV_SECRET" in capsys.readouterr().err


def test_llm_disaggregated_passes_the_compression_choice_to_its_workers(model, prompts):
    """Disaggregation(compression=<pipeline>) reaches the decode worker and the worker process:
    each request reports the pipeline and the proactive bytes shrink below the float32 rows."""
    spec = "hadamard+kivi4g32+none"
    dis = Disaggregation(TransferConfig(mode="full", max_blocks=16), selector="oracle", transport="tcp",
                         prefill_workers=1, model_spec=MODEL_SPEC, compression=spec)
    with LLM(model, disaggregation=dis) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    cfg = model.cfg
    raw = sum(2 * cfg.num_layers * cfg.num_kv_heads * len(p) * cfg.head_dim * 4 for p in prompts)
    assert all(o.metrics.extra["compression"] == spec and o.finish_reason == "length" for o in outs)
    assert 0 < sum(o.metrics.extra["bytes"]["proactive"] for o in outs) < raw / 4


@pytest.fixture(scope="module")
def two_workers(model, tmp_path_factory):
    """Two prefill worker processes on a paced link, shared by the LLMs below (`addresses=`)."""
    from jkv.disagg.cluster import LocalPrefillWorkers
    from jkv.disagg.selectors import build_selector, save_selector

    path = str(tmp_path_factory.mktemp("sel") / "selector.pkl")
    save_selector(build_selector(model, "oracle").with_min_budget(0), path)
    workers = LocalPrefillWorkers(2, MODEL_SPEC, path, secret=WORKER_SECRET, bandwidth="50mbit", max_blocks=16)
    yield workers
    workers.close()


WORKER_SECRET = "compose-test-secret"


@pytest.mark.parametrize("spec, on_demand", [("identity+tok4g32+zstd3", "identity+tok4g32+none"),
                                             ("hadamard+kivi2g32+zstd3", "f16")])
def test_llm_modes_are_token_identical_with_compression_on_every_path(model, two_workers, spec, on_demand):
    """A fixed pipeline compresses the pushes, the on-demand replies (a row-granular pipeline: the
    push's own quantizer without its entropy coder, or exact float16 rows) and the metadata; full /
    partial / smartgen with 1 and 2 prefill workers then generate the same tokens, because the prefill
    side's copy is decode(encode(KV)) and every path decodes to exactly those values."""
    rng = np.random.default_rng(23)  # long enough for several 128-token chunks per layer: rows stay remote
    prompts = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (700, 530)]
    tokens = {}
    for n_workers in (1, 2):
        for mode in ("full", "partial", "smartgen"):
            dis = Disaggregation(TransferConfig(mode=mode, strategy="sequential", kr_fraction=0.1, max_blocks=16),
                                 selector="oracle", bandwidth="50mbit", min_budget=0, compression=spec,
                                 addresses=tuple(two_workers.addresses[:n_workers]), secret=WORKER_SECRET)
            with LLM(model, disaggregation=dis) as llm:
                outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
            assert all(o.finish_reason == "length" for o in outs), [o.metrics.extra.get("error") for o in outs]
            for o in outs:
                extra = o.metrics.extra
                assert extra["compression_paths"] == dict(push=spec, on_demand=on_demand, metadata="zstd1")
                assert extra["bytes"]["metadata"] > 0
                if mode != "full":
                    assert extra["bytes"]["on_demand"] > 0 or extra["on_demand_ratio"] == 0
            if mode != "full":
                assert sum(o.metrics.extra["on_demand_ratio"] for o in outs) > 0  # rows really came on demand
            tokens[n_workers, mode] = [o.token_ids for o in outs]
    assert len({str(t) for t in tokens.values()}) == 1, tokens
    plain = Disaggregation(TransferConfig(mode="full", max_blocks=16), selector="oracle", bandwidth="50mbit",
                           min_budget=0, addresses=tuple(two_workers.addresses[:1]), secret=WORKER_SECRET)
    with LLM(model, disaggregation=plain) as llm:
        off = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    # the compressed metadata is smaller than the plain leaves (lossless: selection is unchanged)
    assert sum(o.metrics.extra["bytes"]["metadata"] for o in off) > sum(
        o.metrics.extra["bytes"]["metadata"] for o in outs)
