"""Chained prefix hashing of token chunks: the keys of the L3 KV pool (CALVO §2.2, §3.1).

A prompt is cut into chunks of `chunk_tokens` tokens; only *full* chunks get a key (a partial
tail chunk is always recomputed, as in vLLM's prefix caching). Chunk i's key is

    h_i = blake2b(h_{i-1} || u32le(tokens[i*C : (i+1)*C]))      h_{-1} = blake2b(namespace)

so a key names the whole prefix up to and including its chunk, not just the chunk's tokens:
two prompts share key i iff they share their first (i+1)*C tokens (up to a 2^-128 collision).
The namespace (model id, KV dtype, chunk size) is hashed into the root, so KV of one model,
dtype or chunking can never be served for another. Python's `hash()` is never used: it is
salted per process, and pool clients live in different processes and machines.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16  # 128-bit digests: collision probability is negligible at any pool size.
_MAX_TOKEN_ID = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class ChunkNamespace:
    """What a KV chunk's bytes depend on besides its tokens.

    model_id: e.g. "HuggingFaceTB/SmolLM2-135M-Instruct" (include a revision if weights change).
    dtype: KV element dtype name as numpy spells it ("float16", "bfloat16", "float32", ...).
    chunk_tokens: tokens per chunk (C).
    """

    model_id: str
    dtype: str
    chunk_tokens: int

    def __post_init__(self):
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise ValueError(f"{self.model_id=} must be a non-empty model name")
        if not self.dtype or not self.dtype.replace("_", "").isalnum():
            raise ValueError(f"{self.dtype=} must be a dtype name such as 'float16'")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"{self.chunk_tokens=} must be an int >= 1 (tokens per chunk)")

    def root_digest(self) -> bytes:
        """h_{-1}: length-prefixed fields so ("a:b", "c") and ("a", "b:c") cannot collide."""
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"jkv-kvpool-root")
        for field in (self.model_id.encode(), self.dtype.encode(), str(self.chunk_tokens).encode()):
            h.update(len(field).to_bytes(4, "little"))
            h.update(field)
        return h.digest()

    @property
    def prefix(self) -> str:
        """Human-readable key prefix naming model, dtype and chunk size (for Redis keys, logs)."""
        return f"jkv:{self.model_id}:{self.dtype}:c{self.chunk_tokens}"


@dataclasses.dataclass(frozen=True)
class ChunkKey:
    """Key of chunk `index` of some prompt: its chained digest within `namespace`."""

    namespace: ChunkNamespace
    index: int
    digest: bytes

    @property
    def name(self) -> str:
        """Storage key: names model, dtype, chunk size and chained hash (CALVO/LMCache style)."""
        return f"{self.namespace.prefix}:{self.digest.hex()}"

    def __str__(self) -> str:
        return self.name


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """tokens as u32le[N], the encoding every digest hashes; ValueError on ids outside [0, 2**32)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > _MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, 2**32), got min {arr.min()} max {arr.max()}")
    return arr.astype("<u4", copy=False)


def chain_digest(parent: bytes, chunk_tokens: np.ndarray) -> bytes:
    """h_i = blake2b(h_{i-1} || u32le tokens). Fixed-width tokens make the encoding injective."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"jkv-kvpool-chunk")
    h.update(parent)
    h.update(np.ascontiguousarray(chunk_tokens, dtype="<u4").tobytes())
    return h.digest()


def num_full_chunks(num_tokens: int, chunk_tokens: int) -> int:
    return num_tokens // chunk_tokens


def chunk_keys(tokens: Sequence[int] | np.ndarray, namespace: ChunkNamespace,
               max_chunks: int | None = None) -> list[ChunkKey]:
    """Keys of every full chunk of `tokens` (i32/u32[N]) in order; the tail (< C tokens) has none.

    max_chunks: stop after this many keys (e.g. to key only the shared context).
    """
    arr = as_token_array(tokens)
    c = namespace.chunk_tokens
    n = num_full_chunks(arr.size, c)
    if max_chunks is not None:
        if max_chunks < 0:
            raise ValueError(f"{max_chunks=} must be >= 0")
        n = min(n, max_chunks)
    keys: list[ChunkKey] = []
    parent = namespace.root_digest()
    for i in range(n):
        parent = chain_digest(parent, arr[i * c:(i + 1) * c])
        keys.append(ChunkKey(namespace, i, parent))
    return keys


def key_from_name(name: str) -> ChunkKey:
    """The ChunkKey whose `.name` is `name` (`jkv:<model>:<dtype>:c<C>:<hex>`), for pool servers
    that receive names on the wire. The chunk index is not part of a name (the chained digest
    already fixes the position) and comes back as -1. ValueError on anything malformed."""
    if not isinstance(name, str) or not name.startswith("jkv:"):
        raise ValueError(f"chunk key name {name!r} must look like 'jkv:<model>:<dtype>:c<C>:<hex>'")
    head, dtype, chunk, digest_hex = (name[4:].rsplit(":", 3) + ["", "", ""])[:4]
    try:
        digest = bytes.fromhex(digest_hex)
        chunk_tokens = int(chunk[1:]) if chunk.startswith("c") else -1
        namespace = ChunkNamespace(head, dtype, chunk_tokens)
    except ValueError as exc:
        raise ValueError(f"chunk key name {name!r} is malformed ({exc}); expected "
                         "'jkv:<model>:<dtype>:c<C>:<32 hex digits>'") from None
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"chunk key name {name!r} has a {len(digest)}-byte digest; expected "
                         f"{DIGEST_BYTES} bytes ({2 * DIGEST_BYTES} hex digits)")
    return ChunkKey(namespace, -1, digest)
