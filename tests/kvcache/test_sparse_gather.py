"""The decode worker's gather of selected rows (`jkv.kvcache.sparse.gather_selected`) goes through
`dispatch.paged_gather`: the Pallas Triton gather on a kernel backend (here interpreted) and the
XLA gather on CPU read the same rows, and a -1 slot reads jkv's null page."""
import jax
import jax.numpy as jnp
import numpy as np

from jkv.kvcache import NULL_PAGE, sparse
from pallas_kernels import dispatch, paged_gather


def test_the_gather_kernel_reads_jkvs_null_page():
    assert paged_gather.NULL_PAGE == NULL_PAGE == sparse.NULL_PAGE


def test_gather_selected_is_the_same_under_the_kernel_and_xla():
    rng = np.random.default_rng(0)
    num_pages, H, P, D, B, max_pages, k = 12, 3, 16, 64, 2, 4, 40
    K = jnp.asarray(rng.standard_normal((num_pages, H, P, D)), jnp.bfloat16)
    V = jnp.asarray(rng.standard_normal((num_pages, H, P, D)), jnp.bfloat16)
    table = jnp.asarray([[3, 5, 7, 0], [1, 2, 0, 0]], jnp.int32)  # request 1: 2 pages, then idle
    lengths = [50, 20]
    index = np.full((B * H, k), -1, np.int32)
    for r in range(B * H):
        chosen = rng.permutation(lengths[r // H])[: k - 3 * r]  # valid prefixes of 40 .. 25
        index[r, : len(chosen)] = chosen
    outputs = {}
    for backend in ("xla", "interpret"):
        with dispatch.backend(backend):  # read at trace time: a fresh jit each
            outputs[backend] = jax.jit(lambda *a: sparse.gather_selected(*a))(K, V, table, jnp.asarray(index))
    for got, want in zip(outputs["interpret"], outputs["xla"]):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    K_sel, _, valid = outputs["interpret"]
    np.testing.assert_array_equal(valid, (index >= 0).sum(1).reshape(B, H))
    np.testing.assert_array_equal(np.asarray(K_sel[1, 2, -1], np.float32), np.asarray(K[NULL_PAGE, 2, 0], np.float32))
    b, h, j = 0, 1, 0  # an entry read through the table: token t at page table[b, t // P], slot t % P
    t = index[b * H + h, j]
    np.testing.assert_array_equal(np.asarray(K_sel[b, h, j], np.float32),
                                  np.asarray(K[table[b, t // P], h, t % P], np.float32))
