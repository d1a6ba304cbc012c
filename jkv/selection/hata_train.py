"""Training HATA's hash projections with optax (`jkv train-hata`).

Per layer and KV head the projection W: [D, bits] is trained so that the relaxed Hamming
similarity tanh(qW)·tanh(kW)/bits ranks the true top-k keys of q·Kᵀ first: a listwise
cross-entropy of softmax(beta · similarity) against the uniform distribution over the exact
top-k (k = ceil(top_ratio · N) over the query's causal prefix), plus a bit-balance term that
keeps every bit's mean near zero (HATA §3, learning-to-hash with top-k labels). The starting
point is a random Gaussian projection (SimHash); `recall_at_k` measures both.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jkv.selection.calibration import Calibration
from jkv.selection.hata import hamming_similarity, hash_codes, save_weights

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HATATrainConfig:
    bits: int = 256
    train_steps: int = 300
    learning_rate: float = 2e-2
    top_ratio: float = 0.2  # label: the exact top 20% (SmartGen's max selection ratio)
    balance_weight: float = 0.1
    key_sample: int = 384  # keys per step, drawn at random (0 = all): cost and regularization
    query_sample: int = 128  # queries per KV head per step, drawn at random (0 = all)
    seed: int = 0
    # Label distribution of the listwise loss: "topk" = uniform over the exact top_ratio keys;
    # "attention" = the true attention weights softmax(q·k/√D) (the mass a selection keeps).
    # SmolLM2-135M, 1024-token prompt + 192 queries, 150 steps: held-out recall@20% of the exact
    # top-k 0.613 (random) -> 0.671 (topk) / 0.753 (attention); with 576 queries 0.594 -> 0.624 /
    # 0.709. In decode (fidelity @1K, 8 samples) attention-trained hashes keep 0.948 of the
    # attention mass vs 0.938 (topk-trained, same selector settings).
    target: str = "attention"

    def __post_init__(self):
        if self.bits <= 0 or self.bits % 32:
            raise ValueError(f"bits={self.bits} must be a positive multiple of 32")
        if self.train_steps < 1:
            raise ValueError(f"train_steps={self.train_steps} must be >= 1")
        if self.key_sample < 0 or self.query_sample < 0:
            raise ValueError(f"key_sample={self.key_sample} and query_sample={self.query_sample} must be >= 0 "
                             "(0 uses all)")
        if not 0 < self.top_ratio <= 1:
            raise ValueError(f"top_ratio={self.top_ratio} must be in (0, 1]")
        if self.target not in ("topk", "attention"):
            raise ValueError(f"target={self.target!r} must be 'topk' or 'attention'")


def stack_calibration(calibration: Calibration):
    """-> queries f32[L, H_kv, S*G, D], query positions i32[S*G], keys f32[L, H_kv, N, D]."""
    queries = np.stack(calibration.queries)  # [L, S, H, D]
    num_layers, num_samples, num_heads, head_dim = queries.shape
    num_kv_heads = calibration.keys[0].shape[1]
    group = num_heads // num_kv_heads
    grouped = queries.reshape(num_layers, num_samples, num_kv_heads, group, head_dim)
    grouped = grouped.transpose(0, 2, 1, 3, 4).reshape(num_layers, num_kv_heads, num_samples * group, head_dim)
    positions = np.repeat(calibration.query_positions, group)
    keys = np.stack(calibration.keys).transpose(0, 2, 1, 3)  # [L, H_kv, N, D]
    return jnp.asarray(grouped), jnp.asarray(positions), jnp.asarray(keys)


def topk_mask(scores, positions, top_ratio):
    """scores: f32[Q, N], positions: i32[Q] -> (bool[Q, N] the top ceil(top_ratio·(p+1)) of each
    row's causal prefix 0..p, bool[Q, N] causal validity)."""
    valid = jnp.arange(scores.shape[1])[None, :] <= positions[:, None]
    scores = jnp.where(valid, scores, -jnp.inf)
    k = jnp.ceil(top_ratio * (positions + 1)).astype(jnp.int32)
    ordered = -jnp.sort(-scores, axis=1)
    threshold = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=1)
    return valid & (scores >= threshold), valid


def exact_topk_mask(q, positions, K, top_ratio):
    """q: [Q, D], positions: i32[Q], K: [N, D] -> topk_mask of q·Kᵀ."""
    return topk_mask(q @ K.T, positions, top_ratio)


def init_projection(calibration: Calibration, bits: int, seed: int) -> np.ndarray:
    """Random Gaussian projection f32[L, H_kv, D, bits], scaled so x·W has unit spread."""
    keys = np.stack(calibration.keys)  # [L, N, H_kv, D]
    num_layers, _, num_kv_heads, head_dim = keys.shape
    scale = np.sqrt((keys ** 2).sum(-1).mean(1))  # [L, H_kv] typical key norm
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(num_layers, num_kv_heads, head_dim, bits)).astype(np.float32)
    return (w / np.maximum(scale, 1e-6)[:, :, None, None]).astype(np.float32)


def _head_loss(w, log_beta, q, positions, K, config):
    """Listwise loss of one KV head. q: [Q, D], positions: i32[Q] (index of each query's last
    visible key in K), K: [n, D], w: [D, bits]."""
    target, valid = exact_topk_mask(q, positions, K, config.top_ratio)
    bits = w.shape[-1]
    code_q, code_k = jnp.tanh(q @ w), jnp.tanh(K @ w)
    similarity = code_q @ code_k.T / bits  # [Q, n] in [-1, 1]
    logits = jnp.where(valid, jnp.exp(log_beta) * similarity, -jnp.inf)
    log_probs = jax.nn.log_softmax(logits, axis=1)
    if config.target == "attention":  # cross-entropy against the true attention weights
        weights = jax.nn.softmax(jnp.where(valid, q @ K.T / math.sqrt(q.shape[-1]), -jnp.inf), axis=1)
    else:  # uniform over the exact top-k
        weights = target / jnp.maximum(target.sum(1, keepdims=True), 1)
    rank = -jnp.where(valid, weights * log_probs, 0.0).sum(1).mean()
    balance = (code_k.mean(0) ** 2).mean()
    return rank + config.balance_weight * balance


def _trainer(config: HATATrainConfig):
    """-> (init(projection) -> (params, opt_state), step(params, state, rng, queries, positions, keys)
    -> (params, state, loss)): one Adam over the projection and per-head log_beta. The step is
    jitted per window shape (key and query samples drawn from that window)."""
    head_loss = functools.partial(_head_loss, config=config)
    per_head = jax.vmap(jax.vmap(head_loss, in_axes=(0, 0, 0, None, 0)), in_axes=(0, 0, 0, None, 0))

    def loss_fn(p, queries, positions, keys, key_index):
        # Labels are the exact top-k among the sampled keys: ranking within a random subset.
        sampled = keys[:, :, key_index]
        offsets = jnp.searchsorted(key_index, positions, side="right") - 1  # last sampled key <= position
        return per_head(p["w"], p["log_beta"], queries, offsets, sampled).mean()

    optimizer = optax.adam(config.learning_rate)

    @jax.jit
    def step(p, state, rng, queries, positions, keys):
        num_keys, num_queries = keys.shape[2], queries.shape[2]
        sample = config.key_sample if 0 < config.key_sample < num_keys else num_keys
        query_sample = config.query_sample if 0 < config.query_sample < num_queries else num_queries
        key_rng, query_rng = jax.random.split(rng)
        key_index = jnp.sort(jax.random.choice(key_rng, num_keys, (sample,), replace=False))
        query_index = jax.random.choice(query_rng, num_queries, (query_sample,), replace=False)
        loss, grads = jax.value_and_grad(loss_fn)(p, queries[:, :, query_index], positions[query_index], keys,
                                                  key_index)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    def init(projection):
        params = {"w": jnp.asarray(projection),
                  "log_beta": jnp.full(projection.shape[:2], math.log(config.bits / 8.0))}
        return params, optimizer.init(params)

    return init, step


def train_projection(calibration: Calibration, config: HATATrainConfig = HATATrainConfig(),
                     projection: np.ndarray | None = None) -> tuple[np.ndarray, list[float]]:
    """Fit hash projections on calibration queries/keys -> (f32[L, H_kv, D, bits], loss per step)."""
    queries, positions, keys = stack_calibration(calibration)
    if projection is None:
        projection = init_projection(calibration, config.bits, config.seed)
    init, step = _trainer(config)
    params, state = init(projection)
    losses = []
    rng = jax.random.key(config.seed)
    for i in range(config.train_steps):
        params, state, loss = step(params, state, jax.random.fold_in(rng, i), queries, positions, keys)
        losses.append(float(loss))
        if i % 50 == 0 or i == config.train_steps - 1:
            log.info("hata step %d loss %.4f", i, losses[-1])
    return np.asarray(params["w"]), losses


def train_projection_windows(calibrations: list[Calibration], config: HATATrainConfig = HATATrainConfig(),
                             projection: np.ndarray | None = None,
                             interleave: bool = False) -> tuple[np.ndarray, list[float]]:
    """Fit on several calibration windows -> (projection, losses of all steps), `config.train_steps`
    steps per window either way.

    In turn (interleave=False): every window starting from the previous one's projection (Adam
    restarted). One 1K window holds 192 decode queries per head for 256·64 weights per head;
    more windows show the hash more distinct queries and keys. SmolLM2-135M, fidelity @1K,
    ratio 0.2 (experiments/sel_ab.py, docs/selection.md): 4 windows × 150 steps KL 0.0091 ->
    0.0071 on samples 0-15, while 1 window × 450 steps gave 0.0086. In turn, the last windows
    weigh most: trained on windows of mixed lengths the hash fits the last length best.

    Interleaved: one Adam run of len(calibrations) · train_steps steps, step i on window
    i mod len(calibrations), so no window comes last (docs/selection.md, 'Held-out domain')."""
    if not calibrations:
        raise ValueError("calibrations must hold at least one Calibration window")
    if not interleave:
        losses: list[float] = []
        for calibration in calibrations:
            projection, window_losses = train_projection(calibration, config, projection)
            losses += window_losses
        return projection, losses
    stacked = [stack_calibration(c) for c in calibrations]
    if projection is None:
        projection = init_projection(calibrations[0], config.bits, config.seed)
    init, step = _trainer(config)
    params, state = init(projection)
    losses = []
    rng = jax.random.key(config.seed)
    total = config.train_steps * len(stacked)
    for i in range(total):
        params, state, loss = step(params, state, jax.random.fold_in(rng, i), *stacked[i % len(stacked)])
        losses.append(float(loss))
        if i % 100 == 0 or i == total - 1:
            log.info("hata step %d/%d (window %d) loss %.4f", i, total, i % len(stacked), losses[-1])
    return np.asarray(params["w"]), losses


def recall_at_k(projection: np.ndarray, calibration: Calibration, top_ratio: float = 0.2,
                layers: range | None = None) -> float:
    """Mean fraction of each query's exact top-k (q·Kᵀ) found in its Hamming top-k, over
    query heads, queries and `layers` (default: all)."""
    queries, positions, keys = stack_calibration(calibration)
    chosen = list(layers if layers is not None else range(queries.shape[0]))
    w = jnp.asarray(projection)[jnp.asarray(chosen)]
    queries, keys = queries[jnp.asarray(chosen)], keys[jnp.asarray(chosen)]
    bits = w.shape[-1]

    def head(w, q, K, positions):
        target, valid = exact_topk_mask(q, positions, K, top_ratio)
        codes_q = hash_codes(q[:, None, :], w[None])[:, 0]  # [Q, W]
        codes_k = hash_codes(K[:, None, :], w[None])[:, 0]  # [N, W]
        similarity = hamming_similarity(codes_q[:, None, :], codes_k[None, :, :], bits).astype(jnp.float32)
        # Break Hamming ties by position (lower first), as the selectors' top-k does.
        found, _ = topk_mask(similarity - 0.5 * jnp.arange(K.shape[0]) / K.shape[0], positions, top_ratio)
        return ((found & target).sum(1) / target.sum(1)).mean()

    per_head = jax.vmap(jax.vmap(head, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, None))
    return float(jax.jit(per_head)(w, queries, keys, positions).mean())


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `train-hata` on an argparse subparsers object."""
    parser = subparsers.add_parser("train-hata", help="train HATA hash weights on local calibration text")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF dir or .gguf path")
    parser.add_argument("--out", required=True, help="directory to write the orbax weights to")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="calibration prompt length")
    parser.add_argument("--decode-steps", type=int, default=192, help="teacher-forced decode steps (queries)")
    parser.add_argument("--windows", type=int, default=4,
                        help="disjoint calibration windows of prompt + decode tokens, trained on in turn")
    # joint by default: on held-out prose and unseen code it meets the 1.5-point gap to Oracle at 1K
    # and 2K where corpus misses at 2K, and on the project corpus (fidelity@1K, samples 0-23) it is
    # no worse (docs/selection.md, 'Fourth run'); its calibration adds the 2K windows (~2x the time).
    parser.add_argument("--calibration", choices=("corpus", "mix", "joint"), default="joint",
                        help="joint (default): the corpus windows and calibration.MIX_WINDOWS together "
                             "(calibration.joint_windows), interleaved; corpus: --windows windows of the "
                             "documentation corpus (--prompt-tokens + --decode-steps each), trained in turn; "
                             "mix: calibration.MIX_WINDOWS, prose and code at 1K and 2K with --decode-steps "
                             "queries each, in turn (docs/selection.md, 'Held-out domain')")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--bits", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", choices=("topk", "attention"), default="attention",
                        help="labels: uniform over the exact top 20%%, or the true attention weights")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from models import load_model

    from jkv.selection.calibration import MIX_WINDOWS, calibration_windows, joint_windows, mixed_calibration_windows

    config = HATATrainConfig(bits=args.bits, train_steps=args.train_steps, learning_rate=args.learning_rate,
                             seed=args.seed, target=args.target)
    model = load_model(args.model)
    if args.calibration == "mix":
        windows = mixed_calibration_windows(model, MIX_WINDOWS, args.decode_steps)
    elif args.calibration == "joint":
        windows = joint_windows(calibration_windows(model, args.windows, args.prompt_tokens, args.decode_steps),
                                mixed_calibration_windows(model, MIX_WINDOWS, args.decode_steps))
    else:
        windows = calibration_windows(model, args.windows, args.prompt_tokens, args.decode_steps)
    splits = [window.split(0.75) for window in windows]  # each window's last 25% of queries held out
    initial = init_projection(splits[0][0], config.bits, config.seed)
    projection, losses = train_projection_windows([train for train, _ in splits], config, initial,
                                                  interleave=args.calibration == "joint")
    sparse = range(2, model.cfg.num_layers)
    before = float(np.mean([recall_at_k(initial, held_out, layers=sparse) for _, held_out in splits]))
    after = float(np.mean([recall_at_k(projection, held_out, layers=sparse) for _, held_out in splits]))
    save_weights(args.out, projection, {"model": args.model, "bits": config.bits, "windows": len(windows),
                                        "calibration": args.calibration,
                                        "loss_first": losses[0],
                                        "loss_last": losses[-1], "recall_random": before, "recall_trained": after})
    # Windows differ in data, so compare within the last one (interleaved: its every len(windows)-th step).
    last = losses[len(windows) - 1::len(windows)] if args.calibration == "joint" else losses[-config.train_steps:]
    print(f"HATA weights -> {args.out}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(windows)} window(s) "
          f"(last window {last[0]:.4f} -> {last[-1]:.4f}), "
          f"held-out recall@20% {before:.3f} (random) -> {after:.3f} (trained)")
    return 0
