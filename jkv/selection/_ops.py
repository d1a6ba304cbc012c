"""Device ops the selectors call, in one place: the dispatched kernels of `pallas_kernels`.

`topk_select(scores f32[R, N], valid_len i32[R], k) -> i32[R, k]`: indices by descending score,
ties to the lower index, -1 past min(k, valid_len[r]). Pallas on GPU, XLA reference elsewhere.
`topk_select_fused(q_partial [R, G, d], k_partial [R, N, d], valid_len, k)`: the same over the
scores sum_g q_partial[r, g] · k_partial[r, n], computed in the kernel (one dot per position).
`kernels_in_use()`: the dispatch backend runs the Pallas kernels (not "xla").
"""
from pallas_kernels.dispatch import kernels_in_use, topk_select, topk_select_fused

__all__ = ["kernels_in_use", "topk_select", "topk_select_fused"]
