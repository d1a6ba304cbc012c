"""The main demo (`jkv demo`, `make demo`): SmolLM2 with one decode and two prefill worker
processes on this machine, the link paced so full KV transfer takes several times the prefill
time, a batch of long prompts with `full` then `smartgen` transfer: a table of TTFT, TTST,
mean TBT, on-demand ratio and bytes moved, and a check that the texts are identical.

    jkv demo [--requests 4 --prompt-len 512 --max-tokens 24]
    python experiments/smartgen_demo.py ...   (the same)

Prints (CLI output, hence print) and returns 0 when the texts are identical.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from jkv.disagg.harness import Harness, summarize
from models import DEFAULT_MODEL


def add_args(p):
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--selector", default="infinigen")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ratio", type=float, default=6.5, help="full-transfer time / prefill time to emulate")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--max-blocks", type=int, default=64, help="M, blocks per layer")


def run(args) -> int:
    t_start = time.perf_counter()
    h = Harness(args.model, args.selector, args.prefill_workers, max_blocks=args.max_blocks)
    try:
        prompts = h.eval_prompts(args.requests, args.prompt_len)
        h.build_profile(args.prompt_len)
        h.pace_link(prompts, args.ratio)
        results = {}
        for mode in ("full", "smartgen"):
            print(f"running {mode} ...", flush=True)
            results[mode] = h.run(mode, prompts, args.max_tokens)
    finally:
        h.close()
    print(f"\n{args.requests} requests x {args.prompt_len} prompt tokens, {args.max_tokens} new tokens, "
          f"selector {args.selector}, {args.prefill_workers} prefill workers, M={args.max_blocks}")
    print(f"{'mode':<9} {'TTFT s':>7} {'TTST s':>7} {'mean TBT ms':>11} {'on-demand':>9} "
          f"{'proactive MB':>12} {'on-demand MB':>12} {'spec MB':>8}")
    rows = {}
    for mode, outs in results.items():
        s = rows[mode] = summarize(outs)
        print(f"{mode:<9} {s['ttft']:>7.2f} {s['ttst']:>7.2f} {s['mean_tbt'] * 1e3:>11.1f} "
              f"{s['on_demand_ratio']:>9.3f} {s['bytes_proactive'] / 1e6:>12.1f} {s['bytes_on_demand'] / 1e6:>12.1f} "
              f"{s['bytes_speculative'] / 1e6:>8.1f}")
    print(f"\nTTST full / smartgen = {rows['full']['ttst'] / rows['smartgen']['ttst']:.2f}x")
    same = [a.token_ids == b.token_ids for a, b in zip(results["full"], results["smartgen"])]
    print(f"generated texts identical in full and smartgen: {all(same)} ({sum(same)}/{len(same)})")
    for o in results["smartgen"][:2]:
        print(f"  [{o.request_id}] {o.text[:100]!r}")
    print(f"demo finished in {time.perf_counter() - t_start:.0f}s")
    return 0 if all(same) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    logging.basicConfig(level=logging.WARNING)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
