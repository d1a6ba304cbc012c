"""Device programs of the SmartGen decode side over the paged cache and its KV mask.

The decode worker's KV lives in the paged cache (`PagedKVCache`: per layer K, V
`[num_pages, H_kv, P, D]` in the model's dtype) with the SmartGen KV mask next to it, page-aligned:

    mask: i8[L, num_pages, H_kv, P]   0 PAD, 1 LOCAL (the row is in the device pages), 2 REMOTE,
                                      3 DROPPED (a token-dropping profile kept no row for this head)

Token t of a request with page table row `table[b]` has mask `mask[l, table[b, t // P], h, t % P]`.
The mask is per KV head because a row fetched on demand is kept per head (KV reuse): it is in the
device pages for that head only. Rows that arrive as blocks flip every head of a token at once. A 1
is written in the same program that writes the row (`land_rows`, or `land_pieces` inside a decode
layer's program), so a 1 is always safe to read. The null page 0 (idle table entries) keeps mask
PAD: padding rows of `land_rows` and null landing pieces write PAD there. DROPPED entries are
written once, when a request with a token-dropping profile joins (`set_entries`), and
`drop_dropped` removes them from every selection, so each KV head attends to its own kept prompt
tokens plus the generated ones (the mask is already per head, so per-head token counts need no
other structure).

Pure functions plus module-level jits (shared by every worker in a process, so a benchmark's
fresh workers reuse the compiled programs). No threads, no host bookkeeping.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv.kvbuffers.geometry import DROPPED, LOCAL, PAD, REMOTE
from pallas_kernels import dispatch

NULL_PAGE = 0


def init_mask(num_layers: int, num_pages: int, num_kv_heads: int, page_size: int):
    """An all-PAD mask i8[L, num_pages, H_kv, P] on the default device."""
    return jnp.full((num_layers, num_pages, num_kv_heads, page_size), PAD, jnp.int8)


def _set_page_masks(mask, pages, values):
    """mask: i8[L, num_pages, H_kv, P]; pages: i32[n]; values: i8[n, P] (every layer and head).
    Padding entries name the null page with PAD values."""
    return mask.at[:, pages].set(values[None, :, None, :])


set_page_masks = jax.jit(_set_page_masks, donate_argnums=(0,))


def _land_rows(K, V, mask, layer, pages, heads, slots, k_rows, v_rows, values):
    """Write rows into one layer's pages, then their mask entries.

    K, V: [num_pages, H_kv, P, D]; mask: i8[L, num_pages, H_kv, P]; layer: i32[];
    pages, heads, slots: i32[R]; k_rows, v_rows: [R, D] (the pool dtype); values: i8[R]
    (LOCAL, or PAD for a padding row aimed at the null page). Returns (K, V, mask)."""
    K = K.at[pages, heads, slots].set(k_rows.astype(K.dtype))
    V = V.at[pages, heads, slots].set(v_rows.astype(V.dtype))
    return K, V, mask.at[layer, pages, heads, slots].set(values)


land_rows = jax.jit(_land_rows, donate_argnums=(0, 1, 2))


def land_pieces(K, V, mask, layer, pieces):
    """`_land_rows` of rows that come as pieces, inside a decode program (jkv/disagg/decode_program.py).

    pieces: a tuple of (pages, heads, slots i32[R_i], k_rows, v_rows [R_i, D]); a piece aimed at the
    null page (an unused slot of the program's fixed piece sizes) writes PAD there, every other
    row LOCAL. One scatter of all pieces. Returns (K, V, mask)."""
    pages, heads, slots, k_rows, v_rows = (jnp.concatenate(part) for part in zip(*pieces))
    values = jnp.where(pages == NULL_PAGE, PAD, LOCAL).astype(jnp.int8)
    return _land_rows(K, V, mask, layer, pages, heads, slots, k_rows, v_rows, values)


def _set_entries(mask, layers, pages, heads, slots, values):
    """mask: i8[L, num_pages, H_kv, P]; layers, pages, heads, slots: i32[R]; values: i8[R]
    (padding entries: the null page with PAD)."""
    return mask.at[layers, pages, heads, slots].set(values)


set_entries = jax.jit(_set_entries, donate_argnums=(0,))


def dropped_slots(mask, layer, table, capacity: int):
    """bool[B, H_kv, capacity]: the slots of one layer a token-dropping profile removed (DROPPED)."""
    B, H = table.shape[0], mask.shape[2]
    rows = mask_rows(mask, layer, table, jnp.ones(B, bool)).reshape(B, H, -1)
    return rows[:, :, :capacity] == DROPPED


def drop_dropped(kv_index, mask, layer, table):
    """kv_index i32[B*H_kv, k] without the entries whose device mask is DROPPED: the kept entries
    stay in selection order, -1 fills the tail. Rows without DROPPED entries are unchanged
    (a selection's -1s are already at its tail)."""
    B = table.shape[0]
    rows = mask_rows(mask, layer, table, jnp.ones(B, bool))  # i8[B*H_kv, max_pages*P]
    value = jnp.take_along_axis(rows, jnp.clip(kv_index, 0, rows.shape[1] - 1), axis=1)
    index = jnp.where((kv_index >= 0) & (value == DROPPED), -1, kv_index)
    order = jnp.argsort(index < 0, axis=1, stable=True)
    return jnp.take_along_axis(index, order, axis=1)


def write_new_token(K, V, mask, layer, table, positions, k_new, v_new):
    """The decode step's own K, V of one layer, inside its program (jkv/disagg/decode_program.py): k_new, v_new [B, H_kv, D] at positions: i32[B]
    (table: i32[B, max_pages]); every head's mask entry flips to LOCAL. Returns (K, V, mask)."""
    P = K.shape[2]
    B, H = k_new.shape[:2]
    index = positions // P
    inside = index < table.shape[1]
    page = jnp.where(inside, table[jnp.arange(B), jnp.clip(index, 0, table.shape[1] - 1)], NULL_PAGE)
    slot = positions % P
    page_h, head_h = jnp.broadcast_to(page[:, None], (B, H)), jnp.broadcast_to(jnp.arange(H)[None], (B, H))
    slot_h = jnp.broadcast_to(slot[:, None], (B, H))
    value = jnp.where(page_h == NULL_PAGE, PAD, LOCAL).astype(jnp.int8)
    return (K.at[page_h, head_h, slot_h].set(k_new.astype(K.dtype)),
            V.at[page_h, head_h, slot_h].set(v_new.astype(V.dtype)),
            mask.at[layer, page_h, head_h, slot_h].set(value))



def mask_rows(mask, layer, table, fetchable):
    """One layer's mask as split_reorder reads it: i8[B*H_kv, max_pages*P], row b*H_kv + h.

    mask: i8[L, num_pages, H_kv, P]; layer: i32[]; table: i32[B, max_pages]; fetchable: bool[B]. A request
    with nothing left to fetch (cancelled, failed, released) reads its REMOTE rows as LOCAL: no
    fetch is issued for it and its output is discarded or its rows are all landed."""
    B, max_pages = table.shape
    _, _, H, P = mask.shape
    rows = mask[layer][table].transpose(0, 2, 1, 3).reshape(B, H, max_pages * P)
    rows = jnp.where(~fetchable[:, None, None] & (rows == REMOTE), jnp.int8(LOCAL), rows)
    return rows.reshape(B * H, max_pages * P)


def gather_selected(K, V, table, kv_index):
    """The selected rows from the pages, in selection order, by `dispatch.paged_gather` (the
    Pallas Triton gather on a GPU backend, an XLA gather on CPU).

    K, V: [num_pages, H_kv, P, D]; table: i32[B, max_pages]; kv_index: i32[B*H_kv, k] (-1 past a
    row's valid prefix: read from the null page, never attended) -> K_sel, V_sel [B, H_kv, k, D]
    and valid i32[B, H_kv]."""
    B, H = table.shape[0], K.shape[1]
    K_sel, V_sel = dispatch.paged_gather(K, V, table, kv_index)
    valid = (kv_index.reshape(B, H, -1) >= 0).sum(axis=2).astype(jnp.int32)
    return K_sel, V_sel, valid
