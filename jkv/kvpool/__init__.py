"""L3 prefix-cache KV pool (CALVO §2.2): chained prefix hashing, host LRU store, Redis backend.
Chunks outlive the requests that wrote them; the per-request transfer buffers of disaggregated
serving are `jkv.kvbuffers`."""
from jkv.kvpool.base import ChunkMeta, KVPool, PoolStats, make_meta
from jkv.kvpool.hashing import ChunkKey, ChunkNamespace, chunk_keys
from jkv.kvpool.host_pool import HostKVPool

__all__ = ["ChunkKey", "ChunkMeta", "ChunkNamespace", "HostKVPool", "KVPool", "PoolStats",
           "chunk_keys", "make_meta", "RedisKVPool"]


def __getattr__(name):
    # redis is an optional dependency: import the backend only when asked for.
    if name == "RedisKVPool":
        from jkv.kvpool.redis_pool import RedisKVPool
        return RedisKVPool
    raise AttributeError(name)
