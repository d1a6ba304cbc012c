"""The KV-selection protocol shared by every selector (DESIGN.md "KV selection").

A selector turns one decode query into the token positions each KV head attends to:

    meta = selector.prepare(layer, K, lengths)          # prefill side, once per layer
    meta = selector.append(layer, meta, k_new, pos)      # decode side, the new token's key
    kv_index = selector.select(layer, q, meta, lengths)  # decode side, every step

Shapes: `K: [B, H_kv, N_cap, D]` (slots >= lengths[b] are padding), `q: [B, H, D]`,
`k_new: [B, H_kv, D]`, `kv_index: i32[B*H_kv, k]`. Row `b*H_kv + h` holds positions for
request b and KV head h; the valid entries form a prefix of the row and every slot after
them is -1. The query heads `h*G .. h*G+G-1` (G = H / H_kv) share KV head h, and their
scores are aggregated per KV head (GQA). Layers below `dense_layers` (0 and 1 by default)
always return every token. The per-row budget is `k = min(N, max(ceil(max_ratio * N), min_budget))`
(SmartGen §5.1, max ratio 0.2, plus a floor of `min_budget` tokens, `selection_budget`), and a row
with `N <= min_budget` takes every token in position order, exactly as a dense layer does
(`Selector.select`), so a prompt shorter than the floor decodes like dense attention. The row
width is the budget of the capacity `N_cap`, so shapes stay static under `jit` while N grows.

Everything here is pure JAX on device arrays; the metadata is a small pytree per layer.
"""
from __future__ import annotations

import abc
import copy
import dataclasses
import hashlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jkv.selection._ops import kernels_in_use, topk_select, topk_select_fused

Metadata = Any  # a pytree of device arrays, one per layer


@dataclasses.dataclass(frozen=True)
class SelectorConfig:
    """Settings every selector shares."""

    max_ratio: float = 0.2  # SmartGen §5.1: maximum KV selection ratio of 20%
    dense_layers: int = 2  # DESIGN.md: layers 0 and 1 always use every token
    # Always-kept tokens, counted inside the budget k (it never grows): the first `keep_sinks`
    # (attention sinks, StreamingLLM §3) and the newest `keep_recent` of each request. 0 / 0 here;
    # the approximate selectors set their own defaults (see their configs).
    keep_sinks: int = 0
    keep_recent: int = 0
    # Floor of the per-row budget, in tokens: k = min(N, max(ceil(max_ratio * N), min_budget)), and
    # rows with N <= min_budget attend to every token (dense). 0 here (the bare ratio, what the
    # accuracy harness measures); the engines (Disaggregation, `jkv serve`) default to
    # DEFAULT_MIN_BUDGET, so short prompts decode exactly like the dense server.
    min_budget: int = 0

    def __post_init__(self):
        if not (isinstance(self.max_ratio, (int, float)) and 0.0 < self.max_ratio <= 1.0):
            raise ValueError(f"max_ratio={self.max_ratio!r} must be in (0, 1]; e.g. 0.2 keeps 20% of the KV")
        if not (isinstance(self.dense_layers, int) and self.dense_layers >= 0):
            raise ValueError(f"dense_layers={self.dense_layers!r} must be an int >= 0")
        for name in ("keep_sinks", "keep_recent"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name}={value!r} must be an int >= 0 (tokens always kept, inside the budget)")
        check_min_budget(self.min_budget)

    def budget(self, num_tokens):
        """This config's per-row budget k for `num_tokens` cached tokens (see `selection_budget`)."""
        return selection_budget(num_tokens, self.max_ratio, self.min_budget)


# The engines' default floor (Disaggregation.min_budget, `jkv serve --min-budget`). With it every
# prompt of up to 256 tokens decodes densely (chat turns, short completions: where sparse
# attention saves nothing, it costs nothing), and up to 1280 tokens the budget is 256 rather
# than 0.2 * N. Below ~200 tokens the bare ratio keeps a few dozen tokens or fewer (2 of a
# 6-token prompt) and greedy answers of SmolLM2-135M degenerate (issue 23); at 1K, where the
# floor only lifts k from 205 to 256, the selectors already agree with dense on 0.95-0.97 of next
# tokens (docs/selection.md), and from 1280 tokens on the floor changes nothing.
DEFAULT_MIN_BUDGET = 256


def check_min_budget(value) -> None:
    if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
        raise ValueError(f"min_budget={value!r} must be an int >= 0: the fewest tokens a selection keeps "
                         f"(prompts up to that length decode densely); 0 keeps the bare max_ratio budget, "
                         f"the engines default to {DEFAULT_MIN_BUDGET}")


def selection_budget(num_tokens, max_ratio: float, min_budget: int = 0):
    """k = max(ceil(max_ratio * N), min_budget), at least 1 and at most N; works on ints, numpy
    and jnp arrays. THE budget rule: every selector and every sparse path sizes its rows with it.

    The product is taken in float32 and nudged down by one part in 1e6 so 0.1 * 30 gives 3,
    identically on host and device.
    """
    xp = jnp if isinstance(num_tokens, jax.Array) else np
    n = xp.asarray(num_tokens, dtype=xp.int32)
    raw = n.astype(xp.float32) * xp.float32(max_ratio) * xp.float32(1.0 - 1e-6)
    k = xp.ceil(raw).astype(xp.int32)
    k = xp.minimum(xp.maximum(xp.maximum(k, min_budget), 1), n)
    return int(k) if np.ndim(num_tokens) == 0 and xp is np else k


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q: [B, H, D] -> [B, H_kv, G, D] with query head h*G+g serving KV head h."""
    batch, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)


def token_valid(lengths: jax.Array, capacity: int) -> jax.Array:
    """bool[B, N_cap]: slot n holds a real token of request b."""
    return jnp.arange(capacity, dtype=jnp.int32)[None, :] < lengths[:, None]


GROUP_SCORES = ("mass", "max", "sum")


def check_group_score(value) -> None:
    if value not in GROUP_SCORES:
        raise ValueError(f"group_score={value!r} must be one of {GROUP_SCORES}: 'mass' sums the group's "
                         "per-head softmax weights, 'max' takes each token's best head (log-weight relative "
                         "to that head's max), 'sum' adds the raw scores")


def reduce_group(scores: jax.Array, how: str) -> jax.Array:
    """Per-query-head scores f32[B, H_kv, G, N] (logit units, -inf on invalid slots) -> one score
    per KV head f32[B, H_kv, N] (GQA: the G query heads share the KV head's selection).

    "mass": sum over the group of softmax(scores) — the attention mass a token holds for the
    group, so top-k of it maximises the (estimated) mass kept (what Oracle ranks by).
    "max": max over the group of scores - max_n(scores), the token's best head's log-weight.
    "sum": sum of the raw scores (the summed query's score)."""
    if how == "mass":
        return jax.nn.softmax(scores, axis=-1).sum(axis=2)
    if how == "max":
        return (scores - scores.max(axis=-1, keepdims=True)).max(axis=2)
    if how == "sum":
        return scores.sum(axis=2)
    check_group_score(how)
    raise AssertionError(how)


def protected_tokens(lengths: jax.Array, capacity: int, sinks: int, recent: int) -> jax.Array:
    """bool[B, N_cap]: the first `sinks` and the newest `recent` real tokens of each request."""
    pos = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    lengths = lengths.astype(jnp.int32)[:, None]
    return (pos < lengths) & ((pos < sinks) | (pos >= lengths - recent))


def scores_to_index(scores: jax.Array, lengths: jax.Array, max_ratio: float,
                    keep: jax.Array | None = None, sinks: int = 0, recent: int = 0,
                    min_budget: int = 0, dropped: jax.Array | None = None) -> jax.Array:
    """Top-budget positions of per-KV-head scores.

    scores: f32[B, H_kv, N_cap]; lengths: i32[B]; keep: optional bool[B, H_kv, N_cap] that must
    also hold for a slot to be selected (entries failing it become -1 at the row's tail).
    sinks / recent: the first `sinks` and last `recent` tokens rank first (they are always
    selected while the budget holds them; they count in it). dropped: optional bool[B, H_kv, N_cap],
    slots a token-dropping profile removed (jkv/compression/dropping.py): they rank last, even
    below the protected ones, so the budget goes to kept tokens (the caller removes any that
    still made it in, when a row keeps fewer tokens than the budget).
    Returns kv_index: i32[B*H_kv, selection_budget(N_cap, max_ratio, min_budget)].
    """
    batch, num_kv_heads, capacity = scores.shape
    if sinks or recent:
        protect = protected_tokens(lengths, capacity, sinks, recent)[:, None, :]
        scores = jnp.where(protect, jnp.inf, scores)
    if dropped is not None:
        scores = jnp.where(dropped, -jnp.inf, scores)
    k_max = selection_budget(capacity, max_ratio, min_budget)
    row_lengths = jnp.repeat(lengths.astype(jnp.int32), num_kv_heads)
    index = topk_select(scores.reshape(batch * num_kv_heads, capacity), row_lengths, k_max)
    index = _within_budget(index, row_lengths, max_ratio, min_budget)
    if keep is not None:
        keep_rows = keep.reshape(batch * num_kv_heads, capacity)
        kept = jnp.take_along_axis(keep_rows, jnp.maximum(index, 0), axis=1)
        # Rows are sorted by descending score and `keep` is monotone in the score for every
        # caller (a threshold), so dropping entries only shortens the valid prefix.
        index = jnp.where(kept, index, -1)
    return index


def _within_budget(index: jax.Array, row_lengths: jax.Array, max_ratio: float, min_budget: int) -> jax.Array:
    """index i32[R, k_max] (a top-k_max per row) cut to each row's budget for row_lengths i32[R]."""
    budget = selection_budget(row_lengths, max_ratio, min_budget)
    slot = jnp.arange(index.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(slot < budget[:, None], index, -1)


def fused_sum_applies(group_score: str, sinks: int, recent: int, dropped) -> bool:
    """Whether a selector's top-k is `sum_index`'s (trace time): the ranking is the group's summed
    q·k ("sum"), nothing outranks it (no kept sinks / recent tokens, no dropped slots) and the
    dispatch backend runs the kernels. Under "xla" the selectors keep their own jnp path."""
    return group_score == "sum" and not sinks and not recent and dropped is None and kernels_in_use()


def sum_index(queries: jax.Array, keys: jax.Array, lengths: jax.Array, max_ratio: float,
              min_budget: int = 0) -> jax.Array:
    """`scores_to_index` of the "sum" group score sum_g queries[b, h, g] · keys[b, h, n] (no kept
    or dropped slots), by `topk_select_fused`: the scores are computed in the kernel with one dot
    per position (the G query heads summed first) instead of G dots and an [B, H_kv, G, N] score
    tensor. A positive scale (1/sqrt(D)) does not change the ranking, so it is left out.

    queries: [B, H_kv, G, d]; keys: [B, H_kv, N_cap, d]; lengths: i32[B]
    -> kv_index i32[B*H_kv, selection_budget(N_cap, max_ratio, min_budget)]."""
    batch, num_kv_heads, capacity, dim = keys.shape
    k_max = selection_budget(capacity, max_ratio, min_budget)
    row_lengths = jnp.repeat(lengths.astype(jnp.int32), num_kv_heads)
    index = topk_select_fused(queries.reshape(batch * num_kv_heads, -1, dim),
                              keys.reshape(batch * num_kv_heads, capacity, dim), row_lengths, k_max)
    return _within_budget(index, row_lengths, max_ratio, min_budget)


def all_tokens_index(lengths: jax.Array, num_kv_heads: int, capacity: int) -> jax.Array:
    """Every real token for every KV head: i32[B*H_kv, N_cap], -1 on padding."""
    positions = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    row_lengths = jnp.repeat(lengths.astype(jnp.int32), num_kv_heads)
    return jnp.where(positions < row_lengths[:, None], positions, -1)


def dense_below_budget(index: jax.Array, lengths: jax.Array, min_budget: int) -> jax.Array:
    """index: i32[B*H_kv, k] from a selector; rows of requests with lengths[b] <= min_budget are
    replaced by every token in position order (exactly what a dense layer attends to, so the
    output does not depend on the selector's ranking or summation order). Traceable."""
    rows, width = index.shape
    num_kv_heads = rows // lengths.shape[0]
    row_lengths = jnp.repeat(lengths.astype(jnp.int32), num_kv_heads)
    short = row_lengths <= min_budget
    positions = jnp.arange(width, dtype=jnp.int32)[None, :]
    dense = jnp.where(positions < row_lengths[:, None], positions, -1)
    return jnp.where(short[:, None], dense, index)


METADATA_DTYPES = ("float16", "bfloat16", "float32")


def check_metadata_dtype(value) -> None:
    """Validates a selector's `metadata_dtype` config value (a string, so configs pickle/asdict)."""
    if value not in METADATA_DTYPES:
        raise ValueError(f"metadata_dtype={value!r} must be one of {METADATA_DTYPES}; float16 halves the "
                         "metadata the prefill side ships (SmartGen §4.4), float32 keeps it exact")


def to_metadata_dtype(x: jax.Array, dtype: str) -> jax.Array:
    """Round-to-nearest cast for stored metadata; values beyond the dtype's range saturate to its
    largest finite value (float16 overflows at 65504) instead of becoming inf."""
    dt = jnp.dtype(dtype)
    if dt == x.dtype:
        return x
    big = float(jnp.finfo(dt).max)
    return jnp.clip(x, -big, big).astype(dt)


def round_outward(x: jax.Array, dtype: str, direction: str) -> jax.Array:
    """Cast x to dtype rounding toward -inf (direction "down") or +inf ("up"), so the stored
    value still bounds x from below / above. ±inf stay ±inf; values past the dtype's range go
    to the infinity on their side when that is the outward direction, else to the largest finite."""
    dt = jnp.dtype(dtype)
    if dt == x.dtype:
        return x
    x = x.astype(jnp.float32)
    y = x.astype(dt)
    if direction == "down":
        return jnp.where(y.astype(jnp.float32) > x, jnp.nextafter(y, jnp.asarray(-jnp.inf, dt)), y)
    if direction == "up":
        return jnp.where(y.astype(jnp.float32) < x, jnp.nextafter(y, jnp.asarray(jnp.inf, dt)), y)
    raise ValueError(f"direction={direction!r} must be 'down' or 'up'")


def write_token(cache: jax.Array, value: jax.Array, positions: jax.Array) -> jax.Array:
    """cache: [B, H_kv, N_cap, X]; value: [B, H_kv, X]; writes value[b] at slot positions[b]."""
    def one(row, v, p):
        return jax.lax.dynamic_update_slice(row, v[:, None, :].astype(row.dtype), (0, p, 0))
    return jax.vmap(one)(cache, value, positions.astype(jnp.int32))


class Selector(abc.ABC):
    """Base class: subclasses implement `_prepare`, `_append` and `_scores`/`_select`."""

    name: ClassVar[str]

    def __init__(self, config: SelectorConfig):
        self.config = config
        self._prepare_jit = jax.jit(self._prepare)
        self._append_jit = jax.jit(self._append)
        self._select_jit = jax.jit(self._select_budgeted)

    # ---- public protocol ---------------------------------------------------------------
    def prepare(self, layer: int, K: jax.Array, lengths: jax.Array) -> Metadata:
        """K: [B, H_kv, N_cap, D] (RoPE applied), lengths: i32[B] -> this layer's metadata."""
        if K.ndim != 4:
            raise ValueError(f"K must be [B, H_kv, N_cap, D], got shape {K.shape}")
        return self._prepare_jit(self.layer_state(layer), jnp.asarray(K), jnp.asarray(lengths, jnp.int32))

    def append(self, layer: int, metadata: Metadata, k_new: jax.Array, positions: jax.Array) -> Metadata:
        """Adds the key of each request's new token (k_new: [B, H_kv, D]) at positions: i32[B]."""
        return self._append_jit(self.layer_state(layer), metadata, jnp.asarray(k_new),
                                jnp.asarray(positions, jnp.int32))

    def select(self, layer: int, q: jax.Array, metadata: Metadata, lengths: jax.Array) -> jax.Array:
        """q: [B, H, D] (see `decode_query`), lengths: i32[B] tokens now cached (incl. the new one)
        -> kv_index: i32[B*H_kv, k]."""
        lengths = jnp.asarray(lengths, jnp.int32)
        num_kv_heads, capacity = self.kv_geometry(metadata)
        if layer < self.config.dense_layers:
            return all_tokens_index(lengths, num_kv_heads, capacity)
        return self._select_jit(self.layer_state(layer), jnp.asarray(q), metadata, lengths)

    def append_traced(self, state, metadata: Metadata, k_new: jax.Array, positions: jax.Array) -> Metadata:
        """`append` with the layer's state passed in (`layer_state(layer)`): traceable inside a
        caller's jit, where one compiled program then serves every layer (the decode worker's
        per-layer program, jkv/disagg/decode_program.py)."""
        return self._append_jit(state, metadata, k_new, positions)

    def select_traced(self, state, q: jax.Array, metadata: Metadata, lengths: jax.Array,
                      dropped: jax.Array | None = None) -> jax.Array:
        """`select` of a selected (non-dense) layer with its state passed in; see `append_traced`.
        dropped: optional bool[B, H_kv, N_cap], slots a token-dropping profile removed: a selector
        with `masks_dropped` spends its budget on the other slots (the caller still removes
        dropped entries from the result: `jkv.kvcache.sparse.drop_dropped`)."""
        return self._select_jit(state, q, metadata, lengths, dropped)

    def _select_budgeted(self, state, q, metadata, lengths, dropped=None):
        """`_select`, then the budget floor: rows of requests with N <= min_budget take every token."""
        if dropped is not None and self.masks_dropped:
            index = self._select(state, q, metadata, lengths, dropped)
        else:
            index = self._select(state, q, metadata, lengths)
        min_budget = self.config.min_budget
        if not min_budget:
            return index
        capacity = self.kv_geometry(metadata)[1]
        if index.shape[1] < min(min_budget, capacity):  # a selector sized its rows without the floor
            raise AssertionError(f"{self.name}: kv_index width {index.shape[1]} < min(min_budget={min_budget}, "
                                 f"N_cap={capacity}); size rows with config.budget()")
        return dense_below_budget(index, lengths, min_budget)

    def with_min_budget(self, min_budget: int) -> "Selector":
        """This selector (same fitted state: skew, hash projection) with budget floor `min_budget`
        (see SelectorConfig.min_budget); itself when the floor is already that."""
        check_min_budget(min_budget)
        if self.config.min_budget == min_budget:
            return self
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, min_budget=min_budget)
        other._prepare_jit = jax.jit(other._prepare)  # the jits trace self.config: fresh ones
        other._append_jit = jax.jit(other._append)
        other._select_jit = jax.jit(other._select_budgeted)
        return other

    # Attributes derived from the class and the config (the jits above), left out of `program_key`.
    _DERIVED: ClassVar[frozenset] = frozenset({"config", "_prepare_jit", "_append_jit", "_select_jit"})

    def program_key(self) -> tuple:
        """A hashable value equal for two selectors that compute the same thing: the class, the
        config (each field with its type, so 1 and True or 1 and 1.0 stay apart) and a digest of
        every other attribute (the fitted state: InfiniGen's skew, HATA's hash projection; values
        as well as shapes and dtypes). `decode_program.programs_for` shares compiled decode
        programs between selectors by it: `LLM(disaggregation=...)` and `jkv serve` build a new
        selector object per engine, and keyed by the object each engine traced and compiled its
        programs again. An attribute of a type it cannot digest makes the key this object alone
        (never shared), as is any selector that is not a `Selector` (duck-typed ones)."""
        try:
            state = tuple((name, _digest(value)) for name, value in sorted(vars(self).items())
                          if name not in self._DERIVED)
            config = tuple((f.name, _digest(getattr(self.config, f.name))) for f in dataclasses.fields(self.config))
        except (TypeError, ValueError):  # e.g. a typed PRNG key array has no host bytes
            return ("object", self)
        return (type(self), type(self.config), config, state)

    def decode_query(self, layer: int, q: jax.Array, speculate) -> jax.Array:
        """The query `select` scores with. `speculate()` returns layer `layer`'s query computed
        from the previous layer's input (InfiniGen); most selectors use the true q."""
        del layer, speculate
        return q

    def layer_state(self, layer: int) -> Any:
        """Per-layer learned or fitted parameters (a pytree), or None."""
        del layer
        return None

    @property
    def is_dense(self) -> bool:
        return False

    masks_dropped: ClassVar[bool] = False  # `_select` takes `dropped` (scores_to_index ranks those slots last)
    ships_metadata: ClassVar[bool] = True  # False: rebuilt from lengths on the decode side (length-only)

    def metadata_nbytes(self, layer: int, num_kv_heads: int, head_dim: int, num_tokens: int) -> int:
        """Bytes `prepare(layer, ...)` returns for one `num_tokens` prompt: what a prefill worker
        ships for that layer (0 for selectors that do not ship metadata). Shapes only, no compute."""
        if not self.ships_metadata:
            return 0
        K = jax.ShapeDtypeStruct((1, num_kv_heads, num_tokens, head_dim), jnp.float32)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        out = jax.eval_shape(lambda k, n: self.prepare(layer, k, n), K, lengths)
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(out))

    # ---- to implement ------------------------------------------------------------------
    @abc.abstractmethod
    def _prepare(self, state, K, lengths) -> Metadata: ...

    @abc.abstractmethod
    def _append(self, state, metadata, k_new, positions) -> Metadata: ...

    @abc.abstractmethod
    def _select(self, state, q, metadata, lengths) -> jax.Array: ...

    @abc.abstractmethod
    def kv_geometry(self, metadata) -> tuple[int, int]:
        """(H_kv, N_cap) of the metadata."""


def _digest(value) -> tuple:
    """A hashable, type-tagged value of a config field or selector attribute (`program_key`):
    scalars and strings as they are, sequences and dicts element by element, arrays (numpy or jax,
    f32[L, H_kv, D, bits] for HATA: a few MB) as (dtype, shape, sha256 of their bytes). TypeError
    for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_digest(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple(sorted((repr(k), _digest(v)) for k, v in value.items())))
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        host = np.ascontiguousarray(np.asarray(value))
        return (np.ndarray, host.dtype.str, host.shape, hashlib.sha256(host.tobytes()).hexdigest())
    raise TypeError(f"cannot digest a {type(value).__name__}")


def dense_layer_count(selector, num_layers: int) -> int:
    """Layers [0, count) attend to every cached token: every layer for a dense selector,
    else the first `config.dense_layers` (works on duck-typed selectors too)."""
    return num_layers if selector.is_dense else selector.config.dense_layers
