"""Rows a prefill worker served on demand, and which of them the decode side confirmed it keeps.

SmartGen moves a request's prompt KV by three paths: proactive pushes during the prefill (§4.1),
on-demand fetches (§4.2) and speculative pushes (§4.3). The decode side keeps every row it fetched
in its staging buffer and its device pages (`jkv.kvbuffers.fetch.keep_rows`, KV reuse), so a later
speculative push of a block holding such a row moves bytes the decode side already has: before
this module smartgen moved ~1.5x a request's KV (every block was pushed, plus the rows fetched
before their block went out).

Serving a row is not enough to skip it: the decode side drops the reply of a lookahead prefetch
that timed out or whose step was aborted (`LayerLookahead.clear`), and never keeps an item whose
framed reply failed its checksum. A row left out of a push whose mask byte still flips would then
read as present (a 1 must always be safe to read). So a row is skipped only once confirmed:

    decode   every "fetch" carries a number (`FetchCall.seq`); `keep_rows(..., seq)` notes, per
             request, the numbers whose rows went into staging (`LiveRequest.kept_fetches`)
    decode   the next "spec" notification carries them ({"kept": {rid: [seq, ...]}}) and forgets
             them (`OwnerSide._trigger_speculation`, engine thread)
    prefill  `record` notes each reply's positions per (request, seq) before the reply leaves
             (RPC thread); `confirm` turns the confirmed ones into `held` rows (notify thread,
             under the worker's lock, before that "spec"'s pushes)
    prefill  a push writes only the rows of its runs that are not `held` (`head_slices.slice_items`);
             the run's mask bytes still follow on the same ordered bulk connection, after its last
             written row or alone: at the 1, every head's row of the run is in staging (the
             written ones by this push, the held ones since before the "spec" that confirmed them
             was sent). Rows never confirmed (a dropped prefetch) are pushed as before, and a row
             never pushed stays fetchable (its mask byte stays REMOTE until its run is pushed).

Only rows served exactly (float32, uncompressed requests) are recorded: a compressed request's
on-demand rows are lossy and its pushes are whole chunks (jkv/compression/kv_transfer.py).
A fetch and a push of the same row can still both cross when the push leaves before the fetch's
confirmation arrives (the fetch was in flight); that is the residue the measured ratio shows.

Threads: `record` on transport RPC threads (no lock: one call per seq, a dict store is atomic),
`confirm` and `held_rows` on the notify thread under `PrefillWorker._lock`.
"""
from __future__ import annotations

import numpy as np


class ServedRows:
    """One request's served and confirmed rows. shape: (L, H_kv, N) of its prompt KV."""

    def __init__(self, num_layers: int, num_kv_heads: int, num_tokens: int):
        self._shape = (num_layers, num_kv_heads, num_tokens)
        self._pending: dict[int, tuple[int, list[np.ndarray]]] = {}  # seq -> (layer, positions i32[c] per head)
        self.held: np.ndarray | None = None  # bool[L, H_kv, N], made at the first confirmation
        self.confirmed_rows = 0  # (layer, head, token) rows confirmed held (counted once)

    def record(self, seq: int, layer: int, per_head: list) -> None:
        """A fetch reply numbered `seq` carries these rows of `layer` (positions i32[c] per KV head)."""
        if any(len(p) for p in per_head):
            self._pending[int(seq)] = (int(layer), [np.array(p, np.int64) for p in per_head])

    def confirm(self, seqs) -> int:
        """The decode side kept the replies numbered `seqs`: their rows become held. Unknown
        numbers (another worker's, or replies already confirmed) are ignored. Returns rows newly held."""
        added = 0
        for seq in seqs:
            entry = self._pending.pop(int(seq), None)
            if entry is None:
                continue
            if self.held is None:
                self.held = np.zeros(self._shape, bool)
            layer, per_head = entry
            for head, positions in enumerate(per_head):
                row = self.held[layer, head]
                added += int((~row[positions]).sum())
                row[positions] = True
        self.confirmed_rows += added
        return added

    def held_rows(self, layer: int) -> np.ndarray | None:
        """bool[H_kv, N]: rows of `layer` a push may leave out (None: none)."""
        return None if self.held is None else self.held[layer]


def missing_spans(held: np.ndarray | None, head: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The [a, b) spans of tokens [start, stop) whose row of `head` is not held (held: bool[H_kv, N]
    or None), in token order."""
    if held is None:
        return [(start, stop)]
    need = ~held[head, start:stop]
    if need.all():
        return [(start, stop)]
    edges = np.flatnonzero(np.diff(np.concatenate(([False], need, [False])).astype(np.int8)))
    return [(start + int(a), start + int(b)) for a, b in zip(edges[::2], edges[1::2])]


__all__ = ["ServedRows", "missing_spans"]
