"""Entropy-coded uniform quantizer (`ec<S>g<G>`): error bound, clipping, rate control, ids, headers."""
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.compression import Pipeline, PipelineSpec, decode_block
from jkv.compression.pipeline import inspect_block
from jkv.compression.profiling import nominal_cr
from jkv.compression.quantizers import EC_CLIP, QuantPlan, dequantize, make_plan, quantize, section_layout
from jkv.compression.spec import QuantizerSpec, ec_bits_estimate

from .conftest import kv_like


def _ec_round_trip(x, plan):
    sections = quantize(jnp.asarray(x, jnp.float32), plan, np.float16)
    assert {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in sections.items()} == section_layout(plan, x.shape, np.float16)
    return np.asarray(dequantize(sections, plan, x.shape)), sections


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("step", [0.3, 1.0, 2.0])
def test_error_bound_and_scale_rule(block, axis, step):
    x = block.astype(np.float32)
    x[0, 5, 7] = 40.0  # an outlier: its group must widen its step instead of clipping
    plan = QuantPlan((4, 4, 4), axis, 32, step)
    x_hat, s = _ec_round_trip(x, plan)
    t = x if axis == "token" else np.swapaxes(x, 1, 2)
    n = t.shape[2]
    pad = -(-n // 32) * 32
    g = np.pad(t, ((0, 0), (0, 0), (0, pad - n)), mode="edge").reshape(3, t.shape[1], -1, 32)
    mean = g.mean(-1)
    want = np.maximum(step * g.std(-1), np.abs(g - mean[..., None]).max(-1) / (EC_CLIP - 0.49))
    np.testing.assert_allclose(np.asarray(s["q4.scale"], np.float32), want, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(s["q4.zero"], np.float32), mean, rtol=2e-3, atol=2e-3)
    scale = np.repeat(np.asarray(s["q4.scale"], np.float32), 32, -1)[..., :n]
    if axis == "channel":
        scale = np.swapaxes(scale, 1, 2)
    err = np.abs(x - x_hat)
    # |x - x_hat| <= scale/2 everywhere (nothing clipped), plus float16 rounding of the zero point
    assert np.all(err <= 0.5 * scale * (1 + 1e-3) + np.abs(x).max() * 2**-10)
    assert abs(x_hat[0, 5, 7] - 40.0) <= 0.5 * scale[0, 5, 7] * 1.001 + 40 * 2**-10
    assert err.mean() > 0.05 * (0.5 * scale).mean()  # not vacuous


def test_constant_groups_are_exact():
    x = np.full((3, 40, 64), -1.5, np.float32)
    x_hat, _ = _ec_round_trip(x, QuantPlan((4, 16, 4), "channel", 32, 0.5))
    np.testing.assert_array_equal(x_hat, x)


def test_step_controls_rate_and_error_through_the_codec():
    """A larger step: fewer container bytes (zstd entropy-codes the nibbles) and a larger error; the
    codec takes the 4-bit codes well below 4 bits/value, which a min-max 4-bit grid cannot."""
    x = kv_like(3, shape=(3, 128, 64))
    sizes, errs = [], []
    for step in (40, 80, 160):
        pipe = Pipeline(PipelineSpec.parse(f"hadamard+ec{step}g128+zstd3"))
        data = pipe.encode_block(x, layer=0, kind="k")
        y = np.asarray(decode_block(data), np.float32)
        sizes.append(len(data))
        errs.append(np.linalg.norm(y - x.astype(np.float32)) / np.linalg.norm(x.astype(np.float32)))
    assert sizes[0] > sizes[1] > sizes[2] and errs[0] < errs[1] < errs[2]
    info, _ = inspect_block(data)
    assert info.plan.step == pytest.approx(1.6) and info.plan.axis == "channel"
    nibble_bytes = x.size // 2
    assert sizes[2] < 0.6 * nibble_bytes  # ~2 bits/value of entropy at 1.6 std steps
    # Rate is what the codec gives: without one, the container holds the full nibbles.
    raw = Pipeline(PipelineSpec.parse("hadamard+ec160g128+none")).encode_block(x, layer=0, kind="k")
    assert len(raw) > nibble_bytes


def test_literal_heavy_zstd_entropy_codes_ec_nibbles_and_round_trips():
    """zstdh3 (min match 7) gets ec codes closer to their entropy than zstd3; frames decode the same."""
    x = np.random.default_rng(0).standard_normal((3, 128, 64)).astype(np.float32)
    sizes = {}
    for codec in ("zstd3", "zstdh3"):
        data = Pipeline(PipelineSpec.parse(f"hadamard+ec160g128+{codec}")).encode_block(x, layer=0, kind="k")
        sizes[codec] = len(data)
        np.testing.assert_array_equal(np.asarray(decode_block(data)), np.asarray(decode_block(
            Pipeline(PipelineSpec.parse("hadamard+ec160g128+none")).encode_block(x, layer=0, kind="k"))))
    assert sizes["zstdh3"] < 0.93 * sizes["zstd3"]
    assert PipelineSpec.parse("identity+none+zstdh9").codec.id == "zstdh9"


def test_spec_ids_plans_and_validation():
    spec = PipelineSpec.parse("hadamard+ec60g128+zstd3")
    assert spec.quantizer == QuantizerSpec("ec", 4, 128, step=60) and spec.id == "hadamard+ec60g128+zstd3"
    assert make_plan(spec.quantizer, 0, "k", 3) == QuantPlan((4, 4, 4), "channel", 128, 0.6)
    assert make_plan(spec.quantizer, 0, "v", 3).axis == "token"
    assert spec.quantizer.features()["ec_step"] == 60.0
    assert spec.quantizer.mean_bits() == pytest.approx(ec_bits_estimate(60)) and 2.5 < ec_bits_estimate(60) < 3.0
    for bad, match in ((dict(step=5), "ec self.step=5"), (dict(step=500), "must be in"), (dict(bits=2), "4-bit")):
        with pytest.raises(ValueError, match=match):
            QuantizerSpec("ec", bad.get("bits", 4), 32, step=bad.get("step", 50))
    with pytest.raises(ValueError, match="only applies to the ec"):
        QuantizerSpec("kivi", 2, 32, step=50)
    with pytest.raises(ValueError, match="must be 4 or 16"):
        QuantPlan((2, 4, 4), "token", 32, 0.5)
    with pytest.raises(ValueError, match="finite step"):
        QuantPlan((4, 4, 4), "token", 32, -1.0)
    # min-max plans keep their v1 header byte-identical (no "step" key)
    assert "step" not in QuantPlan((2, 2, 2)).to_header()
    assert QuantPlan.from_header(QuantPlan((4, 4), "channel", 64, 0.75).to_header()).step == 0.75


def test_nominal_cr_counts_ec_codes_at_the_entropy_estimate_only_behind_a_codec():
    shape = (3, 128, 64)
    with_codec = nominal_cr(PipelineSpec.parse("hadamard+ec100g128+zstd3"), shape)
    without = nominal_cr(PipelineSpec.parse("hadamard+ec100g128+none"), shape)
    assert without == pytest.approx(nominal_cr(PipelineSpec.parse("hadamard+kivi4g128+none"), shape))
    assert with_codec > 1.6 * without
