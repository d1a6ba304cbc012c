"""LLM(disaggregation=...) starts and stops a local prefill worker process; results carry the
SmartGen metrics; Disaggregation validates its options."""
import pytest

import dataclasses

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
