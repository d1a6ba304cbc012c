"""Pallas GPU kernels for the SmartGen decode path, each with a pure-jnp reference.

Import the ops from `pallas_kernels.dispatch` (or here): it runs the compiled Pallas kernels on a
GPU and the XLA references elsewhere. See docs/kernels.md.
"""
from pallas_kernels.dispatch import (
    backend,
    get_backend,
    merge_partials,
    resolved_backend,
    set_backend,
    sparse_decode_attention,
    sparse_decode_attention_partials,
    split_reorder,
    topk_select,
    topk_select_fused,
)

__all__ = [
    "backend",
    "get_backend",
    "merge_partials",
    "resolved_backend",
    "set_backend",
    "sparse_decode_attention",
    "sparse_decode_attention_partials",
    "split_reorder",
    "topk_select",
    "topk_select_fused",
]
