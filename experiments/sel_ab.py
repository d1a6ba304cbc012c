"""Paired A/B of selector variants on the fidelity task (per-token top-1 agreement with dense).

Every variant decodes the same teacher-forced fidelity samples @1K from the same host pool as
the dense reference; the comparison against the baseline is paired per token (tokens where
only one of the two agrees with dense), which is far less noisy than comparing two top-1 means.

Variants tried here (see docs/selection.md "What was tried"):
- `<sel>`: the selector as configured by default.
- `<sel>+v`: value-aware ranking — the selector's estimated group mass of each token times the
  token's value norm ||v|| (one number per token and KV head: 2 B at float16, 6 B/token/layer
  for SmolLM2's 3 KV heads), read from the host pool (what a prefill worker would ship).
- `oracle+vo`: the exact mass times ||v - o_g|| summed over the group's heads (o_g: the dense
  attention output of head g), the first-order error a dropped token causes; not shippable,
  it bounds what value-awareness can give.
- `quest@3`: Quest on 3-token pages. `hata@<dir>`: HATA with other weights. `infinigen@w4`:
  the skew fitted on 4 calibration windows (1024 + 192 tokens each) instead of 1.
- `<sel>:key=value;key=value`: the selector with config overrides (e.g. `infinigen:speculate=False`).

    nice -n 19 python experiments/sel_ab.py --variants oracle,oracle+v,oracle+vo --samples 16
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import setup_logging, write_csv  # noqa: E402
from experiments.sel_diagnose import add_sample_args, build, fidelity_batches  # noqa: E402
from jkv.eval.fidelity import fidelity_metrics  # noqa: E402
from jkv.selection import get_selector  # noqa: E402
from jkv.selection.base import reduce_group, scores_to_index  # noqa: E402
from jkv.selection.infinigen import infinigen_rank  # noqa: E402
from jkv.selection.sparse_decode import decode  # noqa: E402


class ValueAware:
    """Duck-typed selector: `inner`'s per-token score (estimated group mass) times a value term
    read from the host pool, then the same top-k / kept tokens / fetch count as `inner`."""

    is_dense = False

    def __init__(self, inner, host, mode="norm"):
        self.inner, self.host, self.mode = inner, host, mode
        self.config = inner.config
        self._q = {}

    def prepare(self, layer, K, lengths):
        return self.inner.prepare(layer, K, lengths)

    def append(self, layer, meta, k_new, pos):
        return self.inner.append(layer, meta, k_new, pos)

    def decode_query(self, layer, q, speculate):
        self._q[layer] = q
        return self.inner.decode_query(layer, q, speculate)

    def select(self, layer, q, meta, lengths):
        lengths = jnp.asarray(lengths, jnp.int32)
        values = jnp.asarray(self.host.values[layer])  # [B, H_kv, N_cap, D]
        cfg = self.inner.config
        name = self.inner.name
        count = None
        if name in ("oracle", "hata"):  # the selector's own per-head logits
            logits = self.inner._logits(self.inner.layer_state(layer), jnp.asarray(q), meta, lengths)
            if name == "oracle" and self.mode == "vo":  # sum_g w_g,i ||v_i - o_g||
                w = jax.nn.softmax(logits, axis=-1)  # [B, H_kv, G, N]
                out = jnp.einsum("bhgn,bhnd->bhgd", w, values)
                dist = jnp.linalg.norm(values[:, :, None] - out[:, :, :, None], axis=-1)
                scores = (w * dist).sum(axis=2)
            else:
                scores = reduce_group(logits, "mass")
        elif name == "infinigen":
            scores, count = infinigen_rank(cfg, self.inner.layer_state(layer), jnp.asarray(q), meta, lengths)
        else:
            raise ValueError(f"value-aware variant not implemented for {name}")
        if self.mode == "norm":
            scores = scores * jnp.linalg.norm(values, axis=-1)
        index = scores_to_index(scores, lengths, cfg.max_ratio, sinks=cfg.keep_sinks, recent=cfg.keep_recent)
        if count is not None:
            slot = jnp.arange(index.shape[1], dtype=jnp.int32)[None, :]
            index = jnp.where(slot < jnp.repeat(count, scores.shape[1])[:, None], index, -1)
        return np.asarray(index)


def make(variant, base, host):
    """variant name -> selector (ValueAware wrappers need the batch's host pool)."""
    if "+" in variant and ":" in variant:
        variant, suffix = variant.split("+")
        return ValueAware(base[variant], host, {"v": "norm", "vo": "vo", "s": "none"}[suffix])
    if variant.endswith("+vo"):
        return ValueAware(base[variant[:-3]], host, "vo")
    if variant.endswith("+v"):
        return ValueAware(base[variant[:-2]], host, "norm")
    if variant.endswith("+s"):  # same scoring path as +v without the value term (checks the wrapper)
        return ValueAware(base[variant[:-2]], host, "none")
    return base[variant]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(parser)
    parser.add_argument("--variants", default="oracle,oracle+v,oracle+vo")
    parser.add_argument("--baseline", default=None, help="default: the first variant")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    setup_logging()
    from models import load_model

    model = load_model(args.model)
    variants = args.variants.split(",")
    plain = sorted({v.split("+")[0].split(":")[0] for v in variants if "@" not in v})
    base, calibration = build(model, [n for n in plain if n in ("infinigen", "hata")], args.hata_weights, 150)
    for name in plain:
        if name not in base:
            base[name] = get_selector(name)
    for v in variants:
        if ":" in v:
            name, options = v.split("+")[0].split(":", 1)
            config = {}
            for item in options.split(";"):
                key, value = item.split("=")
                config[key] = {"True": True, "False": False}.get(value, value)
                for cast in (int, float):
                    try:
                        config[key] = cast(value)
                        break
                    except ValueError:
                        pass
            extra = {"calibration": calibration} if name == "infinigen" else \
                {"projection": np.asarray(base["hata"].projection)} if name == "hata" else {}
            base[v.split("+")[0]] = get_selector(name, **extra, **config)
        if v.startswith("quest@"):
            base[v] = get_selector("quest", page_size=int(v.split("@")[1]))
        elif v.startswith("hata@"):
            base[v] = get_selector("hata", weights_path=v.split("@", 1)[1])
        elif v.startswith("infinigen@w"):  # skew fitted on N calibration windows (queries/keys pooled)
            from jkv.selection.calibration import calibration_tokens, collect_calibration
            from jkv.selection.infinigen import InfiniGen, InfiniGenConfig, fit_skew

            windows, span = int(v.split("@w")[1]), 1024 + 192
            tokens = calibration_tokens(model, windows * span)
            cals = [collect_calibration(model, tokens[i * span:(i + 1) * span], 1024, 192) for i in range(windows)]
            skew = [fit_skew(np.concatenate([c.queries[layer] for c in cals]),
                             np.concatenate([c.keys[layer] for c in cals]), InfiniGenConfig().partial_ratio)
                    for layer in range(model.cfg.num_layers)]
            base[v] = InfiniGen(InfiniGenConfig(), skew)
    samples = list(range(args.first, args.first + args.samples))
    results = {v: [] for v in variants}
    start = time.perf_counter()
    for chunk, host, targets, dense in fidelity_batches(model, args, samples):
        for v in variants:
            logits = decode(model, host, make(v, base, host), targets.shape[1], forced_tokens=targets,
                            keep_logits=True).logits
            results[v] += [fidelity_metrics(dense[b, 1:], logits[b, 1:], targets[b, 1:]) for b in range(len(chunk))]
        logging.info("samples %s done after %.0fs", chunk, time.perf_counter() - start)
    baseline = args.baseline or variants[0]
    ref = "".join(m["agree"] for m in results[baseline])
    print(f"\nfidelity @{args.length}, samples {samples[0]}-{samples[-1]} ({len(ref)} tokens); paired vs {baseline}")
    print(f"{'variant':<28}{'top1':>8}{'KL':>9}{'lost':>6}{'won':>6}")
    rows = []
    for v in variants:
        bits = "".join(m["agree"] for m in results[v])
        lost = sum(a == "1" and b == "0" for a, b in zip(ref, bits))
        won = sum(a == "0" and b == "1" for a, b in zip(ref, bits))
        kl = float(np.mean([m["kl"] for m in results[v]]))
        print(f"{v:<28}{bits.count('1') / len(bits):>8.3f}{kl:>9.4f}{lost:>6}{won:>6}")
        rows.append({"variant": v, "first": samples[0], "samples": len(samples), "top1": bits.count("1") / len(bits),
                     "kl": kl, "lost_vs_baseline": lost, "won_vs_baseline": won, "agree": bits})
    if args.csv:
        write_csv(args.csv, rows)
    print(f"total {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
