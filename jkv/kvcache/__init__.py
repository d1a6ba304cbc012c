"""KV geometry for disaggregated serving: blocks, host pools and the decode-side KV mask."""
from jkv.kvcache.geometry import LOCAL, PAD, REMOTE, BlockGeometry
from jkv.kvcache.pool import HostKVPool, PoolExhausted, RequestKV

__all__ = ["BlockGeometry", "HostKVPool", "PoolExhausted", "RequestKV", "PAD", "LOCAL", "REMOTE"]
