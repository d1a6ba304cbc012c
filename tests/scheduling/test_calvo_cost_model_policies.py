"""Binary linear cost model (CALVO §3.2) and the five ordering policies."""
import math

import numpy as np
import pytest

from jkv.scheduling import POLICY_NAMES, CostModel, RequestInfo, make_policy

TRUE = CostModel(a=1.3e-5, b=4e-3, c=2.1e-4, d=1.5e-2)


def synthetic_profile(seed=0, n=400, noise=2e-3):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 32_000, n)
    ctx[:20] = 0                                   # full misses: no load at all
    query = rng.integers(1, 2_000, n)
    t_load = TRUE.t_load(ctx) + np.where(ctx > 0, rng.normal(0, noise, n), 0)
    t_comp = TRUE.t_comp(query) + rng.normal(0, noise, n)
    return ctx, query, t_load, t_comp


def test_fit_recovers_known_coefficients_from_noisy_timings():
    fitted = CostModel.fit(*synthetic_profile(), deployment="synthetic")
    assert fitted.a == pytest.approx(TRUE.a, rel=0.02)
    assert fitted.c == pytest.approx(TRUE.c, rel=0.02)
    assert fitted.b == pytest.approx(TRUE.b, abs=1e-3)
    assert fitted.d == pytest.approx(TRUE.d, abs=1e-3)


def test_relative_fit_recovers_coefficients_and_fits_small_samples_better():
    rng = np.random.default_rng(2)
    ctx = rng.integers(1, 32_000, 200)
    query = np.concatenate([rng.integers(8, 64, 150), rng.integers(1_000, 2_000, 50)])
    # Multiplicative noise (5%): the regime where an absolute fit is dominated by big samples.
    t_load = TRUE.t_load(ctx) * rng.lognormal(0, 0.05, 200)
    t_comp = TRUE.t_comp(query) * rng.lognormal(0, 0.05, 200)
    rel = CostModel.fit(ctx, query, t_load, t_comp, relative=True)
    assert rel.c == pytest.approx(TRUE.c, rel=0.05) and rel.d == pytest.approx(TRUE.d, rel=0.05)
    assert rel.a == pytest.approx(TRUE.a, rel=0.05)
    small = query < 64
    err = lambda m: np.median(np.abs(m.t_comp(query[small]) / t_comp[small] - 1))
    assert err(rel) <= err(CostModel.fit(ctx, query, t_load, t_comp))
    with pytest.raises(ValueError, match="positive times"):
        CostModel.fit(ctx, query, t_load, np.zeros_like(t_comp), relative=True)


def test_fit_total_recovers_slopes_and_joint_intercept():
    ctx, query, t_load, t_comp = synthetic_profile(seed=1)
    keep = ctx > 0
    fitted = CostModel.fit_total(ctx[keep], query[keep], (t_load + t_comp)[keep])
    assert fitted.a == pytest.approx(TRUE.a, rel=0.03)
    assert fitted.c == pytest.approx(TRUE.c, rel=0.03)
    assert fitted.b + fitted.d == pytest.approx(TRUE.b + TRUE.d, abs=2e-3)


def test_cost_is_the_sum_of_both_lines_and_no_load_costs_nothing():
    assert TRUE.cost(1000, 10) == pytest.approx(1.3e-2 + 4e-3 + 2.1e-3 + 1.5e-2)
    assert TRUE.t_load(0) == 0.0
    np.testing.assert_allclose(TRUE.cost(np.array([0, 1000]), np.array([10, 10])),
                               [TRUE.t_comp(10), TRUE.cost(1000, 10)])


def test_save_load_round_trip(tmp_path):
    model = CostModel(1e-5, 2e-3, 3e-4, 4e-2, deployment="smollm2/cpu/1gbit")
    model.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == model
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a calvo-binary-linear"):
        CostModel.load(tmp_path / "bad.json")


def test_fit_errors_are_clear():
    with pytest.raises(ValueError, match="distinct ctx_tokens"):
        CostModel.fit([5, 5, 5], [1, 2, 3], [1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="differ in length"):
        CostModel.fit([1, 2], [1, 2, 3], [1, 1], [1, 2])
    with pytest.raises(ValueError, match="finite"):
        CostModel(math.nan, 0, 0, 0)


def info(rid, arrival, cached, compute, deadline=math.inf):
    return RequestInfo(rid, arrival, cached, compute, deadline)


def order(policy, requests):
    return [r.request_id for r in sorted(requests, key=policy.key)]


# The paper's §2.3.2 example: R1 arrives first, loads 0.361 s + computes 0.019 s; R2 loads
# 0.199 s + computes 0.025 s. Cost model: 1e-5 s/ctx token, 1e-3 s/query token.
PAPER = CostModel(a=1e-5, b=0.0, c=1e-3, d=0.0)
R1 = info("R1", 0.0, cached=36_100, compute=19, deadline=10.0)
R2 = info("R2", 0.1, cached=19_900, compute=25, deadline=9.0)


def test_fifo_and_sjf_pt_are_blind_to_loading():
    assert order(make_policy("fifo"), [R2, R1]) == ["R1", "R2"]
    assert order(make_policy("sjf-pt"), [R2, R1]) == ["R1", "R2"]   # 19 < 25 query tokens


def test_sjf_orders_by_modelled_cost():
    assert order(make_policy("sjf", PAPER), [R1, R2]) == ["R2", "R1"]  # 0.224 s < 0.380 s
    many = [info(i, float(i), cached=c, compute=q) for i, (c, q) in
            enumerate([(30_000, 10), (0, 500), (10_000, 100), (20_000, 1)])]
    costs = [PAPER.cost(r.cached_tokens, r.compute_tokens) for r in many]
    assert order(make_policy("sjf", PAPER), many) == list(np.argsort(costs, kind="stable"))


def test_edf_orders_by_deadline_and_lstf_by_slack():
    # A: deadline 1.0, cost 0.9 -> slack 0.1; B: deadline 0.8, cost 0.1 -> slack 0.7.
    a = info("A", 0.0, cached=90_000, compute=0, deadline=1.0)
    b = info("B", 0.0, cached=10_000, compute=0, deadline=0.8)
    assert order(make_policy("edf"), [a, b]) == ["B", "A"]
    assert order(make_policy("lstf", PAPER), [a, b]) == ["A", "B"]
    no_deadline = info("C", 0.0, cached=0, compute=1)
    assert order(make_policy("edf"), [no_deadline, a]) == ["A", "C"]


def test_ties_fall_back_to_arrival():
    x, y = info("x", 2.0, 100, 10), info("y", 1.0, 100, 10)
    for name in POLICY_NAMES:
        assert order(make_policy(name, PAPER), [x, y]) == ["y", "x"]


def test_policy_names_are_validated():
    with pytest.raises(ValueError, match="valid: fifo, sjf-pt, sjf, srpt, edf, lstf, lstf-reeval, lstf-static"):
        make_policy("round-robin")
    with pytest.raises(ValueError, match="pass cost_model"):
        make_policy("lstf")
    assert make_policy("SJF_PT").name == "sjf-pt"


def test_lstf_static_orders_by_admission_slack():
    a = info("A", 0.0, cached=90_000, compute=0, deadline=1.0)
    b = info("B", 0.0, cached=10_000, compute=0, deadline=0.8)
    assert order(make_policy("lstf-static", PAPER), [a, b]) == ["A", "B"]


@pytest.mark.parametrize("name", ["lstf", "lstf-reeval"])
def test_lstf_slack_uses_now_and_remaining_load_and_demotes_late_requests(name):
    key = make_policy(name, PAPER).progress_key
    a = info("A", 0.0, cached=90_000, compute=0, deadline=1.0)   # full load 0.9 s
    b = info("B", 0.0, cached=10_000, compute=0, deadline=0.8)   # full load 0.1 s
    assert key(a, 90_000, 0.0) < key(b, 10_000, 0.0)             # slack 0.1 < 0.7
    if name == "lstf-reeval":    # A mostly loaded: re-evaluated slack 0.8 > 0.7, B overtakes
        assert key(a, 20_000, 0.0) > key(b, 10_000, 0.0)
    else:                        # the admission key: A's own progress keeps its place
        assert key(a, 20_000, 0.0) < key(b, 10_000, 0.0)
        assert key(a, 20_000, 0.05) == key(a, 90_000, 0.0)
    # At now = 0.5 A can no longer make it (0.5 + 0.9 > 1.0): it goes behind B, which can.
    assert key(a, 90_000, 0.5) > key(b, 10_000, 0.5)
    late = [info(f"L{i}", 0.0, cached=c, compute=0, deadline=0.1) for i, c in
            enumerate([50_000, 20_000])]
    assert key(late[1], 20_000, 0.5) < key(late[0], 50_000, 0.5)  # among late: shortest first


def test_core_reorders_by_progress_key_as_chunks_reach_l1():
    from jkv.scheduling.core import PipelineCore, PipelineRequest, Stage
    now = [0.0]
    core = PipelineCore(8, 16, progress_key=make_policy("lstf-reeval", PAPER).progress_key,
                        clock=lambda: now[0])
    a = PipelineRequest(info("A", 0.0, cached=40_000, compute=0, deadline=1.0), num_chunks=4)
    b = PipelineRequest(info("B", 0.0, cached=10_000, compute=0, deadline=0.75), num_chunks=1)
    core.add(a, (0,))
    core.add(b, (1,))
    # A's slack 0.6 < B's 0.65: A fetches first; after 2 of its 4 chunks are in L1 its slack is
    # 0.8 and B (0.65) comes first.
    fetches = [core.next_task(Stage.FETCH) for _ in range(2)]
    assert [t.request.request_id for t in fetches] == ["A", "A"]
    for t in fetches:
        core.complete(t)
        core.complete(core.next_task(Stage.UPLOAD))
    assert core.next_task(Stage.FETCH).request.request_id == "B"
    with pytest.raises(ValueError, match="clock"):
        PipelineCore(8, 16, progress_key=make_policy("lstf", PAPER).progress_key)


def fetch_order(policy_name, now_step):
    """Request ids in FETCH dispatch order for two requests of near-equal slack (A 0.60 s,
    B 0.65 s; 4 chunks each), each fetched chunk uploaded at once, `now_step` s per chunk."""
    from jkv.scheduling.core import PipelineCore, PipelineRequest, Stage
    now = [0.0]
    core = PipelineCore(16, 16, progress_key=make_policy(policy_name, PAPER).progress_key,
                        clock=lambda: now[0])
    core.add(PipelineRequest(info("A", 0.0, cached=40_000, compute=0, deadline=1.0), 4), (0,))
    core.add(PipelineRequest(info("B", 0.0, cached=40_000, compute=0, deadline=1.05), 4), (1,))
    order = []
    while (task := core.next_task(Stage.FETCH)) is not None:
        order.append(task.request.request_id)
        now[0] += now_step
        core.complete(task)
        core.complete(core.next_task(Stage.UPLOAD))
    return "".join(order)


def test_lstf_loads_one_request_at_a_time_where_reevaluated_slack_thrashes():
    # Re-evaluated slack: each chunk A gets raises A's slack by 0.1 s, so B overtakes after one
    # chunk and the two loads interleave (neither is loaded before ~all 8 chunks are in):
    # laxity-tie thrashing. The admission key loads A, then B, so A can compute while B loads.
    assert fetch_order("lstf-reeval", 0.0) == "ABABABAB"
    assert fetch_order("lstf", 0.0) == "AAAABBBB"
    # the same with time passing (0.1 s per chunk; both stay feasible)
    assert fetch_order("lstf", 0.1) == "AAAABBBB"


def test_lstf_fast_key_matches_the_model_and_computes_t_comp_once_per_request():
    import dataclasses

    calls = []

    @dataclasses.dataclass(frozen=True)
    class Counting(CostModel):
        def t_comp(self, query_tokens, ctx_tokens=0):
            calls.append(query_tokens)
            return super().t_comp(query_tokens, ctx_tokens)

    model = Counting(a=3.7e-4, b=-5e-3, c=9e-4, d=0.02, e=2e-6, f=1e-5,
                     query_buckets=(32, 64, 128, 256, 512), prefix_bucket=512)
    reference = CostModel(**{k: getattr(model, k) for k in
                             ("a", "b", "c", "d", "e", "f", "query_buckets", "prefix_bucket")})
    key = make_policy("lstf-reeval", model).progress_key
    admission_key = make_policy("lstf", model).progress_key
    rng = np.random.default_rng(0)
    infos = [RequestInfo(i, 0.0, int(rng.integers(0, 16)) * 64, int(rng.integers(1, 600)),
                         deadline_s=float(rng.uniform(0.1, 3.0))) for i in range(20)]
    calls.clear()
    for _ in range(5):                         # every dispatch re-evaluates every request
        for info in infos:
            for remaining in (0.0, info.cached_tokens / 2, float(info.cached_tokens)):
                now = float(rng.uniform(0, 2))
                cost = (reference.t_load(remaining)
                        + reference.t_comp(info.compute_tokens, info.cached_tokens))
                lst = info.deadline_s - now - cost
                want = (1, cost, 0.0) if lst < 0 else (0, lst, 0.0)
                got = key(info, remaining, now)
                assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-12)
                if lst >= 0:      # lstf: the admission-time LST while feasible
                    want = (0, info.deadline_s - reference.cost(info.cached_tokens,
                                                                info.compute_tokens), 0.0)
                got = admission_key(info, remaining, now)
                assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-12)
    assert len(calls) == 2 * len(infos)        # T_comp once per request and key, not per dispatch


def test_srpt_orders_by_remaining_modelled_cost():
    key = make_policy("srpt", PAPER).progress_key
    assert order(make_policy("srpt", PAPER), [R1, R2]) == ["R2", "R1"]   # admission: as sjf
    # R1 with 30K of its 36.1K prefix in L1: 0.061 + 0.019 s left < R2's 0.199 + 0.025 s.
    assert key(R1, 6_100, 0.0) < key(R2, 19_900, 0.0)
    assert key(R1, 6_100, 0.0)[0] == pytest.approx(0.061 + 0.019)
    # Prefix fully in L1: only T_comp is left, whatever the prefix length.
    long_ready = info("L", 0.0, cached=90_000, compute=10)
    short_ready = info("S", 0.0, cached=1_000, compute=20)
    assert key(long_ready, 0.0, 0.0) < key(short_ready, 0.0, 0.0)
    assert key(long_ready, 90_000, 0.0) > key(short_ready, 1_000, 0.0)
    assert key(R1, 6_100, 5.0) == key(R1, 6_100, 0.0)                  # no deadline, no clock


def test_srpt_loads_one_request_at_a_time_and_computes_the_shortest_ready_one_first():
    # Near-equal requests: a request's own progress only lowers its key, so A keeps the link.
    assert fetch_order("srpt", 0.0) == "AAAABBBB"
    from jkv.scheduling.core import PipelineCore, PipelineRequest, Stage
    core = PipelineCore(16, 16, progress_key=make_policy("srpt", PAPER).progress_key,
                        clock=lambda: 0.0)
    # Admission (sjf) order: L (0.9 + 0.01 s) after S (0.01 + 0.2 s). Once both prefixes are in
    # L1, srpt computes L first (0.01 s left vs 0.2 s); static sjf would keep S first.
    reqs = {"L": PipelineRequest(info("L", 0.0, cached=90_000, compute=10), 2),
            "S": PipelineRequest(info("S", 0.0, cached=1_000, compute=200), 1)}
    sjf_core = PipelineCore(16, 16)
    for c, priority in ((core, None), (sjf_core, make_policy("sjf", PAPER).key)):
        for r in reqs.values():
            c.add(r, (priority or make_policy("srpt", PAPER).key)(r.info))
        while (task := c.next_task(Stage.FETCH)) is not None:
            c.complete(task)
            c.complete(c.next_task(Stage.UPLOAD))
    assert core.next_task(Stage.COMPUTE).request.request_id == "L"
    assert sjf_core.next_task(Stage.COMPUTE).request.request_id == "S"
