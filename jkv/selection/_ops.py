"""Device ops the selectors call, in one place: the dispatched kernels of `pallas_kernels`.

`topk_select(scores f32[R, N], valid_len i32[R], k) -> i32[R, k]`: indices by descending score,
ties to the lower index, -1 past min(k, valid_len[r]). Pallas on GPU, XLA reference elsewhere.
"""
from pallas_kernels.dispatch import topk_select

__all__ = ["topk_select"]
