"""`jkv eval`: the KV-selection accuracy harness from the command line."""
from __future__ import annotations

import argparse
import logging

from jkv.eval.harness import ALL_TASKS, EvalConfig, evaluate, format_table, summarize, write_csv


def _csv(cast):
    return lambda text: tuple(cast(part) for part in text.split(",") if part)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `eval` on an argparse subparsers object."""
    parser = subparsers.add_parser("eval", help="accuracy of KV selectors vs dense decode")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF dir or .gguf path")
    parser.add_argument("--tasks", type=_csv(str), default=("passkey", "fidelity"),
                        help=f"comma-separated, from: {','.join(ALL_TASKS)}")
    parser.add_argument("--lengths", type=_csv(int), default=(1024,), help="prompt lengths in tokens, e.g. 512,1024")
    parser.add_argument("--selectors", type=_csv(str), default=("oracle", "infinigen", "quest", "hata", "streamingllm"))
    parser.add_argument("--ratios", type=_csv(float), default=(0.2,), help="max selection ratios, e.g. 0.1,0.2")
    parser.add_argument("--limit", type=int, default=5, help="samples per task and length")
    parser.add_argument("--batch", type=int, default=1, help="samples decoded together (one prefill per batch)")
    parser.add_argument("--fidelity-tokens", type=int, default=32)
    parser.add_argument("--hata-weights", default=None, help="dir from `jkv train-hata` (default: train now)")
    parser.add_argument("--hata-train-steps", type=int, default=200, help="per calibration window")
    parser.add_argument("--hata-windows", type=int, default=4, help="calibration windows HATA trains on in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="write per-sample rows to this CSV")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from models import load_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = EvalConfig(tasks=args.tasks, lengths=args.lengths, selectors=args.selectors, ratios=args.ratios,
                        limit=args.limit, batch=args.batch, fidelity_tokens=args.fidelity_tokens, seed=args.seed,
                        hata_weights=args.hata_weights, hata_train_steps=args.hata_train_steps,
                        hata_windows=args.hata_windows)
    model = load_model(args.model)
    rows = evaluate(model, config, progress=not args.no_progress)
    if args.csv:
        write_csv(args.csv, rows)
    print(format_table(summarize(rows)))
    return 0
