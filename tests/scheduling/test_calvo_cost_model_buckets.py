"""The cost model's bucketed compute part: T_comp = c*q' + e*ctx'*q' + f*ctx' + d (CALVO §3.2
with the compute stage's padding; q', ctx' = padded query / prefix token counts)."""
import numpy as np
import pytest

from jkv.scheduling import CostModel, RequestInfo, make_policy

BUCKETS = (32, 64, 128, 256, 512, 1024)
TRUE = CostModel(a=1.9e-4, b=5e-3, c=2.5e-3, d=1.2e-2, e=1.5e-6, f=3e-5,
                 query_buckets=BUCKETS, prefix_bucket=512)


def bucketed_profile(seed=0, n=300, rel_noise=0.03):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 24, n) * 64                  # whole chunks, some full misses
    query = rng.integers(1, 1000, n)
    t_load = TRUE.t_load(ctx) * rng.lognormal(0, rel_noise, n)
    t_comp = TRUE.t_comp(query, ctx) * rng.lognormal(0, rel_noise, n)
    return ctx, query, t_load, t_comp


def test_padding_rounds_up_to_the_engines_buckets():
    np.testing.assert_array_equal(TRUE.padded_query([1, 32, 33, 200, 1024, 1500]),
                                  [32, 32, 64, 256, 1024, 1500])
    np.testing.assert_array_equal(TRUE.padded_ctx([0, 64, 512, 513]), [0, 512, 512, 1024])
    plain = CostModel(1e-4, 0, 1e-3, 0)
    assert plain.t_comp(33) == pytest.approx(33e-3)
    # every query of one bucket costs the same; a longer prefix costs more for the same query
    assert TRUE.t_comp(40, 1024) == TRUE.t_comp(64, 1024)
    assert TRUE.t_comp(40, 1024) > TRUE.t_comp(40, 512) > TRUE.t_comp(40, 0)
    assert TRUE.cost(1024, 40) == pytest.approx(TRUE.t_load(1024) + TRUE.t_comp(40, 1024))


def test_fit_recovers_bucketed_and_context_coefficients_from_synthetic_timings():
    ctx, query, t_load, t_comp = bucketed_profile()
    fitted = CostModel.fit(ctx, query, t_load, t_comp, relative=True, query_buckets=BUCKETS,
                           prefix_bucket=512, context_terms=True)
    for name, tol in (("a", 0.03), ("c", 0.05), ("e", 0.05), ("f", 0.15), ("d", 0.15)):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=tol), name
    assert fitted.b == pytest.approx(TRUE.b, abs=2e-3)
    assert fitted.query_buckets == BUCKETS and fitted.prefix_bucket == 512
    # the paper's plain line fitted on the same timings is far worse on them
    plain = CostModel.fit(ctx, query, t_load, t_comp, relative=True)
    err = lambda m: np.median(np.abs(m.t_comp(query, ctx) / t_comp - 1))
    assert err(fitted) < 0.04 and err(plain) > 2 * err(fitted)


def test_context_terms_need_independent_prefix_and_query_lengths():
    ctx = np.repeat([512, 1024], 10)                 # two prefixes, every query in one bucket
    query = np.arange(40, 60)
    t = 0.1 + ctx * 1e-4
    with pytest.raises(ValueError, match="independently"):
        CostModel.fit(ctx, query, t, t, query_buckets=BUCKETS, prefix_bucket=512,
                      context_terms=True)


def test_bucket_config_is_validated_and_survives_save_load(tmp_path):
    with pytest.raises(ValueError, match="ascending"):
        CostModel(0, 0, 0, 0, query_buckets=(64, 32))
    with pytest.raises(ValueError, match="prefix_bucket"):
        CostModel(0, 0, 0, 0, prefix_bucket=0)
    with pytest.raises(ValueError, match="e=nan"):
        CostModel(0, 0, 0, 0, e=float("nan"))
    TRUE.save(tmp_path / "m.json")
    assert CostModel.load(tmp_path / "m.json") == TRUE
    v1 = tmp_path / "v1.json"
    v1.write_text('{"format": "calvo-binary-linear-v1", "a": 1, "b": 2, "c": 3, "d": 4, '
                  '"deployment": "x"}')
    assert CostModel.load(v1) == CostModel(1, 2, 3, 4, "x")


def test_sjf_and_lstf_see_the_prefix_cost_of_compute():
    # Same bucketed query; the long-prefix request computes longer, so SJF puts it second and
    # LSTF's remaining cost (slack) includes it even when its whole prefix is already in L1.
    long = RequestInfo("long", 0.0, cached_tokens=1536, compute_tokens=40, deadline_s=10.0)
    short = RequestInfo("short", 0.1, cached_tokens=512, compute_tokens=60, deadline_s=10.0)
    sjf = make_policy("sjf", TRUE)
    assert sorted([long, short], key=sjf.key)[0] is short
    lstf = make_policy("lstf", TRUE)
    assert lstf.progress_key(long, 0, 0.0)[1] == pytest.approx(10.0 - TRUE.cost(1536, 40))
    reeval = make_policy("lstf-reeval", TRUE)
    slack = reeval.progress_key(long, 0, 0.0)[1]
    assert slack == pytest.approx(10.0 - TRUE.t_comp(40, 1536))


def test_compute_fit_is_non_negative_and_optimal_where_least_squares_goes_negative():
    # A small profile like calvo.py's (4 contexts: full hits with 16/64-token queries, 75% and
    # 87.5% hits) on an engine whose compute grows faster than the model's features (q'^2):
    # unconstrained least squares answers with a negative per-prefix-token cost.
    rng = np.random.default_rng(0)
    ctx, query = [], []
    for n in (256, 448, 704, 1024):
        for cached, q in ((n, 16), (n, 64), (n * 3 // 4 // 64 * 64, 32),
                          (n * 7 // 8 // 64 * 64, 48)):
            ctx.append(cached)
            query.append(n - cached + q)
    ctx, query = np.array(ctx), np.array(query)
    shape = CostModel(0, 0, 0, 0, query_buckets=BUCKETS, prefix_bucket=512)
    q, p = shape.padded_query(query), shape.padded_ctx(ctx)
    t_comp = (0.04 + 2e-6 * p * q + 4e-6 * q ** 2) * rng.lognormal(0, 0.05, len(q))
    design = np.stack([q, p * q, p, np.ones_like(q)], axis=1) / t_comp[:, None]
    unconstrained = np.linalg.lstsq(design, np.ones_like(t_comp), rcond=None)[0]
    assert (unconstrained < 0).any()                     # the failure this guards against
    fitted = CostModel.fit(ctx, query, 3.7e-4 * ctx, t_comp, relative=True,
                           query_buckets=BUCKETS, prefix_bucket=512, context_terms=True)
    coef = np.array([fitted.c, fitted.e, fitted.f, fitted.d])
    assert (coef >= 0).all()
    # optimal under the constraint (KKT): zero gradient on free coefficients, >= 0 on the
    # ones held at the bound
    grad = design.T @ (design @ coef - 1)
    scale = np.abs(design).sum(axis=0)
    assert np.all(np.abs(grad[coef > 0]) <= 1e-9 * scale[coef > 0])
    assert np.all(grad[coef == 0] >= -1e-9 * scale[coef == 0])
    # so every request shape has a positive compute time, also beyond the profiled prefixes
    grid_q, grid_ctx = np.meshgrid(np.arange(1, 1025, 7), np.arange(0, 4097, 64))
    assert (fitted.t_comp(grid_q, grid_ctx) > 0).all()
    # and where least squares is already feasible the constraint changes nothing
    plain = CostModel.fit(ctx, query, 3.7e-4 * ctx, 0.05 + 1e-3 * query, relative=True)
    assert (plain.c, plain.d) == (pytest.approx(1e-3), pytest.approx(0.05))


def test_scaled_model_multiplies_every_time_and_keeps_the_sjf_order():
    scaled = TRUE.scaled(1.25)
    ctx, query = np.array([0, 512, 1024, 1536]), np.array([700, 40, 300, 16])
    np.testing.assert_allclose(scaled.cost(ctx, query), 1.25 * TRUE.cost(ctx, query))
    np.testing.assert_allclose(scaled.t_load(ctx), 1.25 * TRUE.t_load(ctx))
    assert scaled.query_buckets == TRUE.query_buckets
    order = lambda m: np.argsort(m.cost(ctx, query)).tolist()
    assert order(scaled) == order(TRUE)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        TRUE.scaled(0.0)
