"""Transforms: exact invertibility (up to float32 rounding), Hadamard orthonormality, fitted affine."""
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.compression import transforms
from jkv.compression.spec import TransformSpec

SPECS = [TransformSpec("identity"), TransformSpec("hadamard"), TransformSpec("delta", 8), TransformSpec("affine")]


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 128])
def test_hadamard_is_orthonormal_and_symmetric(d):
    h = transforms.hadamard_matrix(d).astype(np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(d), rtol=1e-6)


@pytest.mark.parametrize("d", [0, 3, 48, 96])
def test_hadamard_rejects_non_power_of_two(d):
    with pytest.raises(ValueError, match="power-of-two head dim"):
        transforms.hadamard_matrix(d)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_forward_inverse_round_trip(spec, block):
    x = jnp.asarray(block, jnp.float32)
    inputs = transforms.fit_affine(block) if spec.name == "affine" else {}
    y, side = transforms.forward(spec, x, inputs, np.float16)
    layout = transforms.side_layout(spec, block.shape, np.float16)
    assert {k: (v.shape, np.dtype(v.dtype)) for k, v in side.items()} == layout
    back = np.asarray(transforms.inverse(spec, y, side))
    np.testing.assert_allclose(back, block.astype(np.float32), rtol=0, atol=2e-5 * np.abs(block).max())
    if spec.name == "identity":
        np.testing.assert_array_equal(back, block.astype(np.float32))


def test_hadamard_preserves_norms_and_spreads_outliers(block):
    x = np.zeros((1, 4, 64), np.float32)
    x[0, :, 5] = 100.0  # one outlier channel
    y = np.asarray(transforms.forward(TransformSpec("hadamard"), jnp.asarray(x), {}, np.float16)[0])
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.abs(y), 100.0 / 8.0, rtol=1e-5)  # spread evenly over 64 channels


def test_delta_anchor_rows_become_zero_and_anchors_are_stored(block):
    spec = TransformSpec("delta", 8)
    y, side = transforms.forward(spec, jnp.asarray(block, jnp.float32), {}, np.float16)
    np.testing.assert_array_equal(np.asarray(y)[:, ::8, :], 0.0)
    np.testing.assert_array_equal(np.asarray(side["delta.anchors"]), block[:, ::8, :])


def test_affine_fit_standardizes_calibration_channels(block):
    params = transforms.fit_affine(block)
    y = np.asarray(transforms.forward(TransformSpec("affine"), jnp.asarray(block, jnp.float32), params, np.float16)[0])
    np.testing.assert_allclose(y.mean(axis=1), 0.0, atol=1e-2)
    np.testing.assert_allclose(y.std(axis=1), 1.0, atol=1e-2)


def test_affine_fit_accepts_batched_calibration_and_floors_constant_channels():
    x = np.ones((2, 3, 10, 4), np.float32)
    params = transforms.fit_affine(x)
    assert params["affine.scale"].shape == (3, 4) and np.all(params["affine.scale"] > 0)


@pytest.mark.parametrize("bad", [np.zeros((3, 1, 4)), np.zeros((4, 4)), np.full((1, 3, 2), np.nan)])
def test_affine_fit_rejects_bad_calibration(bad):
    with pytest.raises(ValueError, match="affine calibration"):
        transforms.fit_affine(bad)


@pytest.mark.parametrize("bad", [dict(name="rotate"), dict(name="delta", group=1), dict(name="hadamard", group=4)])
def test_transform_spec_validation(bad):
    with pytest.raises(ValueError):
        TransformSpec(**bad)
