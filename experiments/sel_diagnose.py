"""Where the approximate selectors lose attention mass against the exact top-k (Oracle).

Teacher-forced fidelity decode @1K (the accuracy harness's samples), one approximate selector at
a time. At every decode step and sparse layer a probe compares the selector's kv_index with
Oracle's on the *same* hidden state (Oracle recomputed from the true query and the host keys),
under the true attention weights softmax(q·K/√D) of every query head:

- mass kept by the selector and by Oracle (mean over query heads of the true weight on the set),
- recall of Oracle's set,
- the mass Oracle keeps and the selector misses, split by where the missed tokens sit
  (sinks < 4, the newest 16 tokens, decoded tokens, the prompt's last 64, the rest).

With --attribute it also runs hybrids: the selector on one block of layers and Oracle on every
other, so the top-1 / KL cost of each block is measured directly (paired with full Oracle).

    nice -n 19 python experiments/sel_diagnose.py --samples 16 --hata-weights /tmp/hata
Writes experiments/results/sel_diagnose_layers.csv (per selector, layer, KV head) and
sel_diagnose_attribution.csv; prints the summaries.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jkv.eval.fidelity import fidelity_metrics, fidelity_sample  # noqa: E402
from jkv.selection import get_selector  # noqa: E402
from jkv.selection.simple import Dense  # noqa: E402
from jkv.selection.sparse_decode import decode, pool_capacity, prefill_to_host  # noqa: E402

from experiments.common import add_model_arg, add_out_arg, setup_logging, write_csv  # noqa: E402
REGIONS = ("sinks", "newest16", "decoded", "prompt_last64", "middle")


def true_weights(q: np.ndarray, keys: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """q: f32[B, H, D]; keys: f32[B, H_kv, N_cap, D] -> f64 softmax weights [B, H_kv, G, N_cap]."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).astype(np.float64)
    logits = np.einsum("bhgd,bhnd->bhgn", grouped, keys.astype(np.float64)) / math.sqrt(dim)
    valid = np.arange(keys.shape[2])[None, :] < lengths[:, None]
    logits = np.where(valid[:, None, None, :], logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    w = np.exp(logits)
    return w / w.sum(-1, keepdims=True)


def index_mask(kv_index: np.ndarray, batch: int, kv_heads: int, capacity: int) -> np.ndarray:
    """i32[B*H_kv, k] (-1 unused) -> bool[B, H_kv, N_cap]."""
    mask = np.zeros((batch * kv_heads, capacity + 1), bool)
    rows = np.arange(batch * kv_heads)[:, None]
    mask[rows, np.where(kv_index >= 0, kv_index, capacity)] = True
    return mask[:, :capacity].reshape(batch, kv_heads, capacity)


class Probe:
    """Duck-typed selector for `sparse_decode.decode`: delegates to `inner` (or, with `layers`
    given, to `inner` on those layers and to Oracle on the rest) and, when `record`, compares
    every sparse layer's choice with Oracle's under the true attention weights."""

    def __init__(self, inner, oracle, host, prompt_lengths, layers=None, record=True):
        self.inner, self.oracle, self.host = inner, oracle, host
        self.config = inner.config
        self.prompt_lengths = np.asarray(prompt_lengths)
        self.layers = layers
        self.record = record
        self._q = {}
        self.stats = {}  # (layer, kv_head) -> dict of lists

    is_dense = False

    def _uses_inner(self, layer):
        return self.layers is None or layer in self.layers

    def prepare(self, layer, K, lengths):
        return (self.inner.prepare(layer, K, lengths) if self._uses_inner(layer) else None,
                self.oracle.prepare(layer, K, lengths))

    def append(self, layer, meta, k_new, pos):
        inner_meta, oracle_meta = meta
        if inner_meta is not None:
            inner_meta = self.inner.append(layer, inner_meta, k_new, pos)
        return inner_meta, self.oracle.append(layer, oracle_meta, k_new, pos)

    def decode_query(self, layer, q, speculate):
        self._q[layer] = q
        return self.inner.decode_query(layer, q, speculate) if self._uses_inner(layer) else q

    def select(self, layer, q_sel, meta, lengths):
        inner_meta, oracle_meta = meta
        q_true = self._q[layer]
        oracle_index = np.asarray(self.oracle.select(layer, q_true, oracle_meta, lengths))
        if not self._uses_inner(layer):
            return oracle_index
        index = np.asarray(self.inner.select(layer, q_sel, inner_meta, lengths))
        if self.record:
            self._compare(layer, np.asarray(q_true), index, oracle_index, np.asarray(lengths))
        return index

    def _compare(self, layer, q, index, oracle_index, lengths):
        keys = self.host.keys[layer]
        batch, kv_heads, capacity, _ = keys.shape
        w = true_weights(q, keys, lengths)  # [B, H_kv, G, N]
        sel = index_mask(index, batch, kv_heads, capacity)
        ora = index_mask(oracle_index, batch, kv_heads, capacity)
        pos = np.arange(capacity)[None, :]
        n = lengths[:, None]
        prompt = self.prompt_lengths[:, None]
        region = {
            "sinks": pos < 4,
            "newest16": (pos >= n - 16) & (pos < n),
            "decoded": (pos >= prompt) & (pos < n - 16),
            "prompt_last64": (pos >= prompt - 64) & (pos < prompt) & (pos < n - 16) & (pos >= 4),
        }
        region["middle"] = (pos < n) & ~region["sinks"] & ~region["newest16"] & ~region["decoded"] & \
            ~region["prompt_last64"]
        kept = (w * sel[:, :, None]).sum(-1).mean(2)  # [B, H_kv]
        kept_oracle = (w * ora[:, :, None]).sum(-1).mean(2)
        recall = (sel & ora).sum(-1) / np.maximum(ora.sum(-1), 1)
        missed = ora & ~sel
        for h in range(kv_heads):
            s = self.stats.setdefault((layer, h), {"kept": [], "kept_oracle": [], "recall": [],
                                                    **{f"miss_{r}": [] for r in REGIONS},
                                                    "entropy": []})
            s["kept"] += list(kept[:, h])
            s["kept_oracle"] += list(kept_oracle[:, h])
            s["recall"] += list(recall[:, h])
            for r in REGIONS:
                m = missed[:, h] & region[r]  # [B, N]
                s[f"miss_{r}"] += list((w[:, h] * m[:, None]).sum(-1).mean(-1))
            p = w[:, h]
            s["entropy"] += list(-(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1).mean(-1))


def add_sample_args(parser: argparse.ArgumentParser) -> None:
    """The fidelity-window arguments sel_diagnose and sel_ab share: which samples, how decoded."""
    add_model_arg(parser)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--hata-weights", default=None, help="load from / train and save to this dir")


def fidelity_batches(model, args, samples):
    """Per batch of `args.batch` fidelity windows from `samples`: (chunk, host pool after the
    prefill, targets i32[b, T], the dense teacher-forced decode's logits) — the shared reference
    every variant is compared with."""
    for chunk in [samples[i:i + args.batch] for i in range(0, len(samples), args.batch)]:
        pairs = [fidelity_sample(model.tokenizer, args.length, 32, i) for i in chunk]
        prompts = [p for p, _ in pairs]
        targets = np.stack([t for _, t in pairs])
        host = prefill_to_host(model, prompts, pool_capacity(prompts, targets.shape[1]))
        dense = decode(model, host, Dense(), targets.shape[1], forced_tokens=targets, keep_logits=True).logits
        yield chunk, host, targets, dense


def build(model, names, hata_weights, hata_steps):
    from jkv.selection.calibration import calibration_tokens, collect_calibration

    tokens = calibration_tokens(model, 1024 + 192)
    calibration = collect_calibration(model, tokens, 1024, 192)
    selectors = {}
    for name in names:
        if name == "infinigen":
            selectors[name] = get_selector("infinigen", calibration=calibration)
        elif name == "hata":
            if hata_weights and os.path.exists(os.path.join(hata_weights, "hata.json")):
                selectors[name] = get_selector("hata", weights_path=hata_weights)
            else:
                from jkv.selection.hata import save_weights
                from jkv.selection.hata_train import HATATrainConfig, train_projection

                projection, _ = train_projection(calibration, HATATrainConfig(train_steps=hata_steps))
                if hata_weights:
                    save_weights(hata_weights, np.asarray(projection))
                selectors[name] = get_selector("hata", projection=projection)
        else:
            selectors[name] = get_selector(name)
    return selectors, calibration


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(parser)
    parser.add_argument("--selectors", default="infinigen,quest,hata")
    parser.add_argument("--hata-train-steps", type=int, default=150)
    parser.add_argument("--attribute", type=int, default=0, help="layer blocks for the hybrid runs (0: none)")
    add_out_arg(parser)
    args = parser.parse_args()
    setup_logging()
    from models import load_model

    model = load_model(args.model)
    names = args.selectors.split(",")
    selectors, _ = build(model, names, args.hata_weights, args.hata_train_steps)
    oracle = get_selector("oracle")
    sparse_layers = list(range(oracle.config.dense_layers, model.cfg.num_layers))
    blocks = np.array_split(sparse_layers, args.attribute) if args.attribute else []
    samples = list(range(args.first, args.first + args.samples))
    stats = {name: {} for name in names}
    attribution = {}  # (name, block) -> list of (kl, agree bits)
    start = time.perf_counter()
    for chunk, host, targets, dense in fidelity_batches(model, args, samples):

        def score(selector):
            logits = decode(model, host, selector, targets.shape[1], forced_tokens=targets, keep_logits=True).logits
            return [fidelity_metrics(dense[b, 1:], logits[b, 1:], targets[b, 1:]) for b in range(len(chunk))]

        attribution.setdefault(("oracle", "all"), []).extend(score(oracle))
        for name in names:
            probe = Probe(selectors[name], oracle, host, host.prompt_lengths)
            attribution.setdefault((name, "all"), []).extend(score(probe))
            for key, s in probe.stats.items():
                target = stats[name].setdefault(key, {k: [] for k in s})
                for k, v in s.items():
                    target[k] += v
            for block in blocks:
                hybrid = Probe(selectors[name], oracle, host, host.prompt_lengths, layers=set(block.tolist()),
                               record=False)
                attribution.setdefault((name, f"{block[0]}-{block[-1]}"), []).extend(score(hybrid))
        logging.info("samples %s done after %.0fs", chunk, time.perf_counter() - start)

    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in names:
        for (layer, head), s in sorted(stats[name].items()):
            row = {"selector": name, "layer": layer, "kv_head": head, "samples": args.samples,
                   **{k: float(np.mean(v)) for k, v in s.items()}}
            rows.append(row)
    write_csv(os.path.join(args.out, "sel_diagnose_layers.csv"), rows)
    print(f"\nper selector (samples {samples[0]}-{samples[-1]}, mean over sparse layers, KV heads, steps):")
    print(f"{'selector':<10}{'kept':>8}{'oracle':>8}{'gap':>8}{'recall':>8}  missed mass by region " +
          " ".join(f"{r:>13}" for r in REGIONS))
    for name in names:
        mine = [r for r in rows if r["selector"] == name]
        mean = {k: np.mean([r[k] for r in mine]) for k in mine[0] if k not in ("selector",)}
        print(f"{name:<10}{mean['kept']:>8.4f}{mean['kept_oracle']:>8.4f}{mean['kept_oracle'] - mean['kept']:>8.4f}"
              f"{mean['recall']:>8.3f}  {'':22}" + " ".join(f"{mean['miss_' + r]:>13.4f}" for r in REGIONS))
    print("\nper layer: oracle - kept (mass gap), mean over KV heads")
    layers = sorted({r["layer"] for r in rows})
    print("layer " + " ".join(f"{name:>10}" for name in names) + f" {'oracle kept':>12} {'entropy':>8}")
    for layer in layers:
        gaps = []
        for name in names:
            mine = [r for r in rows if r["selector"] == name and r["layer"] == layer]
            gaps.append(np.mean([r["kept_oracle"] - r["kept"] for r in mine]))
        mine = [r for r in rows if r["selector"] == names[0] and r["layer"] == layer]
        print(f"{layer:>5} " + " ".join(f"{g:>10.4f}" for g in gaps) +
              f" {np.mean([r['kept_oracle'] for r in mine]):>12.4f} {np.mean([r['entropy'] for r in mine]):>8.3f}")
    arows = []
    for (name, block), metrics in attribution.items():
        bits = "".join(m["agree"] for m in metrics)
        arows.append({"selector": name, "layers": block, "samples": len(metrics), "tokens": len(bits),
                      "top1": bits.count("1") / len(bits), "kl": float(np.mean([m["kl"] for m in metrics])),
                      "agree": bits})
    write_csv(os.path.join(args.out, "sel_diagnose_attribution.csv"), arows)
    oracle_bits = next(r["agree"] for r in arows if r["selector"] == "oracle")
    print("\nselector on the given layers, Oracle elsewhere (paired with full Oracle: tokens where only "
          "one of the two agrees with dense)")
    print(f"{'selector':<10}{'layers':>8}{'top1':>8}{'KL':>9}{'lost':>6}{'won':>6}")
    for r in arows:
        lost = sum(a == "1" and b == "0" for a, b in zip(oracle_bits, r["agree"]))
        won = sum(a == "0" and b == "1" for a, b in zip(oracle_bits, r["agree"]))
        print(f"{r['selector']:<10}{r['layers']:>8}{r['top1']:>8.3f}{r['kl']:>9.4f}{lost:>6}{won:>6}")
    print(f"\ntotal {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
