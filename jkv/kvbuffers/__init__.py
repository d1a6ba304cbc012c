"""Request-scoped KV transfer buffers of disaggregated serving (SmartGen): each request's block
geometry, its host buffers on both sides with the decode-side KV mask, and the on-demand fetch
wire format that reads them. Not to be confused with `jkv.kvpool`, the shared prefix-cache pool
that outlives requests (CALVO)."""
from jkv.kvbuffers.geometry import LOCAL, PAD, REMOTE, BlockGeometry
from jkv.kvbuffers.pool import KVBufferPool, PoolExhausted, RequestKV

__all__ = ["BlockGeometry", "KVBufferPool", "PoolExhausted", "RequestKV", "PAD", "LOCAL", "REMOTE"]
