"""L2 of the prefix cache: device pages evicted from the paged cache are kept in a host KV pool
(`jkv.kvpool.HostKVPool`, an LRU by bytes) under the same chained key, and a later prompt that
misses in device pages but hits here gets them copied back instead of recomputed.

One page's payload is its KV over all layers, `[L, 2, H_kv, P, D]` in the cache's dtype (K then V),
stored under `ChunkKey(namespace, -1, page_key)`: the kvpool scheme, so the same bytes go to the
remote tier (L3, `remote_tier.py`). The pool verifies length and CRC32C on every read, so a hit is
never wrong bytes.

Threads: writes are asynchronous (`writeback.py`: the allocator's eviction hook on the engine thread
only dispatches a `gather_pages` snapshot; a background thread copies it to host and puts it
here); `load` runs on the thread that admits the request and replaces `PagedKVCache.kv`, which
only that thread touches; `read` (host memory only) runs on the loading stages' fetch thread
(jkv/serving/prefix_loader.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kvpool.base import KVPool
from jkv.kvpool.hashing import ChunkKey, ChunkNamespace


@jax.jit
def gather_pages(cache, pages):
    """cache: tuple over layers of (K, V) [num_pages, H_kv, P, D]; pages: i32[n] ->
    [n, L, 2, H_kv, P, D] (one contiguous payload per page)."""
    return jnp.stack([jnp.stack([K[pages], V[pages]], 1) for K, V in cache], 1)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_pages(cache, pages, data):
    """Write data [n, L, 2, H_kv, P, D] into pages i32[n] of the donated cache (padding rows point
    at the null page 0, a scratch page)."""
    return tuple((K.at[pages].set(data[:, l, 0].astype(K.dtype)), V.at[pages].set(data[:, l, 1].astype(V.dtype)))
                 for l, (K, V) in enumerate(cache))


def _bucket(n: int) -> int:
    """Rows padded to a power of two so a few programs serve every count."""
    return 1 << max(n - 1, 0).bit_length()


class HostTier:
    """Probe and load back pages the write-back put in `pool` (see the module docstring)."""

    def __init__(self, pool: KVPool, namespace: ChunkNamespace):
        self.pool = pool
        self.namespace = namespace
        self.hits = 0  # pages loaded back into device pages

    def _key(self, digest: bytes) -> ChunkKey:
        return ChunkKey(self.namespace, -1, digest)

    def available(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, the pool holds (a probe: no copy, no recency)."""
        n = 0
        for present in self.pool.contains_many([self._key(k) for k in keys]):
            if not present:
                break
            n += 1
        return n

    def load(self, cache, keys: list[bytes], pages: list[int], page_shape: tuple[int, ...], dtype):
        """Copy the payloads of `keys` into `pages` (same length) of `cache`; returns (new cache,
        how many leading keys were loaded: fewer if the pool dropped one since `available`)."""
        buffers = [np.empty(page_shape, dtype) for _ in keys]
        n = self.read(keys, buffers)
        return load_pages(cache, pages[:n], buffers[:n]), n

    def read(self, keys: list[bytes], buffers) -> int:
        """Copy the payloads of `keys` into buffers[i] (each one page, [L, 2, H_kv, P, D]); returns
        how many leading keys were read (fewer if the pool dropped one since `available`). Any
        thread: the pool locks itself."""
        metas = self.pool.get_many([self._key(k) for k in keys], buffers)
        n = next((i for i, m in enumerate(metas) if m is None or m.nbytes != buffers[i].nbytes), len(keys))
        self.hits += n
        return n


def load_pages(cache, pages: list[int], buffers: list[np.ndarray]):
    """Write host page payloads buffers[i] ([L, 2, H_kv, P, D]) into pages[i] of the donated cache
    (one scatter program; rows padded to a power of two with the null page); returns the new cache."""
    n = len(pages)
    if n == 0:
        return cache
    rows = _bucket(n)
    idx = np.zeros(rows, np.int32)
    idx[:n] = pages
    data = np.zeros((rows, *buffers[0].shape), buffers[0].dtype)
    data[:n] = buffers
    return scatter_pages(cache, idx, data)


def gather_snapshot(cache, pages: list[int]):
    """Dispatch a gather of `pages` of `cache` (no wait): a device array [R, L, 2, H_kv, P, D], R =
    len(pages) padded to a power of two (rows past len(pages) read the null page)."""
    idx = np.zeros(_bucket(len(pages)), np.int32)
    idx[:len(pages)] = pages
    return gather_pages(cache, idx)
