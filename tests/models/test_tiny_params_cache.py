"""`tiny_model`'s parameter files ($JKV_TINY_PARAMS_CACHE, set by tests/conftest.py for the whole
run): the second process to build a tiny model loads what the first initialised, bit for bit, in
float32 and bfloat16, and a damaged or missing file means an init, never wrong weights."""
import jax
import numpy as np
import pytest

from models import model as model_mod
from models import transformer as tfm
from models.model import TINY_PARAMS_CACHE_ENV, tiny_config, tiny_model


def _leaves(m):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(m.params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stored_params_load_bit_for_bit_without_an_init(tmp_path, monkeypatch, dtype):
    monkeypatch.delenv(TINY_PARAMS_CACHE_ENV, raising=False)
    reference = _leaves(tiny_model("qwen2", seed=3, dtype=dtype))
    monkeypatch.setenv(TINY_PARAMS_CACHE_ENV, str(tmp_path))
    first = _leaves(tiny_model("qwen2", seed=3, dtype=dtype))       # initialises and stores
    assert len(list(tmp_path.glob("tiny-*.npz"))) == 1
    concrete = []
    real_init = tfm.init_params

    def counting_init(cfg, seed=0):
        out = real_init(cfg, seed)
        if not isinstance(jax.tree_util.tree_leaves(out)[0], jax.core.Tracer):
            concrete.append(cfg)
        return out

    monkeypatch.setattr(model_mod.tfm, "init_params", counting_init)
    second = _leaves(tiny_model("qwen2", seed=3, dtype=dtype))      # loads
    assert concrete == []
    for a, b, c in zip(reference, first, second):
        assert a.dtype == b.dtype == c.dtype and a.tobytes() == b.tobytes() == c.tobytes()
    other = _leaves(tiny_model("qwen2", seed=4, dtype=dtype))       # another seed: another file
    assert len(concrete) == 1 and len(list(tmp_path.glob("tiny-*.npz"))) == 2
    assert any(a.tobytes() != b.tobytes() for a, b in zip(reference, other))


def test_a_damaged_file_means_an_init(tmp_path, monkeypatch):
    monkeypatch.setenv(TINY_PARAMS_CACHE_ENV, str(tmp_path))
    good = _leaves(tiny_model("llama"))
    path, = tmp_path.glob("tiny-*.npz")
    path.write_bytes(path.read_bytes()[:100])                          # cut short
    again = _leaves(tiny_model("llama"))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(good, again))
    assert tiny_config("llama") == tiny_model("llama").cfg
