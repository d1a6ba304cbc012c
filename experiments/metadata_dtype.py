"""Does storing selector metadata compactly change what InfiniGen and Quest select?

Side by side on the same prefilled host pool (fidelity task: documentation prompt, teacher-forced
continuation): dense, then each selector with `metadata_dtype` float32 and float16 (InfiniGen
shares one fitted skew), and Quest at equal metadata bytes: int8 page bounds (outward-rounded
codes) on 2- and 3-token pages against float16 on 4-token pages. Prints, per variant, top-1
agreement with dense and KL over the decoded positions, the top-1 agreement float16 vs float32
directly, and the metadata bytes per token per sparse layer.

    nice -n 19 python experiments/metadata_dtype.py --length 1024 --limit 2
    nice -n 19 python experiments/metadata_dtype.py --first 0 --limit 8 --quest-only
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv.eval.fidelity import fidelity_metrics, fidelity_sample
from jkv.selection import get_selector
from jkv.selection.calibration import calibration_tokens, collect_calibration
from jkv.selection.simple import Dense
from jkv.selection.sparse_decode import decode, pool_capacity, prefill_to_host

from experiments.common import RESULTS, add_model_arg, write_csv


def metadata_bytes_per_token(selector, cfg, n: int = 1024) -> float:
    spec = jax.ShapeDtypeStruct((1, cfg.num_kv_heads, n, cfg.head_dim), jnp.float32)
    out = jax.eval_shape(lambda K: selector.prepare(selector.config.dense_layers, K, jnp.asarray([n])), spec)
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(out)) / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(p)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--first", type=int, default=0, help="index of the first fidelity sample")
    p.add_argument("--tokens", type=int, default=32, help="teacher-forced continuation length")
    p.add_argument("--quest-only", action="store_true", help="skip InfiniGen (and its calibration)")
    args = p.parse_args()

    from models import load_model

    model = load_model(args.model)
    start = time.perf_counter()
    selectors = {}
    if not args.quest_only:
        cal = collect_calibration(model, calibration_tokens(model, 1024 + 192), 1024, 192)  # jkv eval defaults
        ig16 = get_selector("infinigen", max_ratio=args.ratio, calibration=cal)
        selectors[("infinigen", "float32")] = get_selector("infinigen", max_ratio=args.ratio, skew=ig16.skew,
                                                           metadata_dtype="float32")
        selectors[("infinigen", "float16")] = ig16
    for dtype, page in (("float32", 4), ("float16", 4), ("float16", 2), ("int8", 4), ("int8", 3), ("int8", 2)):
        selectors[("quest", dtype if page == 4 else f"{dtype}/p{page}")] = get_selector(
            "quest", max_ratio=args.ratio, metadata_dtype=dtype, page_size=page)
    print(f"calibration + selectors: {time.perf_counter() - start:.1f}s")
    per = {key: dict(top1=[], kl=[]) for key in selectors}
    cross = {name: [] for name, _ in selectors}
    for index in range(args.first, args.first + args.limit):
        prompt, targets = fidelity_sample(model.tokenizer, args.length, args.tokens, index)
        host = prefill_to_host(model, [prompt], pool_capacity([prompt], len(targets)))
        forced = targets[None, :]
        dense = decode(model, host, Dense(), len(targets), forced_tokens=forced, keep_logits=True).logits[0][1:]
        argmax = {}
        for key, sel in selectors.items():
            logits = decode(model, host, sel, len(targets), forced_tokens=forced, keep_logits=True).logits[0][1:]
            m = fidelity_metrics(dense, logits, targets[1:])
            per[key]["top1"].append(m["top1"])
            per[key]["kl"].append(m["kl"])
            argmax[key] = logits.argmax(-1)
        for name in cross:
            cross[name].append(float((argmax[(name, "float16")] == argmax[(name, "float32")]).mean()))
        print(f"sample {index}: " + ", ".join(f"{n}/{d} {np.mean(v['top1']):.3f}" for (n, d), v in per.items()),
              flush=True)
    rows = []
    print(f"\nfidelity @{args.length}, ratio {args.ratio}, samples {args.first}..{args.first + args.limit - 1} "
          f"x {args.tokens - 1} decoded tokens")
    print(f"{'selector':<10} {'metadata':<8} {'top1 vs dense':>13} {'KL':>8} "
          f"{'f16 vs f32 top1':>15} {'B/token/layer':>13}")
    for (name, dtype), sel in selectors.items():
        row = dict(selector=name, metadata_dtype=dtype, top1=np.mean(per[(name, dtype)]["top1"]),
                   kl=np.mean(per[(name, dtype)]["kl"]), f16_vs_f32_top1=np.mean(cross[name]),
                   metadata_bytes_per_token=metadata_bytes_per_token(sel, model.cfg))
        rows.append(row)
        print(f"{name:<10} {dtype:<10} {row['top1']:>13.3f} {row['kl']:>8.4f} {row['f16_vs_f32_top1']:>15.3f} "
              f"{row['metadata_bytes_per_token']:>13.1f}")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "metadata_dtype_quest.csv" if args.quest_only else "metadata_dtype.csv")
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
