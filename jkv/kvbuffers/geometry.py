"""Block geometry of one request's KV (DESIGN.md "KV geometry"; SmartGen §4.1).

Each layer's prompt of N tokens is cut into `M_eff = min(M, N)` blocks of `ceil(N / M_eff)`
tokens (the last block may be shorter, and when M_eff * block_tokens overshoots N the trailing
block ids are empty and skipped). Block `(l, m)` covers every KV head of tokens
`[m * block_tokens, min((m + 1) * block_tokens, N))` of layer l. Block ids are positional
relative to the prompt length, so one importance profile row `I[l, :M]` serves any length.

Block ids are flattened layer-major: `id = l * M_eff + m` (the "address order" of SmartGen's
sequential baseline). Pure Python / numpy; no JAX.
"""
from __future__ import annotations

import dataclasses

import numpy as np

# KV mask values (decode side, int8 per token and layer)
PAD, LOCAL, REMOTE = 0, 1, 2
# Device KV mask only (per KV head): a token-dropping profile kept no row for this head
# (jkv/compression/dropping.py); never selected, fetched or landed.
DROPPED = 3


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
    """num_tokens: N prompt tokens; num_layers: L; max_blocks: M (blocks per layer, default 1024)."""

    num_tokens: int
    num_layers: int
    max_blocks: int = 1024

    def __post_init__(self):
        for name in ("num_tokens", "num_layers", "max_blocks"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")

    @property
    def blocks_per_layer(self) -> int:
        """M_eff = min(M, N)."""
        return min(self.max_blocks, self.num_tokens)

    @property
    def block_tokens(self) -> int:
        """ceil(N / M_eff) tokens per block."""
        return -(-self.num_tokens // self.blocks_per_layer)

    @property
    def num_blocks(self) -> int:
        """L * M_eff block ids (some trailing ids of a layer may be empty, see `is_empty`)."""
        return self.num_layers * self.blocks_per_layer

    def token_range(self, m: int) -> tuple[int, int]:
        """[start, stop) tokens of block m of any layer (start == stop for an empty block)."""
        if not 0 <= m < self.blocks_per_layer:
            raise ValueError(f"block {m=} out of range [0, {self.blocks_per_layer})")
        bt = self.block_tokens
        start = min(m * bt, self.num_tokens)
        return start, min(start + bt, self.num_tokens)

    def is_empty(self, m: int) -> bool:
        start, stop = self.token_range(m)
        return start == stop

    def split(self, block_id: int) -> tuple[int, int]:
        """Flat id -> (layer, m)."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"{block_id=} out of range [0, {self.num_blocks})")
        return divmod(int(block_id), self.blocks_per_layer)

    def block_of(self, positions) -> np.ndarray:
        """Token positions (< N) -> block index m within a layer (i32, same shape)."""
        return (np.asarray(positions) // self.block_tokens).astype(np.int32)

    def nonempty_ids(self) -> np.ndarray:
        """All non-empty flat block ids in address order: i32[<= L*M_eff]."""
        per_layer = [m for m in range(self.blocks_per_layer) if not self.is_empty(m)]
        return np.asarray([l * self.blocks_per_layer + m for l in range(self.num_layers) for m in per_layer],
                          np.int32)

    def runs(self, layer_blocks) -> list[tuple[int, int]]:
        """Coalesce block indices m of one layer into contiguous token runs [(start, stop), ...]
        (fewer, larger writes; each run is followed by its one mask update)."""
        runs: list[tuple[int, int]] = []
        for m in sorted(set(int(x) for x in layer_blocks)):
            start, stop = self.token_range(m)
            if start == stop:
                continue
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((start, stop))
        return runs
