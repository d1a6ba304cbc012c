"""Quest: query-aware page selection from per-page key bounds (Tang et al., ICML 2024).

Keys are cut into pages of `page_size` tokens; each page keeps the channel-wise min and max
of its keys. For a query q the page's upper bound is sum_d max(q_d·min_d, q_d·max_d), which is
>= q·k for every key k in the page. The pages with the largest score are chosen until the
token budget is covered (the score combines the GQA group's bounds: `group_score`, by default
the summed softmax of bound/√D, Quest's own rule is the max): ceil(budget / page_size) pages,
whose real tokens are all selected. The page holding the newest tokens is always one of them
(`keep_last_page`), and so are the pages of the first `keep_sinks` and newest `keep_recent`
tokens: Quest's implementation ranks only the full pages and always attends the
last one (its page budget counts it), because a partly filled page has a loose-looking but
small bound while holding the tokens local attention heads need most.

Metadata: (kmin, kmax), each [B, H_kv, P, D] with P = ceil(N_cap / page_size); empty slots hold
+inf / -inf so they never tighten a bound. They are stored as `metadata_dtype` with outward
rounding: kmin rounded toward -inf, kmax toward +inf, so the stored box still contains every key
and the page bound stays >= q·k. Float dtypes round the values themselves (`base.round_outward`).

"int8" stores integer codes on a per-(request, KV head, channel) grid `scale: f32[B, H_kv, 1, D]`
= max |K| over the prompt's keys / 126: kmin -> floor(kmin / scale), kmax -> ceil(kmax / scale)
(each nudged one step outward where float rounding of code·scale crossed the value), so
code·scale still brackets every key. Codes -126..126 are values; beyond them (a decoded key
larger than every prompt key) kmin saturates to -127 = -inf and kmax to 127 = +inf, which keeps
the bound an upper bound (it becomes +inf for a q of the matching sign). Empty pages hold
kmin = 127 (+inf), kmax = -127 (-inf). The code order is the value order, so `append` still takes
min / max of codes. Bytes: 2·D per page and KV head instead of 4·D at float16, so 2-token pages
cost what 4-token float16 pages do (the scale adds 4·D bytes per KV head once per request).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jkv.selection.base import (METADATA_DTYPES, Selector, SelectorConfig, check_group_score, group_queries,
                                reduce_group, round_outward, token_valid)
from jkv.selection._ops import topk_select


QUEST_METADATA_DTYPES = METADATA_DTYPES + ("int8",)
INT8_LEVELS = 126  # codes -126..126 are values; -127 / 127 are the -inf / +inf sentinels


@dataclasses.dataclass(frozen=True)
class QuestConfig(SelectorConfig):
    # Quest uses 16-token pages at 8K-32K contexts, where a 1K-4K token budget spans 64-256
    # pages. At the 0.5-2K prompts we evaluate, a 20% budget is 100-400 tokens: 16-token pages
    # would leave 6-26 pages and coarse bounds (attention mass kept 0.87 vs Oracle's 0.97 on
    # SmolLM2-135M at 1K). Smaller pages bound tighter but ship more min/max vectors; int8 codes
    # (module docstring) halve their bytes, so 2-token int8 pages cost what 4-token float16 pages
    # did. Measured (experiments/metadata_dtype.py --quest-only, fidelity @1K, ratio 0.2, samples
    # 0-7, 248 decoded tokens; top-1 / KL / metadata bytes per token per sparse layer):
    #   float16 page 4: 0.944 / 0.0131 / 193      int8 page 4: 0.944 / 0.0130 / 98
    #   float16 page 2: 0.952 / 0.0100 / 385      int8 page 3: 0.956 / 0.0117 / 130
    #   int8 page 2 (default): 0.952 / 0.0098 / 194 (int8 loses nothing against float16 at a page size)
    page_size: int = 2
    keep_last_page: bool = True  # Quest always attends the newest (partly filled) page
    metadata_dtype: str = "int8"  # page min/max storage, rounded outward (see module docstring)
    # Ranking of the pages (base.reduce_group over bound/√D) and the pages always kept (those
    # holding the first keep_sinks and the newest keep_recent tokens, inside the page budget).
    # Measured on SmolLM2-135M, fidelity @1K, ratio 0.2, samples 0-7 (248 decoded tokens; Oracle
    # top-1 0.956, attention mass kept 0.966): Quest's rule ("max" over the group, last page
    # only) top-1 0.923, KL 0.0190, mass 0.9129; "mass" + 4 sinks + 16 recent top-1 0.944,
    # KL 0.0131, mass 0.9235. bound_temperature 0.5 / 2 kept mass 0.9224 / 0.9224 (no gain).
    group_score: str = "mass"
    bound_temperature: float = 1.0  # "mass": softmax over bound / (√D · bound_temperature)
    keep_sinks: int = 4
    keep_recent: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.metadata_dtype not in QUEST_METADATA_DTYPES:
            raise ValueError(f"metadata_dtype={self.metadata_dtype!r} must be one of {QUEST_METADATA_DTYPES}; "
                             "float16 halves the page bounds the prefill side ships (SmartGen §4.4), int8 "
                             "quarters them (outward-rounded codes on a per-channel grid), float32 keeps them exact")
        check_group_score(self.group_score)
        if not (isinstance(self.bound_temperature, (int, float)) and self.bound_temperature > 0):
            raise ValueError(f"bound_temperature={self.bound_temperature!r} must be > 0")
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise ValueError(f"page_size={self.page_size!r} must be an int >= 1")
        if not isinstance(self.keep_last_page, bool):
            raise ValueError(f"keep_last_page={self.keep_last_page!r} must be a bool")


def page_bounds(K: jax.Array, lengths: jax.Array, page_size: int,
                dtype: str = "float32") -> tuple[jax.Array, jax.Array]:
    """K: [B, H_kv, N_cap, D] -> (kmin, kmax): [B, H_kv, P, D] over each page's real tokens, as
    `dtype` with kmin rounded down and kmax rounded up (the box still contains every key)."""
    batch, num_kv_heads, capacity, head_dim = K.shape
    num_pages = -(-capacity // page_size)
    pad = num_pages * page_size - capacity
    valid = token_valid(lengths, capacity)[:, None, :, None]
    K = K.astype(jnp.float32)
    lo = jnp.pad(jnp.where(valid, K, jnp.inf), ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=jnp.inf)
    hi = jnp.pad(jnp.where(valid, K, -jnp.inf), ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=-jnp.inf)
    shape = (batch, num_kv_heads, num_pages, page_size, head_dim)
    kmin, kmax = lo.reshape(shape).min(axis=3), hi.reshape(shape).max(axis=3)
    return round_outward(kmin, dtype, "down"), round_outward(kmax, dtype, "up")


def int8_scale(K: jax.Array, lengths: jax.Array) -> jax.Array:
    """K: [B, H_kv, N_cap, D] -> f32[B, H_kv, 1, D]: the code step, max |K| over real tokens / 126
    (1 where a channel is all zero, so every step is > 0)."""
    valid = token_valid(lengths, K.shape[2])[:, None, :, None]
    absmax = jnp.where(valid, jnp.abs(K.astype(jnp.float32)), 0.0).max(axis=2, keepdims=True)
    return jnp.where(absmax > 0, absmax / INT8_LEVELS, 1.0)


def quantize_outward(x: jax.Array, scale: jax.Array, direction: str) -> jax.Array:
    """f32 x (±inf allowed) -> int8 codes c with c·scale <= x ("down", for kmin) or >= x ("up",
    for kmax) in float32 arithmetic; out-of-range values take the outward sentinel (-127 = -inf
    down, 127 = +inf up) or clip inward (still a bound). Empty (+inf down / -inf up) -> 127 / -127."""
    x = x.astype(jnp.float32)
    if direction == "down":
        code = _codes_down(x, scale)
    elif direction == "up":  # ceil(r) = -floor(-r), and IEEE negation is exact: the mirror of "down"
        code = -_codes_down(-x, scale)
    else:
        raise ValueError(f"direction={direction!r} must be 'down' or 'up'")
    return code.astype(jnp.int8)


def _codes_down(x: jax.Array, scale: jax.Array) -> jax.Array:
    """f32 codes c = floor(x / scale) with c·scale <= x, clipped / saturated as `quantize_outward`."""
    code = jnp.floor(jnp.where(jnp.isfinite(x), x / scale, 0.0))
    code = jnp.where(code * scale > x, code - 1, code)  # the division rounded up past x
    code = jnp.where(code < -INT8_LEVELS, -INT8_LEVELS - 1, jnp.minimum(code, INT8_LEVELS))
    return jnp.where(x == jnp.inf, INT8_LEVELS + 1, jnp.where(x == -jnp.inf, -INT8_LEVELS - 1, code))


def dequantize_bounds(kmin: jax.Array, kmax: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 codes [B, H_kv, P, D] and scale f32[B, H_kv, 1, D] -> f32 (kmin, kmax) with the
    sentinels as ±inf (the form `page_upper_bound` takes)."""
    def value(code):
        v = code.astype(jnp.float32) * scale
        return jnp.where(code == INT8_LEVELS + 1, jnp.inf, jnp.where(code == -INT8_LEVELS - 1, -jnp.inf, v))

    return value(kmin), value(kmax)


def page_upper_bound(q: jax.Array, kmin: jax.Array, kmax: jax.Array) -> jax.Array:
    """q: [B, H_kv, G, D], kmin/kmax: [B, H_kv, P, D] (any float dtype) -> f32[B, H_kv, G, P]
    (>= q·k in the page). Empty pages (min=+inf) give -inf; a channel bound that saturated to
    ±inf (a key beyond float16's range) gives +inf, never NaN."""
    q = q.astype(jnp.float32)[:, :, :, None, :]
    lo, hi = kmin.astype(jnp.float32)[:, :, None], kmax.astype(jnp.float32)[:, :, None]
    empty = jnp.isinf(lo[..., 0]) & (lo[..., 0] > 0)
    # Guard the empty pages' infinities before the product, and q_d = 0 against a saturated
    # channel (0 * inf would be NaN).
    lo, hi = jnp.where(empty[..., None], 0.0, lo), jnp.where(empty[..., None], 0.0, hi)
    bound = jnp.where(q == 0, 0.0, jnp.maximum(q * lo, q * hi)).sum(axis=-1)
    return jnp.where(empty, -jnp.inf, bound)


class Quest(Selector):
    name = "quest"

    def _prepare(self, state, K, lengths):
        # N_cap travels in the shape of an empty leaf [B, N_cap, 0] (no bytes): like every metadata
        # leaf it has the request axis first, along which the decode worker stacks and splits a
        # batch (a leaf without it broke `--selector quest` disaggregated, issue 23).
        capacity = jnp.zeros((K.shape[0], K.shape[2], 0), jnp.int8)
        if self.config.metadata_dtype == "int8":
            kmin, kmax = page_bounds(K, lengths, self.config.page_size)
            scale = int8_scale(K, lengths)
            return {"kmin": quantize_outward(kmin, scale, "down"), "kmax": quantize_outward(kmax, scale, "up"),
                    "scale": scale, "capacity": capacity}
        kmin, kmax = page_bounds(K, lengths, self.config.page_size, self.config.metadata_dtype)
        return {"kmin": kmin, "kmax": kmax, "capacity": capacity}

    def bounds(self, metadata) -> tuple[jax.Array, jax.Array]:
        """The stored page box as arrays `page_upper_bound` takes: (kmin, kmax) [B, H_kv, P, D]."""
        if self.config.metadata_dtype == "int8":
            return dequantize_bounds(metadata["kmin"], metadata["kmax"], metadata["scale"])
        return metadata["kmin"], metadata["kmax"]

    def _append(self, state, metadata, k_new, positions):
        page = positions // self.config.page_size
        k_new = k_new.astype(jnp.float32)
        if self.config.metadata_dtype == "int8":
            # The grid stays the prompt's (the scale is fixed at prefill), so the codes stay
            # comparable; a key beyond it takes the ±inf sentinel (see the module docstring).
            scale = metadata["scale"][:, :, 0]
            k_lo, k_hi = quantize_outward(k_new, scale, "down"), quantize_outward(k_new, scale, "up")
        else:
            # Rounding is monotone, so min(round_down(a), round_down(b)) = round_down(min(a, b)):
            # appending keeps the metadata identical to preparing the longer sequence.
            k_lo = round_outward(k_new, self.config.metadata_dtype, "down")
            k_hi = round_outward(k_new, self.config.metadata_dtype, "up")

        def update(bounds, value, p, op):
            current = jax.lax.dynamic_slice_in_dim(bounds, p, 1, axis=1)[:, 0]
            return jax.lax.dynamic_update_slice_in_dim(bounds, op(current, value)[:, None], p, axis=1)

        kmin = jax.vmap(lambda b, v, p: update(b, v, p, jnp.minimum))(metadata["kmin"], k_lo, page)
        kmax = jax.vmap(lambda b, v, p: update(b, v, p, jnp.maximum))(metadata["kmax"], k_hi, page)
        return {**metadata, "kmin": kmin, "kmax": kmax}

    def kv_geometry(self, metadata):
        return metadata["kmin"].shape[1], metadata["capacity"].shape[1]

    def _select(self, state, q, metadata, lengths):
        kmin, kmax = self.bounds(metadata)
        batch, num_kv_heads, num_pages, _ = kmin.shape
        capacity = metadata["capacity"].shape[1]
        page_size = self.config.page_size
        bound = page_upper_bound(group_queries(q, num_kv_heads), kmin, kmax)  # [B, H_kv, G, P]
        # A +inf bound (a channel saturated: a decoded key beyond the int8 grid or float16's
        # range) says nothing about the page: it ranks first, like the kept pages, and stays out
        # of the softmax (where one +inf would turn the whole head's scores into NaN).
        unbounded = (bound == jnp.inf).any(axis=2)  # [B, H_kv, P]
        bound = jnp.where(bound == jnp.inf, -jnp.inf, bound)
        if self.config.group_score == "max":
            bound = bound.max(axis=2)  # Quest: a page counts if any head of the group wants it
        else:
            scale = 1.0 / (jnp.sqrt(jnp.float32(kmin.shape[-1])) * self.config.bound_temperature)
            bound = reduce_group(bound * scale, self.config.group_score)
        page = jnp.arange(num_pages, dtype=jnp.int32)[None, None, :]
        protect = unbounded | (page * page_size < self.config.keep_sinks)  # and pages holding a sink token
        if self.config.keep_recent:  # pages holding one of the newest keep_recent tokens
            first_recent = jnp.maximum(lengths - self.config.keep_recent, 0) // page_size
            protect |= (page >= first_recent[:, None, None]) & (page * page_size < lengths[:, None, None])
        if self.config.keep_last_page:  # Quest: the last page is attended outside the top-k
            last_page = (lengths - 1) // page_size
            protect |= page == last_page[:, None, None]
        bound = jnp.where(protect, jnp.inf, bound)
        pages_max = min(num_pages, -(-self.config.budget(capacity) // page_size))
        row_pages = jnp.repeat(-(-lengths // page_size), num_kv_heads)  # non-empty pages per row
        page_index = topk_select(bound.reshape(batch * num_kv_heads, num_pages), row_pages, pages_max)
        budget_pages = -(-self.config.budget(jnp.repeat(lengths, num_kv_heads)) // page_size)
        slot = jnp.arange(pages_max, dtype=jnp.int32)[None, :]
        page_index = jnp.where(slot < budget_pages[:, None], page_index, -1)
        # Expand pages to tokens, drop padding, then move the valid tokens to the row's front.
        tokens = page_index[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
        tokens = tokens.reshape(batch * num_kv_heads, pages_max * page_size)
        row_lengths = jnp.repeat(lengths, num_kv_heads)
        real = (page_index[:, :, None] >= 0).repeat(page_size, axis=2).reshape(tokens.shape)
        real &= tokens < row_lengths[:, None]
        order = jnp.argsort(~real, axis=1, stable=True)
        tokens = jnp.take_along_axis(jnp.where(real, tokens, -1), order, axis=1)
        return tokens
