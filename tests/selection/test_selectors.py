"""Hand-checkable unit tests for each selector on small raw arrays."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.selection import get_selector, selection_budget
from jkv.selection._ops import topk_select
from jkv.selection.hata import hamming_similarity, hash_codes
from jkv.selection.infinigen import fit_skew
from jkv.selection.quest import page_bounds, page_upper_bound

B, H, H_KV, D = 2, 4, 2, 8
LAYER = 5  # any layer >= 2 is sparse
# The approximate selectors always keep sinks and a recent window by default; the hand-checked
# tests of their scoring switch that off so only the score decides.
NO_KEEP = dict(keep_sinks=0, keep_recent=0)


def random_kv(n_cap, seed=0, batch=B):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, H_KV, n_cap, D)).astype(np.float32)


def rows_as_sets(kv_index):
    return [set(int(i) for i in row if i >= 0) for row in np.asarray(kv_index)]


def assert_prefix_valid(kv_index):
    index = np.asarray(kv_index)
    for row in index:
        valid = row >= 0
        assert not np.any(valid[np.argmin(valid):]) or valid.all(), f"valid entries not a prefix: {row}"


@pytest.mark.parametrize("n,ratio,expected", [(10, 0.2, 2), (11, 0.2, 3), (30, 0.1, 3), (7, 1.0, 7),
                                              (1, 0.2, 1), (3, 0.01, 1), (1000, 0.2, 200)])
def test_budget_is_ceil_of_ratio(n, ratio, expected):
    assert selection_budget(n, ratio) == expected
    assert int(selection_budget(jnp.asarray([n]), ratio)[0]) == expected


def test_topk_select_ties_and_sentinel():
    scores = jnp.asarray([[1.0, 3.0, 3.0, 0.5, 9.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    out = np.asarray(topk_select(scores, jnp.asarray([4, 2]), 3))
    # row 0: column 4 is past valid_len; ties 1,2 keep the lower index first.
    np.testing.assert_array_equal(out, [[1, 2, 0], [0, 1, -1]])


def test_oracle_picks_planted_tokens_per_kv_head():
    n = 40
    K = random_kv(n) * 0.1
    q = np.zeros((B, H, D), np.float32)
    # KV head 0 (query heads 0,1): query head 1 looks for token 7; KV head 1: head 2 looks for 13, 29.
    q[:, 1, 0] = 10.0
    K[:, 0, 7, 0] = 5.0
    q[:, 2, 1] = 10.0
    K[:, 1, 13, 1] = 5.0
    K[:, 1, 29, 1] = 4.0
    sel = get_selector("oracle", max_ratio=0.05)  # budget 2 of 40
    lengths = jnp.asarray([n, n])
    index = sel.select(LAYER, jnp.asarray(q), sel.prepare(LAYER, K, lengths), lengths)
    assert index.shape == (B * H_KV, 2)
    for b in range(B):
        assert int(index[b * H_KV + 0, 0]) == 7
        np.testing.assert_array_equal(np.asarray(index[b * H_KV + 1]), [13, 29])


def test_dense_layers_use_every_token():
    n = 20
    K = random_kv(n)
    lengths = jnp.asarray([20, 12])
    for name in ["oracle", "streamingllm", "sequential", "random", "quest"]:
        sel = get_selector(name)
        meta = sel.prepare(0, K, lengths)
        for layer in (0, 1):
            sets = rows_as_sets(sel.select(layer, jnp.ones((B, H, D)), meta, lengths))
            assert sets == [set(range(20))] * H_KV + [set(range(12))] * H_KV


def test_streamingllm_is_exactly_sinks_plus_window():
    n_cap = 64
    sel = get_selector("streamingllm", max_ratio=0.2, sinks=4)
    lengths = jnp.asarray([50, 64])
    meta = sel.prepare(LAYER, random_kv(n_cap), lengths)
    sets = rows_as_sets(sel.select(LAYER, jnp.ones((B, H, D)), meta, lengths))
    # 50 tokens -> budget 10 = 4 sinks + last 6; 64 -> 13 = 4 sinks + last 9.
    assert sets[0] == sets[1] == set(range(4)) | set(range(44, 50))
    assert sets[2] == sets[3] == set(range(4)) | set(range(55, 64))


def test_sequential_and_random():
    n_cap = 30
    lengths = jnp.asarray([30, 25])
    K = random_kv(n_cap)
    seq = get_selector("sequential", max_ratio=0.2)
    sets = rows_as_sets(seq.select(LAYER, jnp.ones((B, H, D)), seq.prepare(LAYER, K, lengths), lengths))
    assert sets[0] == set(range(6)) and sets[2] == set(range(5))
    picks = []
    seeded = {0: get_selector("random", max_ratio=0.2, seed=0), 1: get_selector("random", max_ratio=0.2, seed=1)}
    for seed in (0, 0, 1):
        rnd = seeded[seed]
        index = rnd.select(LAYER, jnp.ones((B, H, D)), rnd.prepare(LAYER, K, lengths), lengths)
        picks.append(np.asarray(index))
        for row, length in zip(rows_as_sets(index), [30, 30, 25, 25]):
            assert len(row) == selection_budget(length, 0.2) and max(row) < length
    np.testing.assert_array_equal(picks[0], picks[1])
    assert not np.array_equal(picks[0], picks[2])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quest_page_bound_dominates_every_key(dtype):
    rng = np.random.default_rng(3)
    # Scales from tiny to past float16's range (65504): rounding and saturation must stay outward.
    scale = np.float32(10.0) ** rng.integers(-3, 6, size=(1, H_KV, 37, D))
    K = jnp.asarray((rng.normal(size=(1, H_KV, 37, D)) * scale).astype(np.float32))
    lengths = jnp.asarray([37])
    kmin, kmax = page_bounds(K, lengths, 16, dtype)
    assert kmin.shape == (1, H_KV, 3, D) and kmin.dtype == kmax.dtype == jnp.dtype(dtype)
    # The stored box contains every real key: min rounded down, max rounded up.
    k64 = np.asarray(K, np.float64)
    lo, hi = np.asarray(kmin, np.float64), np.asarray(kmax, np.float64)
    for page in range(3):
        keys = k64[:, :, page * 16:min(37, page * 16 + 16)]
        assert np.all(lo[:, :, page] <= keys.min(2)) and np.all(hi[:, :, page] >= keys.max(2))
    for trial in range(6):
        q = rng.normal(size=(1, H_KV, 2, D)).astype(np.float32)
        q[..., trial % D] = 0.0  # a zero channel against a saturated bound must not give NaN
        bound = np.asarray(page_upper_bound(jnp.asarray(q), kmin, kmax))  # [1, H_kv, 2, P]
        assert not np.isnan(bound).any()
        exact = np.einsum("bhgd,bhnd->bhgn", q.astype(np.float64), k64)
        for page in range(3):
            true_max = exact[..., page * 16:min(37, page * 16 + 16)].max(-1)
            assert np.all(bound[..., page] >= true_max - 1e-5 * np.abs(true_max).clip(1))


def test_quest_float16_bound_matches_float32_and_halves_the_bytes():
    rng = np.random.default_rng(5)
    K = jnp.asarray(rng.normal(size=(B, H_KV, 64, D)).astype(np.float32))
    lengths = jnp.asarray([64, 50])
    wide = get_selector("quest", metadata_dtype="float32")
    half = get_selector("quest", metadata_dtype="float16")
    m32, m16 = wide.prepare(LAYER, K, lengths), half.prepare(LAYER, K, lengths)
    assert m16["kmin"].dtype == m16["kmax"].dtype == jnp.float16
    assert m16["kmin"].nbytes * 2 == m32["kmin"].nbytes
    # Outward rounding loosens each channel by at most one float16 ulp (2^-10 relative).
    for name, sign in (("kmin", -1), ("kmax", 1)):
        a, b = np.asarray(m32[name]), np.asarray(m16[name], np.float32)
        real = np.isfinite(a)
        np.testing.assert_array_equal(np.isfinite(b), real)
        assert np.all(sign * (b[real] - a[real]) >= 0)
        np.testing.assert_allclose(b[real], a[real], rtol=2 ** -10, atol=2 ** -24)
    q = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
    for length in (jnp.asarray([64, 50]), jnp.asarray([30, 7])):
        agree = [len(a & b) / len(a) for a, b in zip(rows_as_sets(wide.select(LAYER, q, m32, length)),
                                                      rows_as_sets(half.select(LAYER, q, m16, length)))]
        assert np.mean(agree) >= 0.9, agree


def test_infinigen_float16_partial_keys_select_like_float32():
    rng = np.random.default_rng(6)
    queries = rng.normal(size=(64, H, D)).astype(np.float32)
    keys = rng.normal(size=(100, H_KV, D)).astype(np.float32)
    skew = np.stack([fit_skew(queries, keys, 0.5)] * 8)
    K = rng.normal(size=(B, H_KV, 80, D)).astype(np.float32)
    lengths = jnp.asarray([80, 61])
    wide = get_selector("infinigen", skew=skew, speculate=False, metadata_dtype="float32")
    half = get_selector("infinigen", skew=skew, speculate=False)  # float16 by default
    m32, m16 = wide.prepare(LAYER, K, lengths), half.prepare(LAYER, K, lengths)
    assert m16.dtype == jnp.float16 and m16.nbytes * 2 == m32.nbytes
    # Round to nearest: half an ulp (2^-11 relative).
    np.testing.assert_allclose(np.asarray(m16, np.float32), np.asarray(m32), rtol=2 ** -11, atol=2 ** -25)
    huge = K.copy()
    huge[:, :, 3, :] *= 1e6  # beyond float16's range: saturates to 65504 instead of inf
    saturated = np.asarray(half.prepare(LAYER, huge, lengths))
    assert np.isfinite(saturated).all() and np.abs(saturated).max() == 65504
    q = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
    got, want = rows_as_sets(half.select(LAYER, q, m16, lengths)), rows_as_sets(wide.select(LAYER, q, m32, lengths))
    assert np.mean([len(a & b) / max(1, len(b)) for a, b in zip(got, want)]) >= 0.9
    with pytest.raises(ValueError, match="metadata_dtype='int8' must be one of"):
        get_selector("infinigen", skew=skew, metadata_dtype="int8")
    with pytest.raises(ValueError, match="metadata_dtype='float64' must be one of"):
        get_selector("quest", metadata_dtype="float64")


def planted_case(n_cap: int, seed: int, token: int):
    """Small random keys K: [B, H_kv, n_cap, D] with one planted token whose channel 0 is large, and
    a query q: [B, H, D] that reads channel 0, so the planted token has the top score everywhere."""
    K = random_kv(n_cap, seed=seed) * 0.1
    K[:, :, token, 0] = 6.0
    q = np.zeros((B, H, D), np.float32)
    q[:, :, 0] = 1.0
    return K, q


def test_quest_selects_the_page_of_the_planted_token_and_skips_padding():
    n_cap = 64
    K, q = planted_case(n_cap, seed=1, token=21)
    lengths = jnp.asarray([64, 56])
    sel = get_selector("quest", max_ratio=0.4, page_size=16, **NO_KEEP)
    index = sel.select(LAYER, jnp.asarray(q), sel.prepare(LAYER, K, lengths), lengths)
    assert_prefix_valid(index)
    sets = rows_as_sets(index)
    # Budget 26 (resp. 23) tokens -> two pages: the one holding 21 and the last page, which
    # request 1 fills only up to 55 (padding 56..63 is not selected).
    assert sets[0] == set(range(16, 32)) | set(range(48, 64))
    assert sets[2] == set(range(16, 32)) | set(range(48, 56))
    # Without the last-page rule the second page is the next-best bound instead.
    ranked = get_selector("quest", max_ratio=0.4, page_size=16, keep_last_page=False, **NO_KEEP)
    sets = rows_as_sets(ranked.select(LAYER, jnp.asarray(q), ranked.prepare(LAYER, K, lengths), lengths))
    assert set(range(16, 32)) <= sets[0] and len(sets[0]) == 32


def test_quest_always_keeps_the_newest_page():
    # Quest's implementation ranks the full pages and always attends the last one: a query
    # that bounds the last page lowest (its keys point away) must still get it, and with a
    # one-page budget it gets only that page.
    n_cap = 64
    K, q = planted_case(n_cap, seed=2, token=5)
    K[:, :, 32:49, 0] = -6.0
    lengths = jnp.asarray([48, 37])
    one_page = get_selector("quest", max_ratio=0.2, page_size=16, **NO_KEEP)
    sets = rows_as_sets(one_page.select(LAYER, jnp.asarray(q), one_page.prepare(LAYER, K, lengths), lengths))
    assert sets[0] == set(range(32, 48)) and sets[2] == set(range(32, 37))
    two_pages = get_selector("quest", max_ratio=0.5, page_size=16, **NO_KEEP)
    meta = two_pages.prepare(LAYER, K, lengths)
    sets = rows_as_sets(two_pages.select(LAYER, jnp.asarray(q), meta, lengths))
    assert sets[0] == set(range(0, 16)) | set(range(32, 48))
    # The rule follows the sequence end: request 0's next token opens page 3 (token 48 alone).
    meta = two_pages.append(LAYER, meta, jnp.asarray(K[:, :, 48]), jnp.asarray([48, 37]))
    sets = rows_as_sets(two_pages.select(LAYER, jnp.asarray(q), meta, jnp.asarray([49, 38])))
    assert sets[0] == set(range(0, 16)) | {48}
    assert sets[2] == set(range(0, 16)) | set(range(32, 38))


def test_hata_identical_vectors_have_hamming_distance_zero():
    rng = np.random.default_rng(0)
    projection = jnp.asarray(rng.normal(size=(H_KV, D, 256)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(5, H_KV, D)).astype(np.float32))
    codes = hash_codes(x, projection)
    assert codes.dtype == jnp.uint32 and codes.shape == (5, H_KV, 8)
    np.testing.assert_array_equal(np.asarray(hamming_similarity(codes, codes, 256)), 256)
    np.testing.assert_array_equal(np.asarray(hamming_similarity(codes, ~codes, 256)), 0)
    # Packing: bit j of word w is sign bit 32*w + j of the projection.
    bits = np.asarray(jnp.einsum("nhd,hdb->nhb", x, projection) > 0)
    unpacked = (np.asarray(codes)[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(unpacked.reshape(5, H_KV, 256), bits)


def test_hata_selects_the_key_equal_to_the_query():
    rng = np.random.default_rng(1)
    n = 50
    K = rng.normal(size=(1, H_KV, n, D)).astype(np.float32)
    q = rng.normal(size=(1, H, D)).astype(np.float32)
    K[0, 0, 21] = q[0, 0] * 3  # same direction -> identical code
    K[0, 1, 8] = q[0, 3]
    projection = rng.normal(size=(8, H_KV, D, 256)).astype(np.float32)
    sel = get_selector("hata", max_ratio=0.02, projection=projection, **NO_KEEP)  # budget 1
    lengths = jnp.asarray([n])
    index = np.asarray(sel.select(LAYER, jnp.asarray(q), sel.prepare(LAYER, K, lengths), lengths))
    assert index[0, 0] == 21 and index[1, 0] == 8


def test_infinigen_skew_is_orthonormal_and_threshold_keeps_close_tokens():
    rng = np.random.default_rng(2)
    queries = rng.normal(size=(64, H, D)).astype(np.float32) * np.linspace(3, 0.1, D)
    keys = rng.normal(size=(100, H_KV, D)).astype(np.float32)
    skew = fit_skew(queries, keys, 0.3)
    assert skew.shape == (H_KV, D, math.ceil(0.3 * D))
    for h in range(H_KV):
        np.testing.assert_allclose(skew[h].T @ skew[h], np.eye(skew.shape[2]), atol=1e-5)
    # Full rank (partial_ratio 1): partial scores are exact; plant three tokens within alpha of max.
    full = np.stack([fit_skew(queries, keys, 1.0)] * 8)
    n = 40
    K = np.zeros((1, H_KV, n, D), np.float32)
    q = np.zeros((1, H, D), np.float32)
    q[0, :, 0] = 1.0
    scale = math.sqrt(D)
    for token, score in [(5, 30.0), (9, 27.0), (20, 26.0), (30, 20.0)]:
        K[0, :, token, 0] = score * scale
    lengths = jnp.asarray([n])
    sel = get_selector("infinigen", max_ratio=0.5, alpha=5.0, skew=full, speculate=False, **NO_KEEP)
    sets = rows_as_sets(sel.select(LAYER, jnp.asarray(q), sel.prepare(LAYER, K, lengths), lengths))
    assert sets == [{5, 9, 20}] * H_KV  # 30 - 5 = 25 < 26, 27; token 30 (20) and the zeros fail
    # The fetch count is averaged over KV heads: head 1 has only token 5 within alpha -> (3 + 1) / 2 = 2.
    K[0, 1, 9, 0] = K[0, 1, 20, 0] = 10.0 * scale
    sets = rows_as_sets(sel.select(LAYER, jnp.asarray(q), sel.prepare(LAYER, K, lengths), lengths))
    assert sets == [{5, 9}, {5, 30}]
    K[0, 1] = K[0, 0]
    capped = get_selector("infinigen", max_ratio=0.05, alpha=5.0, skew=full, **NO_KEEP)  # budget 2
    sets = rows_as_sets(capped.select(LAYER, jnp.asarray(q), capped.prepare(LAYER, K, lengths), lengths))
    assert sets == [{5, 9}] * H_KV


@pytest.mark.parametrize("name", ["oracle", "quest", "hata", "infinigen", "streamingllm"])
def test_append_matches_prepare_on_the_longer_sequence(name):
    rng = np.random.default_rng(4)
    n_cap = 40
    K = rng.normal(size=(B, H_KV, n_cap, D)).astype(np.float32)
    extra = {"hata": {"projection": rng.normal(size=(8, H_KV, D, 64)).astype(np.float32), "bits": 64},
             "infinigen": {"skew": np.stack([fit_skew(rng.normal(size=(16, H, D)), K[0].transpose(1, 0, 2), 0.3)] * 8)}}
    # Quest's int8 grid is the prompt's (module docstring), so appending matches a fresh prepare
    # only for its float storage; test_quest_int8.py checks the int8 append bounds every key.
    extra["quest"] = {"metadata_dtype": "float16"}
    sel = get_selector(name, **extra.get(name, {}))
    short, positions = jnp.asarray([20, 33]), jnp.asarray([20, 33])
    meta = sel.append(LAYER, sel.prepare(LAYER, K, short), jnp.asarray(K[np.arange(B), :, [20, 33]]), positions)
    reference = sel.prepare(LAYER, K, short + 1)
    for got, want in zip(jax.tree.leaves(meta), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    q = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
    index = sel.select(LAYER, q, meta, short + 1)
    assert_prefix_valid(index)
    for row, length in zip(rows_as_sets(index), [21, 21, 34, 34]):
        assert row and max(row) < length


def test_bad_inputs_have_clear_errors():
    with pytest.raises(ValueError, match="valid names: dense, hata, infinigen, oracle, quest, random, sequential, streamingllm"):
        get_selector("h2o")
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
            get_selector("oracle", max_ratio=bad)
    with pytest.raises(ValueError, match="jkv train-hata"):
        get_selector("hata")
    with pytest.raises(ValueError, match="calibration"):
        get_selector("infinigen")
    with pytest.raises(ValueError, match="unknown option.*page_size"):
        get_selector("oracle", page_size=16)
    with pytest.raises(ValueError, match="K must be"):
        get_selector("oracle").prepare(LAYER, np.zeros((2, 3, 4)), jnp.asarray([1, 1]))


def test_reduce_group_mass_max_sum_by_hand():
    from jkv.selection.base import reduce_group

    # One KV head, two query heads, three tokens. Head 0 puts ln(3) more logit on token 0,
    # head 1 on token 2: per-head softmax [3/5, 1/5, 1/5] and [1/5, 1/5, 3/5].
    s = jnp.asarray([[[[math.log(3.0), 0.0, 0.0], [0.0, 0.0, math.log(3.0)]]]], jnp.float32)
    np.testing.assert_allclose(np.asarray(reduce_group(s, "mass"))[0, 0], [0.8, 0.4, 0.8], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(reduce_group(s, "max"))[0, 0], [0.0, -math.log(3.0), 0.0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(reduce_group(s, "sum"))[0, 0], [math.log(3.0), 0.0, math.log(3.0)],
                               rtol=1e-6)
    # 'sum' of raw scores lets one head with a large spread outvote the other: mass does not.
    t = jnp.asarray([[[[10.0, 9.0, 0.0], [0.0, 0.0, 3.0]]]], jnp.float32)
    # masses: head 0 [0.731, 0.269, 0.000], head 1 [0.045, 0.045, 0.909] -> top 2 are {0, 2}.
    assert set(np.argsort(-np.asarray(reduce_group(t, "sum"))[0, 0])[:2].tolist()) == {0, 1}
    assert set(np.argsort(-np.asarray(reduce_group(t, "mass"))[0, 0])[:2].tolist()) == {0, 2}
    with pytest.raises(ValueError, match="group_score='mean' must be one of"):
        get_selector("oracle", group_score="mean")


@pytest.mark.parametrize("name", ["oracle", "hata", "infinigen"])
def test_sinks_and_recent_window_are_kept_inside_the_budget(name):
    rng = np.random.default_rng(7)
    n_cap = 60
    K = rng.normal(size=(B, H_KV, n_cap, D)).astype(np.float32)
    extra = {"hata": {"projection": rng.normal(size=(8, H_KV, D, 64)).astype(np.float32), "bits": 64},
             "infinigen": {"skew": np.stack([fit_skew(rng.normal(size=(16, H, D)), K[0].transpose(1, 0, 2), 1.0)] * 8),
                           "alpha": math.inf, "speculate": False}}.get(name, {})
    lengths = jnp.asarray([60, 41])
    q = jnp.asarray(rng.normal(size=(B, H, D)).astype(np.float32))
    plain = get_selector(name, max_ratio=0.25, **NO_KEEP, **extra)
    kept = get_selector(name, max_ratio=0.25, keep_sinks=2, keep_recent=3, **extra)
    base_sets = rows_as_sets(plain.select(LAYER, q, plain.prepare(LAYER, K, lengths), lengths))
    index = kept.select(LAYER, q, kept.prepare(LAYER, K, lengths), lengths)
    assert_prefix_valid(index)
    for row, base, length in zip(rows_as_sets(index), base_sets, [60, 60, 41, 41]):
        protected = {0, 1, length - 3, length - 2, length - 1}
        assert protected <= row  # always kept ...
        assert len(row) == len(base) == selection_budget(length, 0.25)  # ... inside the same budget
        # the rest of the budget is the selector's own top choices
        assert row - protected <= base
    with pytest.raises(ValueError, match="keep_recent=-1 must be an int >= 0"):
        get_selector("oracle", keep_recent=-1)


def test_quest_keeps_the_pages_of_sinks_and_recent_tokens():
    n_cap = 64
    K, q = planted_case(n_cap, seed=8, token=30)
    lengths = jnp.asarray([64, 50])
    sel = get_selector("quest", max_ratio=0.25, page_size=4, keep_sinks=1, keep_recent=6, group_score="mass")
    sets = rows_as_sets(sel.select(LAYER, jnp.asarray(q), sel.prepare(LAYER, K, lengths), lengths))
    # Budget 16 tokens (13 for 50) = 4 pages: page 0 (sink), the page of token 30, and the pages
    # of the newest 6 tokens (58..63 -> pages 14, 15; 44..49 -> pages 11, 12).
    assert sets[0] == set(range(0, 4)) | set(range(28, 32)) | set(range(56, 64))
    assert sets[2] == set(range(0, 4)) | set(range(28, 32)) | set(range(44, 50))
