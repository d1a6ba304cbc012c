"""HATA training on a tiny model's calibration data; orbax save/load of the weights."""
import argparse

import numpy as np
import pytest

from tests.selection.tiny import shared_tiny_model

from jkv.selection import get_selector
from jkv.selection.calibration import collect_calibration
from jkv.selection.hata import load_weights, save_weights
from jkv.selection.hata_train import (HATATrainConfig, add_parser, init_projection, recall_at_k, train_projection,
                                     train_projection_windows)


@pytest.fixture(scope="module")
def calibration():
    model = shared_tiny_model()
    rng = np.random.default_rng(1)
    return collect_calibration(model, list(rng.integers(3, 301, size=160)), 128, 32)


@pytest.mark.parametrize("target", ["topk", "attention"])
def test_training_reduces_loss_and_improves_recall_over_random_projection(calibration, tmp_path, target):
    train, held_out = calibration.split(0.75)
    config = HATATrainConfig(bits=64, train_steps=100, learning_rate=1e-2, target=target)
    initial = init_projection(train, config.bits, config.seed)
    projection, losses = train_projection(train, config, initial)
    assert projection.shape == (4, 2, 16, 64)
    # The attention target's cross-entropy has the attention entropy as its floor, so only a
    # small part of it can go (the KL above the floor): its bar is lower.
    assert losses[-1] < (0.95 if target == "topk" else 0.99) * losses[0], (losses[0], losses[-1])
    sparse_layers = range(2, 4)
    before = recall_at_k(initial, held_out, layers=sparse_layers)
    after = recall_at_k(projection, held_out, layers=sparse_layers)
    assert after > before + 0.02, (before, after)

    save_weights(str(tmp_path / "hata"), projection, {"recall_trained": after})
    restored, info = load_weights(str(tmp_path / "hata"))
    np.testing.assert_array_equal(restored, projection)
    assert info["recall_trained"] == after
    selector = get_selector("hata", bits=64, weights_path=str(tmp_path / "hata"))
    np.testing.assert_array_equal(np.asarray(selector.layer_state(3)), projection[3])


def test_training_on_windows_chains_them_in_order(monkeypatch):
    # train_projection itself is exercised above; here only the chaining: each window starts
    # from the previous window's projection, and the losses of all windows are concatenated.
    from jkv.selection import hata_train

    calls = []

    def fake_train(calibration, config, projection=None):
        calls.append((calibration, None if projection is None else projection.copy()))
        start = np.zeros(2) if projection is None else projection
        return start + calibration, [float(calibration)] * config.train_steps

    monkeypatch.setattr(hata_train, "train_projection", fake_train)
    config = HATATrainConfig(bits=32, train_steps=2)
    projection, losses = train_projection_windows([1.0, 10.0, 100.0], config)
    np.testing.assert_array_equal(projection, [111.0, 111.0])
    assert [c for c, _ in calls] == [1.0, 10.0, 100.0] and calls[0][1] is None
    np.testing.assert_array_equal(calls[2][1], [11.0, 11.0])
    assert losses == [1.0, 1.0, 10.0, 10.0, 100.0, 100.0]
    with pytest.raises(ValueError, match="at least one"):
        train_projection_windows([], config)


def test_missing_weights_say_how_to_train(tmp_path):
    with pytest.raises(FileNotFoundError, match="jkv train-hata"):
        get_selector("hata", weights_path=str(tmp_path))


def test_cli_parser_and_config_validation():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train-hata", "--out", "/tmp/x", "--train-steps", "5"])
    assert args.train_steps == 5 and args.bits == 256 and args.windows == 4 and callable(args.func)
    with pytest.raises(ValueError, match="multiple of 32"):
        HATATrainConfig(bits=48)
    with pytest.raises(ValueError, match="target='mse' must be"):
        HATATrainConfig(target="mse")


def test_interleaved_training_is_one_adam_run_visiting_windows_in_rotation(monkeypatch):
    # Windows of different lengths (N keys) so each step's window can be told by its key count.
    from jkv.selection import hata_train

    model = shared_tiny_model()
    rng = np.random.default_rng(4)
    a = collect_calibration(model, list(rng.integers(3, 301, size=40)), 32, 8)
    b = collect_calibration(model, list(rng.integers(3, 301, size=60)), 48, 12)
    real_trainer = hata_train._trainer
    inits, seen = [], []

    def recording_trainer(config):
        init, step = real_trainer(config)

        def recording_init(projection):
            inits.append(projection)
            return init(projection)

        def recording_step(params, state, rng, queries, positions, keys):
            seen.append(keys.shape[2])
            return step(params, state, rng, queries, positions, keys)

        return recording_init, recording_step

    monkeypatch.setattr(hata_train, "_trainer", recording_trainer)
    config = HATATrainConfig(bits=32, train_steps=3, key_sample=0, query_sample=0)
    projection, losses = train_projection_windows([a, b], config, interleave=True)
    assert len(inits) == 1  # one optimizer state over all windows, not one per window
    assert seen == [40, 60] * 3 and len(losses) == 6
    assert projection.shape == (4, 2, 16, 32)


def test_interleaved_training_on_one_window_is_plain_training(calibration):
    config = HATATrainConfig(bits=32, train_steps=5)
    initial = init_projection(calibration, config.bits, config.seed)
    alone, alone_losses = train_projection(calibration, config, initial)
    rotated, rotated_losses = train_projection_windows([calibration], config, initial, interleave=True)
    np.testing.assert_array_equal(alone, rotated)
    assert alone_losses == rotated_losses


def test_interleaved_training_improves_recall_on_every_window():
    model = shared_tiny_model()
    rng = np.random.default_rng(5)
    windows = [collect_calibration(model, list(rng.integers(3, 301, size=n)), n - 32, 32) for n in (120, 200)]
    splits = [w.split(0.75) for w in windows]
    config = HATATrainConfig(bits=64, train_steps=60, learning_rate=1e-2)
    initial = init_projection(splits[0][0], config.bits, config.seed)
    projection, _ = train_projection_windows([train for train, _ in splits], config, initial, interleave=True)
    for _, held_out in splits:
        before = recall_at_k(initial, held_out, layers=range(2, 4))
        after = recall_at_k(projection, held_out, layers=range(2, 4))
        assert after > before + 0.02, (before, after)
