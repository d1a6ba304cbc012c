"""Pure functions over a paged KV cache: page writes, paged decode and chunked prefill.

Cache: a tuple over layers of (K, V), each [num_pages, H_kv, P, D] (P tokens a page). A request's
pages are listed in its row of a page table `i32[B, max_pages]`: token t of row b lives in page
`page_table[b, t // P]`, slot `t % P`. Table entries past a request's pages hold the null page 0
(`jkv.kvcache.pages.NULL_PAGE`); a token whose page index falls outside the table is written to
the null page too, so a write never lands in another request's page. Nothing here allocates
pages: `jkv.kvcache.PagedKVCache` owns the table and the host bookkeeping.

Each step is two programs, as for the dense cache (`Model.decode_step`): a compute program that
reads the pages and returns the new tokens' K/V, and a write program that scatters them into the
donated cache. XLA CPU copies a donated buffer that one program both reads and updates in place,
so attention never reads the cache the same program writes; the new tokens' own keys enter the
attention from registers (decode: `merge_partials` of the new token's lane; prefill chunk: the
chunk's keys are concatenated after the gathered context).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from pallas_kernels import dispatch

from . import transformer as tfm
from .config import ModelConfig

NULL_PAGE = 0  # jkv.kvcache.pages.NULL_PAGE (models does not import jkv)


def zeros_kv(num_layers: int, shape: tuple[int, ...], dtype, sharding=None):
    """A zeroed cache: tuple over layers of (K, V) of `shape`. With a sharding (tensor parallelism)
    each device allocates only its shard: nothing the size of the whole cache lands on one device."""
    if sharding is None:
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return tuple((zeros(), zeros()) for _ in range(num_layers))


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None, sharding=None):
    """Zeroed paged cache: tuple over layers of (K, V), each [num_pages, H_kv, P, D] (placed with
    `sharding`, e.g. `Model.kv_sharding`, when given)."""
    shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    return zeros_kv(cfg.num_layers, shape, jnp.dtype(dtype if dtype is not None else cfg.dtype), sharding)


def token_slots(page_table, positions, page_size: int):
    """(page, slot) of each token. page_table: i32[B, max_pages]; positions: i32[B, T] -> two
    i32[B, T]. A position outside the table (negative or past max_pages pages) maps to the null page."""
    max_pages = page_table.shape[1]
    index = positions // page_size
    inside = (positions >= 0) & (index < max_pages)
    page = jnp.take_along_axis(page_table, jnp.clip(index, 0, max_pages - 1), axis=1)
    return jnp.where(inside, page, NULL_PAGE), positions % page_size


def paged_write(cache, page_table, positions, new_k, new_v):
    """Write one token per row: new_k, new_v [L, B, H_kv, D] at positions: i32[B].

    Returns the new cache (in place when the cache is donated). Rows of an idle batch slot
    should carry an all-null table row; their writes land in the null page.
    """
    page, slot = token_slots(page_table, positions[:, None], cache[0][0].shape[2])
    page, slot = page[:, 0], slot[:, 0]

    def put(pages, new):  # pages: [num_pages, H_kv, P, D]; new: [B, H_kv, D]
        return pages.at[page, :, slot, :].set(new.astype(pages.dtype))

    return tuple((put(K, new_k[l]), put(V, new_v[l])) for l, (K, V) in enumerate(cache))


def paged_write_prefill(cache, page_table, new_k, new_v, start, lengths):
    """Scatter a prefill (or prefill chunk) into pages.

    new_k, new_v: [L, B, H_kv, T, D] (an array or a sequence over layers of [B, H_kv, T, D]);
    token j of row b goes to position start[b] + j when j < lengths[b] (start, lengths: i32[B]);
    tokens past lengths[b] (padding) go to the null page.
    """
    T = new_k[0].shape[2]
    j = jnp.arange(T, dtype=jnp.int32)
    page, slot = token_slots(page_table, start[:, None] + j[None, :], cache[0][0].shape[2])
    page = jnp.where(j[None, :] < lengths[:, None], page, NULL_PAGE)

    def put(pages, new):  # new: [B, H_kv, T, D] -> indexed as [B, T, H_kv, D]
        return pages.at[page, :, slot, :].set(new.transpose(0, 2, 1, 3).astype(pages.dtype))

    return tuple((put(K, new_k[l]), put(V, new_v[l])) for l, (K, V) in enumerate(cache))


def paged_decode_attention(q, K_pages, V_pages, page_table, positions, k_new, v_new, head_mesh=None):
    """Attention of one new token over its request's first positions[b] cached tokens plus itself.

    q: [B, H, D]; K_pages, V_pages: [num_pages, H_kv, P, D]; page_table: i32[B, max_pages];
    positions: i32[B]; k_new, v_new: [B, H_kv, D] -> [B, H, D] (q's dtype). The cached part goes
    through `dispatch.paged_decode_attention_partials` (Mosaic kernel on Hopper, a native kernel on CPU, XLA elsewhere);
    the new token is one more softmax lane merged exactly with `merge_partials`.

    head_mesh: a mesh whose "tensor" axis splits the query heads (tensor parallelism,
    models/sharding.py): each shard then attends its own heads (`shard_map`), since the dispatch
    ops work on merged B x H_kv rows that GSPMD could not keep split by head. The KV heads are
    split too, or (fewer KV heads than shards) replicated, and each shard slices the one its
    query heads read.
    """
    if head_mesh is not None:
        n, H_kv = head_mesh.shape["tensor"], K_pages.shape[1]
        heads, rep = PartitionSpec(None, "tensor"), PartitionSpec()
        kv = heads if H_kv % n == 0 else rep

        def local(q, K, V, table, pos, kn, vn):
            if H_kv % n:  # n // H_kv shards share each KV head
                h = lax.axis_index("tensor") // (n // H_kv)
                K, V, kn, vn = (lax.dynamic_slice_in_dim(a, h, 1, axis=1) for a in (K, V, kn, vn))
            return paged_decode_attention(q, K, V, table, pos, kn, vn)

        return jax.shard_map(local, mesh=head_mesh, out_specs=heads, check_vma=False,
                             in_specs=(heads, kv, kv, rep, rep, kv, kv))(
            q, K_pages, V_pages, page_table, positions, k_new, v_new)
    B, H, D = q.shape
    H_kv = k_new.shape[1]
    cached = dispatch.paged_decode_attention_partials(q, K_pages, V_pages, page_table, positions)
    qg = q.reshape(B, H_kv, H // H_kv, D).astype(jnp.float32)
    s_new = jnp.einsum("bkgd,bkd->bkg", qg, k_new.astype(jnp.float32),
                       precision=lax.Precision.HIGHEST) * (D ** -0.5)
    o_new = jnp.broadcast_to(v_new.astype(jnp.float32)[:, :, None, :], qg.shape)
    out, _ = dispatch.merge_partials(cached, (o_new.reshape(B, H, D), s_new.reshape(B, H)))
    return out.astype(q.dtype)


def paged_decode_step_compute(cfg: ModelConfig, params, cache, page_table, tokens, positions, head_mesh=None):
    """The read-only half of a paged decode step (one token per row).

    cache: tuple over layers of (K, V) [num_pages, H_kv, P, D]; page_table: i32[B, max_pages];
    tokens, positions: i32[B] (positions[b] = tokens already cached for row b). Returns
    (logits f32[B, V], new_k [L, B, H_kv, D], new_v [L, B, H_kv, D]) for `paged_write`.
    head_mesh: see `paged_decode_attention`.
    """
    x = tfm.embed(params, tokens)
    layer = tfm.DecoderLayer(cfg)
    new_k, new_v = [], []
    for layer_params, (K, V) in zip(params["layers"], cache):
        q, k, v = tfm.layer_qkv(cfg, layer_params, x, positions)
        attn = paged_decode_attention(q, K, V, page_table, positions, k, v, head_mesh).reshape(x.shape[0], 1, -1)
        x = layer.apply({"params": layer_params}, x[:, None], attn,
                        method=tfm.DecoderLayer.attn_out_and_mlp)[:, 0]
        new_k.append(k)
        new_v.append(v)
    return tfm.final_logits(cfg, params, x), jnp.stack(new_k), jnp.stack(new_v)


def gather_context(pages, page_table):
    """A request's pages as one sequence: [num_pages, H_kv, P, D] -> [B, H_kv, max_pages*P, D]
    (one XLA gather)."""
    B, max_pages = page_table.shape
    _, H_kv, P, D = pages.shape
    return pages[page_table].transpose(0, 2, 1, 3, 4).reshape(B, H_kv, max_pages * P, D)


def chunk_attention(q, k, v, K_pages, V_pages, page_table, start, lengths, native: bool = False):
    """Causal attention of a prefill chunk over the request's earlier tokens plus the chunk.

    q: [B, C, H, D]; k, v: [B, C, H_kv, D] (the chunk, RoPE applied); K_pages, V_pages:
    [num_pages, H_kv, P, D]; page_table: i32[B, max_pages] covering positions < start[b];
    start, lengths: i32[B] (chunk token j of row b is at position start[b] + j, valid when
    j < lengths[b]). Returns [B, C, H*D]. Queries are processed PREFILL_QUERY_CHUNK at a time
    for long chunks, as in whole-prompt prefill. native: where lowered for CPU, the native kernel
    instead (`dispatch.chunk_prefill_attention`; equal to ~1e-6).
    """
    if native:
        return dispatch.chunk_prefill_attention(q, k, v, K_pages, V_pages, page_table, start, lengths,
                                                reference=chunk_attention)
    B, C = q.shape[:2]
    step = tfm.PREFILL_QUERY_CHUNK
    if C <= step or C % step:
        return _paged_chunk_attention(q, k, v, K_pages, V_pages, page_table, start, lengths, jnp.arange(C))
    q_chunks = q.reshape(B, C // step, step, *q.shape[2:]).swapaxes(0, 1)
    offsets = jnp.arange(C).reshape(C // step, step)
    out = lax.map(lambda a: _paged_chunk_attention(a[0], k, v, K_pages, V_pages, page_table, start, lengths, a[1]),
                  (q_chunks, offsets))  # [n, B, step, H*D]
    return out.swapaxes(0, 1).reshape(B, C, -1)


# Context tokens per key block of `_paged_chunk_attention` (rounded to whole pages).
CONTEXT_BLOCK = 512


def _paged_chunk_attention(q, k, v, K_pages, V_pages, page_table, start, lengths, query_j):
    """`chunk_attention` for queries at chunk offsets query_j: i32[c] (q: [B, c, H, D]), with an
    online softmax (flash-attention's recurrence) over key blocks of CONTEXT_BLOCK context tokens,
    gathered from the pages one block at a time, then the chunk's own keys.

    The loop runs ceil(max(start) / block) times, a bound known only at run time: a chunk's cost
    follows its own position in the prompt, not the width of the page table (the whole reservation,
    bucketed, so every chunk of a prompt runs one compiled program). Gathering the whole table and
    masking it made each 512-token chunk of a 4K prompt attend over 8K keys, 4x the causal work.
    """
    B, c, H, D = q.shape
    _, H_kv, P, _ = K_pages.shape
    C = k.shape[1]
    max_pages = page_table.shape[1]
    bp = max(1, min(max_pages, CONTEXT_BLOCK // P))  # pages per key block
    n_blocks = -(-max_pages // bp)
    if n_blocks * bp != max_pages:  # a table width that is not a multiple: pad with the null page (masked)
        page_table = jnp.pad(page_table, ((0, 0), (0, n_blocks * bp - max_pages)), constant_values=NULL_PAGE)
    blk = bp * P
    qg = q.reshape(B, c, H_kv, H // H_kv, D).transpose(0, 2, 3, 1, 4)  # [B, H_kv, G, c, D]
    scale = D ** -0.5

    def update(carry, s, v_blk):  # s: [B, H_kv, G, c, n] masked scores; v_blk: [B, H_kv, n, D]
        m, l, acc = carry
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgtn,bknd->bkgtd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
        return m_new, l * rescale + p.sum(-1), acc * rescale[..., None] + pv

    def context_block(j, carry):
        table = lax.dynamic_slice_in_dim(page_table, j * bp, bp, axis=1)  # [B, bp]
        K_blk, V_blk = gather_context(K_pages, table), gather_context(V_pages, table)  # [B, H_kv, blk, D]
        s = jnp.einsum("bkgtd,bknd->bkgtn", qg, K_blk, preferred_element_type=jnp.float32) * scale
        ok = (j * blk + jnp.arange(blk))[None, :] < start[:, None]  # [B, blk]
        return update(carry, jnp.where(ok[:, None, None, None, :], s, tfm._MASK_VALUE), V_blk)

    stats = qg.shape[:-1]
    init = (jnp.full(stats, tfm._MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(qg.shape, jnp.float32))
    needed = jnp.minimum((jnp.max(start) + blk - 1) // blk, n_blocks)
    carry = lax.fori_loop(0, needed, context_block, init)
    k_c = k.transpose(0, 2, 1, 3).astype(K_pages.dtype)  # [B, H_kv, C, D], as the pages hold them
    v_c = v.transpose(0, 2, 1, 3).astype(V_pages.dtype)
    s = jnp.einsum("bkgtd,bknd->bkgtn", qg, k_c, preferred_element_type=jnp.float32) * scale
    key_j = jnp.arange(C)
    ok = (key_j[None, :] <= query_j[:, None])[None] & (key_j[None, None, :] < lengths[:, None, None])  # [B, c, C]
    _, l, acc = update(carry, jnp.where(ok[:, None, None], s, tfm._MASK_VALUE), v_c)
    any_key = ((start > 0) | (lengths > 0))[:, None, None, None]  # else every key is masked: zeros, as `attention`
    o = jnp.where(any_key[..., None], acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, c, H * D).astype(q.dtype)


def context_attention(q, k, v, K_ctx, V_ctx, start, lengths):
    """`chunk_attention` over a context given as arrays: K_ctx, V_ctx [B, H_kv, n_ctx, D] hold row
    b's earlier tokens at positions < start[b] (the rest is masked). Returns [B, C, H*D]."""
    B, C = q.shape[:2]
    K = jnp.concatenate([K_ctx, k.transpose(0, 2, 1, 3).astype(K_ctx.dtype)], 2)
    V = jnp.concatenate([V_ctx, v.transpose(0, 2, 1, 3).astype(V_ctx.dtype)], 2)
    n_ctx = K.shape[2] - C
    context_ok = jnp.arange(n_ctx)[None, :] < start[:, None]  # [B, n_ctx]
    key_j = jnp.arange(C)
    chunk_key_ok = key_j[None, :] < lengths[:, None]  # [B, C]

    def attend(q_c, query_j):  # q_c: [B, c, H, D]; query_j: i32[c] (chunk offsets of the queries)
        causal = key_j[None, :] <= query_j[:, None]  # [c, C]
        mask = jnp.concatenate([jnp.broadcast_to(context_ok[:, None, :], (B, len(query_j), n_ctx)),
                                causal[None] & chunk_key_ok[:, None, :]], axis=2)  # [B, c, n_ctx + C]
        return tfm.attention(q_c, K, V, mask[:, None])

    step = tfm.PREFILL_QUERY_CHUNK
    if C <= step or C % step:
        return attend(q, key_j)
    q_chunks = q.reshape(B, C // step, step, *q.shape[2:]).swapaxes(0, 1)
    out = lax.map(lambda a: attend(*a), (q_chunks, key_j.reshape(C // step, step)))  # [n, B, step, H*D]
    return out.swapaxes(0, 1).reshape(B, C, -1)


def prefill_chunk_compute(cfg: ModelConfig, params, cache, page_table, tokens, start, lengths,
                          native_attention: bool = False):
    """The read-only half of a chunked-prefill step.

    tokens: i32[B, C] at positions start[b] + j (start, lengths: i32[B]; lengths[b] <= C valid
    tokens, right-padded). Returns (logits f32[B, V] at each row's last valid chunk token,
    new_k [L, B, H_kv, C, D], new_v [L, B, H_kv, C, D]) for `paged_write_prefill`.
    native_attention: `chunk_attention(native=True)` (a model whose arrays are not sharded).
    """
    B, C = tokens.shape
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    x = tfm.embed(params, tokens)
    layer = tfm.DecoderLayer(cfg)
    new_k, new_v = [], []
    for layer_params, (K, V) in zip(params["layers"], cache):
        q, k, v = layer.apply({"params": layer_params}, x, positions, method=tfm.DecoderLayer.qkv)
        attn = chunk_attention(q, k, v, K, V, page_table, start, lengths, native=native_attention)
        x = layer.apply({"params": layer_params}, x, attn, method=tfm.DecoderLayer.attn_out_and_mlp)
        new_k.append(k.transpose(0, 2, 1, 3))
        new_v.append(v.transpose(0, 2, 1, 3))
    last = x[jnp.arange(B), jnp.clip(lengths - 1, 0, C - 1)]
    return tfm.final_logits(cfg, params, last), jnp.stack(new_k), jnp.stack(new_v)


def prefill_layer_after(cfg: ModelConfig, layer_params, x, positions, K_ctx, V_ctx, start, lengths):
    """One prefill layer of the tokens after each row's cached prefix, returning the whole prompt's KV.

    x: [B, C, hidden] (row b's tokens at positions start[b] + j, positions: i32[B, C], lengths[b]
    valid); K_ctx, V_ctx: [B, H_kv, T, D], row b's cached KV at positions < start[b] (zeros after).
    Returns (x, K, V): K, V [B, H_kv, T, D], the context with the chunk's rows placed at
    start[b] + j (what a whole-prompt prefill's layer gives for positions < start[b] + lengths[b]).
    """
    layer = tfm.DecoderLayer(cfg)
    q, k, v = layer.apply({"params": layer_params}, x, positions, method=tfm.DecoderLayer.qkv)
    attn = context_attention(q, k, v, K_ctx, V_ctx, start, lengths)
    x = layer.apply({"params": layer_params}, x, attn, method=tfm.DecoderLayer.attn_out_and_mlp)
    T, C = K_ctx.shape[2], x.shape[1]

    def place(ctx, new, s):  # ctx: [H_kv, T, D]; new: [C, H_kv, D] to positions s.. (room past T: no clamping)
        grown = jnp.pad(ctx, ((0, 0), (0, C), (0, 0)))
        return lax.dynamic_update_slice(grown, new.transpose(1, 0, 2).astype(ctx.dtype), (0, s, 0))[:, :T]

    return x, jax.vmap(place)(K_ctx, k, start), jax.vmap(place)(V_ctx, v, start)
