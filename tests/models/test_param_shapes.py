"""`param_shapes` (the tree the loader restores weights into) is `init_params`'s tree, traced for
one layer only."""
import jax
import pytest

from models import tiny_config
from models.transformer import init_params, param_shapes


@pytest.mark.parametrize("family, overrides", [
    ("llama", dict(num_layers=4)),  # tied embeddings: no lm_head
    ("qwen2", dict(tie_word_embeddings=False, num_layers=5, num_heads=8, num_kv_heads=4)),  # q/k/v biases
    ("qwen3", dict(num_layers=2, dtype="bfloat16")),  # q/k norms
    ("llama", dict(num_layers=3, qkv_bias=True, o_bias=True, mlp_bias=True)),
])
def test_param_shapes_are_the_shapes_of_every_layer_init_params_makes(family, overrides):
    cfg = tiny_config(family, **overrides)
    fast = param_shapes(cfg)
    full = jax.eval_shape(lambda: init_params(cfg, 0))
    assert jax.tree_util.tree_structure(fast) == jax.tree_util.tree_structure(full)
    assert len(fast["layers"]) == cfg.num_layers
    assert jax.tree_util.tree_leaves(fast) == jax.tree_util.tree_leaves(full)  # shape and dtype per leaf
