"""Keys of the automatic prefix cache: one chained hash per full page of a request's tokens.

The keys are the kvpool chunk keys (`jkv.kvpool.hashing`) with the page as the chunk, so one
scheme names a prefix in every tier (device pages here, the host pool, a remote pool):

    namespace = ChunkNamespace(model id + weights fingerprint, KV dtype, page_size)
    key_i     = blake2b(key_{i-1} || u32le(tokens[i*P : (i+1)*P]))      key_{-1} = root(namespace)

Key i names the whole prefix up to the end of page i, so equal keys mean equal leading tokens
(and equal KV, which depends only on them); a partial last page has no key and is always
recomputed. Pure Python: `PagedKVCache` calls these on the engine thread.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jkv.kvpool.hashing import ChunkNamespace, as_token_array, chain_digest


def prefix_namespace(model, dtype, page_size: int) -> ChunkNamespace:
    """The namespace of `model`'s KV in `dtype` pages of page_size tokens: the model's id plus a
    fingerprint of its weights (two checkpoints of one architecture must never share pages)."""
    from jkv.disagg.handshake import model_id, weights_fingerprint

    return ChunkNamespace(f"{model_id(model)}@{weights_fingerprint(model)}", np.dtype(dtype).name, int(page_size))


def extend_page_keys(keys: list[bytes], tokens: Sequence[int] | np.ndarray, namespace: ChunkNamespace,
                     limit: int | None = None) -> list[bytes]:
    """Append to `keys` (the keys of tokens' first len(keys) pages, computed earlier) the keys of
    tokens' later full pages, at most `limit` keys in all; returns `keys`.

    tokens: i32[N], the request's tokens from position 0 (its prompt, then generated tokens).
    """
    arr = as_token_array(tokens)
    P = namespace.chunk_tokens
    n = arr.size // P if limit is None else min(arr.size // P, limit)
    parent = keys[-1] if keys else namespace.root_digest()
    for i in range(len(keys), n):
        parent = chain_digest(parent, arr[i * P:(i + 1) * P])
        keys.append(parent)
    return keys


def shareable_pages(prompt_len: int, page_size: int) -> int:
    """Leading full pages of a prompt that may come from the cache: all full pages except that the
    last prompt token is always computed (its logits give the first generated token), so a prompt
    of exactly k pages reuses at most k - 1."""
    return max(prompt_len - 1, 0) // page_size
