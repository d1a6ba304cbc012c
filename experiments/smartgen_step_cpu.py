"""Decode-process CPU seconds per smartgen decode step, for one or more source trees side by side.

    python experiments/smartgen_step_cpu.py --trees /path/to/main/checkout . --rounds 2

Each (round, tree) runs in a fresh child process with PYTHONPATH=<tree>, so the same script
measures two versions of jkv (e.g. main before a change and a branch after it) alternately in one
invocation on the same load. A child starts one prefill worker process (jkv/disagg/harness.py),
runs a short warm-up batch (its compiles stay out of the measurement), then one smartgen batch
(`--kr-fraction` proactive, sequential order: a random model has no importance profile) of
`--requests` random prompts, and reports per decode step the CPU seconds of the decode process
(`cpu_us_n`: every thread of it), of its engine thread and of the prefill process, averaged over
the steps after the first (the first step's on-demand rows are the stage-transition stall).
CPU seconds are less load-sensitive than wall time, but a loaded box still inflates them (cache
and frequency effects): compare trees only within one invocation, and record `uptime`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np


def child(args) -> dict:
    from jkv.disagg import harness
    from models.loader import load_model_spec

    harness.load_model = load_model_spec  # "tiny:<family>:<seed>" too (the prefill workers' --model takes it)
    h = harness.Harness(args.model, prefill_workers=1, max_blocks=16, say=lambda *a: None)
    try:
        h.set_bandwidth(args.bandwidth_mbit * 1e6)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, h.model.cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
        kw = dict(kr_fraction=args.kr_fraction, strategy="sequential")
        h.run("smartgen", prompts, 3, **kw)  # warm-up: compiles, first connections
        outs = h.run("smartgen", prompts, args.max_tokens, **kw)
    finally:
        h.close()
    steps = outs[0].metrics.extra["step_phases"][1:]
    mean = {k: float(np.mean([s.get(k, 0) for s in steps])) / 1e6
            for k in ("cpu_us_n", "engine_cpu_us_n", "hint_cpu_us_n", "probe_cpu_us_n")}
    wall = {"wall_s": float(np.mean([sum(v for k, v in s.items() if not k.endswith("_n")) for s in steps])),
            "landed_s": float(np.mean([s.get("landed", 0.0) for s in steps]))}
    return dict(steps=len(steps), remote_n=float(np.mean([s.get("remote_n", 0) for s in steps])), **mean, **wall)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees to measure (PYTHONPATH of each child)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="tiny:qwen2:0")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kr-fraction", type=float, default=0.3)
    p.add_argument("--bandwidth-mbit", type=float, default=10.0,
                   help="paced link of the prefill worker (slow: remote rows stay for many steps)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}")
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    passthrough = ["--model", args.model, "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
                   "--max-tokens", str(args.max_tokens), "--kr-fraction", str(args.kr_fraction),
                   "--bandwidth-mbit", str(args.bandwidth_mbit)]
    for _ in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *passthrough], env=env,
                                 cwd=os.path.abspath(tree), capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}")
    print(f"{args.requests} x {args.prompt_len} tokens, {args.max_tokens} tokens, {args.model}; per decode step after "
          "the first, CPU seconds (mean over rounds):")
    for tree, rs in runs.items():
        m = {k: np.mean([r[k] for r in rs]) for k in rs[0]}
        print(f"  {tree}: decode process {m['cpu_us_n']:.4f} (engine thread {m['engine_cpu_us_n']:.4f}, hint "
              f"thread {m['hint_cpu_us_n']:.4f}), prefill process {m['probe_cpu_us_n']:.4f}; remote entries "
              f"{m['remote_n']:.0f}; per round {[round(r['cpu_us_n'], 4) for r in rs]}; wall s per step "
              f"{m['wall_s']:.4f}, of it the `landed` program {m['landed_s']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
