"""Quantizers: error bounds per bit width and axis, KIVI/MixHQ/mixed plans, layouts, exact cases."""
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.compression import quantizers
from jkv.compression.quantizers import QuantPlan, dequantize, make_plan, quantize, section_layout
from jkv.compression.spec import QuantizerSpec


def _round_trip(x, plan):
    # Eager (op-by-op) on purpose: one jit per plan would compile more than these tests compute.
    sections = quantize(jnp.asarray(x, jnp.float32), plan, np.float16)
    layout = section_layout(plan, x.shape, np.float16)
    assert {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in sections.items()} == layout
    return np.asarray(dequantize(sections, plan, x.shape)), sections


def _group_ranges(x, axis, group):
    """Per-element (max - min) of its quantization group, float32 [H, N, D]."""
    t = x if axis == "token" else np.swapaxes(x, 1, 2)
    length = t.shape[2]
    g = min(group, length)
    padded = -(-length // g) * g
    t = np.pad(t, ((0, 0), (0, 0), (0, padded - length)), mode="edge").reshape(t.shape[0], t.shape[1], -1, g)
    rng = np.repeat(t.max(-1) - t.min(-1), g, axis=-1)[:, :, :length]
    return rng if axis == "token" else np.swapaxes(rng, 1, 2)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_error_bound_per_bit_width(block, axis, bits):
    x = block.astype(np.float32)
    plan = QuantPlan((bits,) * x.shape[0], axis, 32)
    x_hat, _ = _round_trip(x, plan)
    ranges = _group_ranges(x, axis, 32)
    # |x - x_hat| <= scale/2, scale = range/(2^b-1) stored in float16; plus float16 rounding of zero.
    bound = 0.5 * ranges / ((1 << bits) - 1) * (1 + 2e-3) + np.abs(x).max() * 2**-10
    assert np.all(np.abs(x - x_hat) <= bound)
    # The bound is not vacuous: lower bit widths really do lose more.
    assert np.abs(x - x_hat).mean() > 0.05 * bound.mean()


def test_error_shrinks_with_bits(block):
    x = block.astype(np.float32)
    errs = [np.abs(x - _round_trip(x, QuantPlan((b,) * 3, "token", 32))[0]).mean() for b in (1, 2, 3, 4, 8)]
    assert all(a > 1.7 * b for a, b in zip(errs, errs[1:]))


def test_constant_groups_are_exact_and_raw_heads_are_lossless():
    x = np.full((3, 40, 64), 3.25, np.float32)
    x_hat, _ = _round_trip(x, QuantPlan((2, 2, 2), "channel", 32))
    np.testing.assert_array_equal(x_hat, x)
    rng = np.random.default_rng(1)
    y = rng.standard_normal((3, 40, 64)).astype(np.float16).astype(np.float32)
    y_hat, _ = _round_trip(y, QuantPlan((16, 16, 16), "token", 32))
    np.testing.assert_array_equal(y_hat, y)


def test_mixed_heads_keep_their_own_precision(block):
    x = block.astype(np.float32)
    plan = QuantPlan((2, 16, 8), "token", 32)
    x_hat, sections = _round_trip(x, plan)
    assert set(sections) == {"q2.codes", "q2.scale", "q2.zero", "raw", "q8.codes", "q8.scale", "q8.zero"}
    np.testing.assert_array_equal(x_hat[1], block[1].astype(np.float32))
    per_head = [np.abs(x[h] - x_hat[h]).mean() for h in range(3)]
    assert per_head[0] > 10 * per_head[2] > 0
    # Heads come back in order even when bit groups are not monotone in the head index: per-token
    # groups never span heads, so each head equals its counterpart under a uniform plan.
    for h, b in ((0, 2), (2, 8)):
        np.testing.assert_array_equal(x_hat[h], _round_trip(x, QuantPlan((b,) * 3, "token", 32))[0][h])


def test_kivi_quantizes_keys_per_channel_and_values_per_token():
    spec = QuantizerSpec("kivi", 2, 32)
    assert make_plan(spec, 0, "k", 3) == QuantPlan((2, 2, 2), "channel", 32)
    assert make_plan(spec, 0, "v", 3) == QuantPlan((2, 2, 2), "token", 32)
    assert make_plan(QuantizerSpec("tok", 4, 16), 5, "k", 2) == QuantPlan((4, 4), "token", 16)
    assert make_plan(QuantizerSpec("ch", 4, 16), 5, "v", 2) == QuantPlan((4, 4), "channel", 16)
    assert make_plan(QuantizerSpec(), 0, "v", 2).head_bits == (16, 16)


def test_per_channel_suits_keys_with_outlier_channels(block):
    """Why KIVI quantizes K per channel: with channel-scale outliers per-channel error is lower."""
    x = block.astype(np.float32)
    tok = np.abs(x - _round_trip(x, QuantPlan((2,) * 3, "token", 32))[0]).mean()
    ch = np.abs(x - _round_trip(x, QuantPlan((2,) * 3, "channel", 32))[0]).mean()
    assert ch < tok


def test_mixed_table_and_mixhq_plans():
    mixed = QuantizerSpec("mixed", 16, 32, table=((8, 2), (4, 16)))
    assert make_plan(mixed, 1, "k", 2) == QuantPlan((4, 16), "channel", 32)
    with pytest.raises(ValueError, match="outside the mixed bits table"):
        make_plan(mixed, 2, "k", 2)
    with pytest.raises(ValueError, match="has 2 heads"):
        make_plan(mixed, 0, "k", 3)
    mixhq = QuantizerSpec("mixhq", 8, 32, low_bits=2, retrieval_pct=25)
    scores = np.array([[0.9, 0.1], [0.2, 0.3]])
    retrieval = quantizers.mixhq_retrieval_heads(mixhq, scores)
    np.testing.assert_array_equal(retrieval, [[True, False], [False, False]])
    assert make_plan(mixhq, 0, "v", 2, retrieval) == QuantPlan((8, 2), "token", 32)
    assert make_plan(mixhq, 1, "k", 2, retrieval) == QuantPlan((2, 2), "channel", 32)
    with pytest.raises(ValueError, match="MixHQ needs retrieval_heads"):
        make_plan(mixhq, 0, "k", 2)


@pytest.mark.parametrize("kwargs", [dict(method="tok", bits=5, group=32), dict(method="tok", bits=4, group=0),
                                    dict(method="mixhq", bits=8, group=32, low_bits=16, retrieval_pct=10),
                                    dict(method="mixhq", bits=8, group=32, low_bits=2, retrieval_pct=101),
                                    dict(method="mixed", bits=16, group=32, table=((8, 5),)),
                                    dict(method="none", bits=4), dict(method="ch", bits=4, group=8, low_bits=2)])
def test_quantizer_spec_validation(kwargs):
    with pytest.raises(ValueError):
        QuantizerSpec(**kwargs)


def test_plan_validation():
    with pytest.raises(ValueError, match="unsupported"):
        QuantPlan((5,))
    with pytest.raises(ValueError, match="axis"):
        QuantPlan((4,), "head")
    with pytest.raises(ValueError, match="covers 2 heads"):
        section_layout(QuantPlan((4, 4)), (3, 8, 8), np.float16)
