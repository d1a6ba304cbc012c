"""Glue from an L3 `KVPool` to the pipeline's FETCH stage (CALVO §3.1, L3 -> L2).

The FETCH executor thread calls the returned function once per chunk; it reads the chunk
straight into its reserved row of the preallocated L2 staging area. A pool miss — evicted,
corrupt, wrong size, or the pool is down — returns False, which makes the pipeline truncate
the request's prefix there and recompute the rest: a miss costs time, never correctness.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from jkv.kvpool.base import KVPool
from jkv.kvpool.hashing import ChunkKey
from jkv.scheduling.core import PipelineRequest

log = logging.getLogger(__name__)


def pool_fetch(pool: KVPool, host_buffers: np.ndarray,
               keys_of: Callable[[PipelineRequest], Sequence[ChunkKey]]
               ) -> Callable[[PipelineRequest, int, int], bool]:
    """A FETCH stage function reading chunk `chunk` of `keys_of(request)` into
    `host_buffers[host_slot]`.

    host_buffers: [host_slots, ...] C-contiguous, one row per L2 slot; a stored chunk must fill
    a row exactly (a different size means a different layout: treated as a miss).
    """
    if host_buffers.ndim < 2 or not host_buffers.flags.c_contiguous:
        raise ValueError(f"host_buffers must be a C-contiguous [host_slots, ...] array, got shape "
                         f"{host_buffers.shape}")
    row_bytes = host_buffers[0].nbytes

    def fetch(request: PipelineRequest, chunk: int, host_slot: int) -> bool:
        keys = keys_of(request)
        if chunk >= len(keys):
            raise ValueError(f"request {request.request_id!r} has {len(keys)} chunk keys but the "
                             f"pipeline asked for chunk {chunk}; num_chunks must match the keys")
        row = host_buffers[host_slot]
        meta = pool.get_many([keys[chunk]], [row])[0]
        if meta is None:
            return False
        if meta.nbytes != row_bytes:
            log.warning("pool chunk %s holds %d bytes, L2 rows hold %d; treated as a miss",
                        keys[chunk].name, meta.nbytes, row_bytes)
            return False
        return True

    return fetch


def write_back(pool: KVPool, keys: Sequence[ChunkKey], chunks: np.ndarray,
               first_chunk: int = 0) -> int:
    """After prefill, store the chunks the pool lacks (prefill writes new chunks back).

    keys: the prompt's chunk keys; chunks: [n, ...] KV of chunks first_chunk .. first_chunk+n-1
    (one row per chunk, e.g. [n, L, 2, H_kv, C, D]). Returns how many chunks were written;
    a dead or full pool writes fewer, which only costs future hits.
    """
    if first_chunk < 0 or first_chunk + len(chunks) > len(keys):
        raise ValueError(f"chunks {first_chunk}..{first_chunk + len(chunks) - 1} are outside the "
                         f"prompt's {len(keys)} chunk keys")
    wanted = keys[first_chunk:first_chunk + len(chunks)]
    present = pool.contains_many(wanted)
    written = 0
    for key, chunk, there in zip(wanted, chunks, present):
        if not there:
            written += pool.put(key, np.ascontiguousarray(chunk))
    return written
