"""Oracle with the "sum" group score selects by the fused top-k kernel on a kernel backend
(`dispatch.topk_select_fused`, jkv/selection/base.py `sum_index`) and by its own jnp scores +
top-k under "xla": the two give the same indices bit for bit (interpret mode on CPU).

Inputs are small integers, so every dot is exact in f32 whatever the summation order (the kernel
sums the group's queries first, the jnp path sums G per-head scores): any difference in the
indices is a difference in the selection, not rounding. Ties are plentiful.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.selection.simple import Oracle, OracleConfig
from pallas_kernels import dispatch

B, H_KV, G, D, N_CAP = 3, 2, 3, 16, 300  # GQA group 3; N_cap not a multiple of any chunk


def _select(backend: str, config: OracleConfig, q, K, lengths, dropped=None):
    """Oracle select of a fresh selector under `backend` (read at trace time, jitted afresh)."""
    selector = Oracle(config)
    with dispatch.backend(backend):
        fn = jax.jit(lambda q, K, n, d: selector._select_budgeted(None, q, K, n, d))
        traced = str(jax.make_jaxpr(fn)(q, K, lengths, dropped))  # the Pallas calls name their kernels
        return np.asarray(fn(q, K, lengths, dropped)), traced


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.integers(-2, 3, (B, H_KV * G, D)), jnp.float32)
    K = jnp.asarray(rng.integers(-2, 3, (B, H_KV, N_CAP, D)), jnp.float32)
    return q, K, jnp.asarray([N_CAP, 171, 40], jnp.int32)  # the last one below the budget floor


@pytest.mark.parametrize("min_budget", [0, 64])
def test_oracle_sum_by_the_fused_kernel_matches_the_xla_path(min_budget):
    config = OracleConfig(group_score="sum", max_ratio=0.2, min_budget=min_budget)
    q, K, lengths = _inputs(min_budget)
    got, kernel_module = _select("interpret", config, q, K, lengths)
    want, xla_module = _select("xla", config, q, K, lengths)
    np.testing.assert_array_equal(got, want)
    assert (got >= 0).sum() > 0 and (got[-H_KV:] == -1).any()  # a real selection with -1 tails
    assert "topk_partial_scores" in kernel_module  # the fused kernel ran (its scores launch)...
    assert "topk_partial_scores" not in xla_module  # ... and "xla" kept the jnp path


@pytest.mark.parametrize("config,dropped", [(OracleConfig(group_score="mass"), False),
                                            (OracleConfig(group_score="sum", keep_sinks=4), False),
                                            (OracleConfig(group_score="sum"), True)])
def test_the_fused_kernel_is_not_used_where_it_does_not_apply(config, dropped):
    """A ranking other than the summed q·k (softmax mass), kept sinks or dropped slots outrank or
    reshape the scores before the top-k: the kernel, which computes them itself, cannot apply."""
    q, K, lengths = _inputs(1)
    mask = jnp.zeros((B, H_KV, N_CAP), bool).at[:, :, 3].set(True) if dropped else None
    got, module = _select("interpret", config, q, K, lengths, mask)
    want, _ = _select("xla", config, q, K, lengths, mask)
    np.testing.assert_array_equal(got, want)
    assert "topk_partial_scores" not in module
