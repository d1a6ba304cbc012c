"""`jkv compress-profile`: Bayesian profiling of compression pipelines per workload (KVServe §5.2).

    jkv compress-profile --out profiles/ [--workloads code,qa,continuation] [--quick] [--limit 20]

For each workload class (`jkv.compression.workloads`): build samples locally, prefill them once,
run Algorithm 1 (`bayesian_search`) over the strategy space with `ModelObjective` (top-1 agreement
with the uncompressed cache over a teacher-forced continuation; CR with every container byte
counted, at the transfer's chunk size), and write the 3D Pareto set as a versioned profile file
`<out>/<workload>.json` (`jkv.compression.profiling.save_profile`). A tqdm bar counts evaluations.

The space: identity / Hadamard transforms x KIVI (2/3/4/8 bits, groups 32/128), per-token 4-bit and
entropy-coded (`ec40g128`, `ec80g128`) quantizers, per-layer mixed precision (the first layers and
the retrieval heads kept at higher precision: MixHQ written out as an explicit "mixed-..." table so
no calibration state travels with the profile) x codecs none / zstdh3. Retrieval heads are scored
DuoAttention-style from the first sample's real observation-window queries (its last 32 prompt
tokens replayed through the model). Plus token tiers (`tokens.TierConfig`, `tier_space`): per head
the SnapKV-most-attended tokens kept at 4 / 3 bits, optionally a 2-bit tier, the rest dropped, with
per-layer tables that give the more sensitive half of the layers (`workloads.layer_sensitivity`)
one more bit; `--no-tiers` leaves them out (hi-only ones are servable, jkv/compression/dropping.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

from jkv.compression.heads import attention_probs, classify_heads, observation_scores, retrieval_scores
from jkv.compression.profiling import SearchConfig, bayesian_search, build_profile, nominal_cr, save_profile
from jkv.compression.spec import CodecSpec, PipelineSpec, QuantizerSpec, TransformSpec
from jkv.compression.tokens import TierConfig
from jkv.compression.workloads import WORKLOADS, ModelObjective, layer_sensitivity, workload_samples

log = logging.getLogger(__name__)


def head_scores(kv16, model=None, prompt=None) -> np.ndarray:
    """f32[L, H_kv] retrieval scores from one sample's KV (per layer (K, V) f16[H_kv, N, D]).

    With `model` and `prompt`: the real queries of the prompt's last 32 tokens
    (`heads.observation_scores`); without: the last 64 keys stand in for queries (a proxy).
    """
    n = kv16[0][0].shape[1]
    if model is not None:
        return observation_scores(model, prompt, kv16, window=32, sink=4, recent=min(128, n // 4))
    q_pos = np.arange(max(0, n - 64), n)
    return np.stack([retrieval_scores(attention_probs(k[:, q_pos].astype(np.float32), k, q_pos)[None], q_pos,
                                      k.shape[0], sink=4, recent=min(128, n // 4))[0] for k, _ in kv16])


def mixed_tables(scores: np.ndarray) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per-layer / per-head bit tables: name -> bits [L][H_kv]."""
    L, H = scores.shape
    retrieval = classify_heads(scores, 0.25)
    tables = {
        "mixhq4s2": np.where(retrieval, 4, 2),  # MixHQ: retrieval heads 4-bit, streaming heads 2-bit
        "mixhq8s2": np.where(retrieval, 8, 2),
        "mixhq4s1": np.where(retrieval, 4, 1),  # ~2 bits/value: the >= 8x region
        "mixhq8s1": np.where(retrieval, 8, 1),
        "first2x8": np.where(np.arange(L)[:, None] < 2, 8, 2) * np.ones((1, H), int),  # sensitive early layers
        "first2x4+mixhq": np.maximum(np.where(np.arange(L)[:, None] < 2, 4, 2), np.where(retrieval, 4, 2)),
    }
    return {name: tuple(tuple(int(b) for b in row) for row in t) for name, t in tables.items()}


def layer_table(n_heads: int, bits_per_layer) -> str:
    """`mixed-` quantizer id with every head of layer l at bits_per_layer[l] (16 = unquantized)."""
    return "mixed-" + ".".join(("f" if b == 16 else str(int(b))) * n_heads for b in bits_per_layer)


def tier_space(sensitivity: np.ndarray | None, n_heads: int, quick: bool = False) -> list[TierConfig]:
    """Token-tier points of the search (`tokens.TierConfig`): SnapKV-selected tokens kept at 4 / 3 bits
    (sinks + recent always kept at the hi precision), optionally a 2-bit lo tier, and — given the
    per-layer sensitivity f32[L] (`workloads.layer_sensitivity`) — tables giving the more sensitive
    half of the layers one more bit (mixed precision by layer)."""
    h4, h3, l2 = "hadamard+kivi4g128+zstdh3", "hadamard+kivi3g128+zstdh3", "hadamard+kivi2g128+zstdh3"
    keeps = (0.3, 0.4) if quick else (0.3, 0.35, 0.4, 0.5)
    space = [TierConfig(h4, None, f, 0.0) for f in keeps]
    if not quick:
        space += [TierConfig(h3, None, f, 0.0) for f in (0.4, 0.5)]
        space += [TierConfig(h4, l2, hi, lo) for hi, lo in ((0.1, 0.5), (0.2, 0.3), (0.3, 0.15))]
    if sensitivity is not None:
        hot = np.asarray(sensitivity) >= np.median(sensitivity)
        t43 = f"hadamard+{layer_table(n_heads, np.where(hot, 4, 3))}-g128+zstdh3"
        t84 = f"hadamard+{layer_table(n_heads, np.where(hot, 8, 4))}-g128+zstdh3"
        t32 = f"hadamard+{layer_table(n_heads, np.where(hot, 3, 2))}-g128+zstdh3"
        space += [TierConfig(t43, None, f, 0.0) for f in ((0.45,) if quick else (0.4, 0.45, 0.5))]
        if not quick:
            space += [TierConfig(t84, t32, hi, lo) for hi, lo in ((0.1, 0.5), (0.2, 0.3))]
    return space


def strategy_space(scores: np.ndarray, quick: bool, tiers: list[TierConfig] | None = None) -> list:
    """The search space: pipelines (below), plus `tiers` (token-tier points) when given."""
    return _pipeline_space(scores, quick) + list(tiers or [])


def _pipeline_space(scores: np.ndarray, quick: bool) -> list[PipelineSpec]:
    transforms = [TransformSpec("identity"), TransformSpec("hadamard")]
    codecs = [CodecSpec("zstdh", 3)] if quick else [CodecSpec("none"), CodecSpec("zstdh", 3)]
    groups = (32, 128)
    quantizers = [QuantizerSpec("kivi", b, g) for b in ((2, 4) if quick else (2, 3, 4, 8)) for g in groups]
    if not quick:
        quantizers.append(QuantizerSpec("tok", 4, 32))
        # entropy-coded uniform steps (~3.2 / 2.4 bits of entropy per value before metadata)
        quantizers += [QuantizerSpec("ec", 4, 128, step=step) for step in (40, 80)]
    quantizers += [QuantizerSpec("mixed", 16, g, table=t) for t in mixed_tables(scores).values()
                   for g in ((128,) if quick else groups)]
    specs = [PipelineSpec(t, q, c) for t in transforms for q in quantizers for c in codecs]
    return list({s.id: s for s in specs}.values())  # two tables may coincide (e.g. all early heads retrieval)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compress-profile", help="Bayesian profiling of KV compression pipelines per workload "
                                                "(KVServe): writes a Pareto profile file per workload")
    p.add_argument("--model", default=None, help="model name/path (default: the embedded SmolLM2)")
    p.add_argument("--out", required=True, help="directory for <workload>.json profile files")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--samples", type=int, default=2, help="samples per workload (default 2)")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens per sample (default 512)")
    p.add_argument("--continuation", type=int, default=16, help="teacher-forced tokens per sample (default 16)")
    p.add_argument("--acc-threshold", type=float, default=0.9,
                   help="accuracy floor of the search (top-1 agreement with uncompressed KV; default 0.9)")
    p.add_argument("--limit", type=int, default=None, help="at most this many evaluations per workload")
    p.add_argument("--chunk-tokens", type=int, default=128, help="container size on the wire (default 128)")
    p.add_argument("--quick", action="store_true", help="1 sample of 256 tokens, a 16-spec space, <= 8 evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tiers", action="store_true",
                   help="leave token-tier points (SnapKV-selected tokens per head, dropped rest) out of the space: "
                        "they are Table-1 methods; the serving KV path skips them")
    return p


def run(args) -> int:
    from tqdm import tqdm

    from models import DEFAULT_MODEL, load_model

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise ValueError(f"--workloads {args.workloads!r}: unknown {bad}; use a comma list of {', '.join(WORKLOADS)}")
    if not 0 < args.acc_threshold <= 1:
        raise ValueError(f"--acc-threshold {args.acc_threshold} must be in (0, 1]")
    samples, tokens = (1, 256) if args.quick else (args.samples, args.tokens)
    limit = args.limit if args.limit is not None else (8 if args.quick else 40)
    if limit < 2:
        raise ValueError(f"--limit {limit} must be >= 2 evaluations")
    os.makedirs(args.out, exist_ok=True)
    model = load_model(args.model or DEFAULT_MODEL)
    for workload in workloads:
        t0 = time.perf_counter()
        objective = ModelObjective(model, workload_samples(model.tokenizer, workload, samples, tokens,
                                                           args.continuation), chunk_tokens=args.chunk_tokens)
        tiers = None
        if not args.no_tiers:
            sens = None if args.quick else layer_sensitivity(objective)
            tiers = tier_space(sens, objective.kv16[0][0][0].shape[0], args.quick)
        space = strategy_space(head_scores(objective.kv16[0], model, objective.samples[0].prompt), args.quick, tiers)
        shape = objective.kv16[0][0][0].shape
        n_tokens = shape[1]
        shape = (shape[0], min(args.chunk_tokens, shape[1]), shape[2])
        with tqdm(total=limit, desc=f"compress-profile {workload}", unit="eval", file=sys.stderr) as bar:
            def evaluate(spec, _bar=bar):
                result = objective(spec)
                _bar.update(1)
                _bar.set_postfix_str(f"{spec.id[:40]} acc={result[0]:.3f} cr={result[1]:.2f}")
                return result

            config = SearchConfig(acc_threshold=args.acc_threshold, max_iters=limit, n_init=min(6, limit),
                                  patience=max(4, limit // 3), seed=args.seed)
            result = bayesian_search(space, evaluate, config, cr_prior=lambda s: nominal_cr(s, shape, n_tokens=n_tokens))
        profile = build_profile(result, workload, objective.probe_bytes)
        path = os.path.join(args.out, f"{workload}.json")
        save_profile(path, profile)
        best = result.best
        print(f"{workload}: {len(result.evaluations)}/{len(space)} evaluations ({result.stopped}), "
              f"{len(profile.points)} Pareto points -> {path}; best feasible: "
              + (f"{best.spec_id} (accuracy {best.accuracy:.3f}, CR {best.cr:.2f} vs fp16)" if best else "none")
              + f" [{time.perf_counter() - t0:.0f}s]")
    return 0
