"""`jkv` command line: generate, compare, demo, models.

Each subcommand is `add_<name>(subparsers)` + `run_<name>(args)`; `main()` dispatches. Errors a
user can fix (bad model name, over-long prompt, invalid sampling value) print one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from models import DEFAULT_MODEL, ModelLoadError, known_models

from .serving.launch import add_serve, run_serve

log = logging.getLogger("jkv")


def _add_model_args(p):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name ({', '.join(known_models())}), HF directory or .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_sampling_args(p):
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


# ------------------------------------------------------------------ generate
def add_generate(sub):
    p = sub.add_parser("generate", help="generate text for one or more prompts and print timings")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: one batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")


def run_generate(args):
    from .api import LLM

    sp = _sampling(args)
    llm = LLM(args.model, dtype=args.dtype)
    prompts = [[{"role": "user", "content": p}] if args.chat else p for p in args.prompt]
    for o in llm.generate(prompts, sp):
        m = o.metrics
        if args.json:
            print(json.dumps(dict(text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason,
                                  prompt_tokens=m.prompt_tokens, ttft_s=m.ttft, tbt_s=m.tbt)))
            continue
        print(f"--- request {o.request_id} ({m.prompt_tokens} prompt tokens) ---")
        print(o.text)
        print(f"[{len(o.token_ids)} tokens, finish={o.finish_reason}, TTFT {m.ttft * 1e3:.0f} ms, "
              f"mean TBT {m.mean_tbt * 1e3:.1f} ms]")
    return 0


# ------------------------------------------------------------------- compare
def add_compare(sub):
    from .compare import Tolerances

    t = Tolerances()
    p = sub.add_parser("compare", help="compare jkv against Hugging Face transformers on the same weights")
    _add_model_args(p)
    p.add_argument("--prompts", help="file with one prompt per line (a JSON list line is a chat); default: built-in 5")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy continuation length (default 32)")
    p.add_argument("--max-abs-logit-diff", type=float, default=t.max_abs_logit_diff,
                   help=f"fail above this max |Δlogit| (default {t.max_abs_logit_diff})")
    p.add_argument("--max-mean-kl", type=float, default=t.max_mean_kl,
                   help=f"fail above this mean KL(hf||jkv) per position (default {t.max_mean_kl})")
    p.add_argument("--min-top1", type=float, default=t.min_top1_agreement,
                   help=f"fail below this top-1 agreement over prefill positions (default {t.min_top1_agreement})")
    p.add_argument("--min-greedy-match", type=float, default=t.min_greedy_match,
                   help=f"fail below this fraction of identical greedy continuations (default {t.min_greedy_match})")


def run_compare(args):
    from models import load_model

    from .compare import DEFAULT_PROMPTS, Tolerances, compare, load_hf_reference, read_prompts_file

    if args.dtype != "float32":
        raise ValueError("compare runs in float32 (the reference is fp32 torch); drop --dtype")
    tol = Tolerances(args.max_abs_logit_diff, args.max_mean_kl, args.min_top1, args.min_greedy_match)
    prompts = read_prompts_file(args.prompts) if args.prompts else DEFAULT_PROMPTS
    model = load_model(args.model)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; compare needs one to encode prompts")
    ids = [model.tokenizer.apply_chat_template(p) if isinstance(p, list) else model.tokenizer.encode(p)
           for p in prompts]
    t = time.perf_counter()
    hf = load_hf_reference(args.model)
    report = compare(model, hf, ids, greedy_tokens=args.greedy_tokens)
    print(report.format())
    failures = report.check(tol)
    print(f"({time.perf_counter() - t:.1f}s)")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS")
    return 0


# ---------------------------------------------------------------------- demo
def add_demo(sub):
    p = sub.add_parser("demo", help="the main job: batched generation on the embedded default model with timings")
    _add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=48)


def run_demo(args):
    from .api import LLM
    from .sampling import SamplingParams

    prompts = [
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        [{"role": "user", "content": "Explain in two sentences why the KV cache makes decoding fast."}],
        "def quicksort(xs):\n    ",
        "The three primary colors are",
    ]
    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    print(f"loaded {llm.model} in {time.perf_counter() - t:.1f}s")
    llm.generate(prompts, SamplingParams(max_tokens=4))  # compile once, outside the timed run
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    wall = time.perf_counter() - t
    print(f"\n{'req':>3} {'prompt':>6} {'gen':>4} {'TTFT ms':>8} {'mean TBT ms':>11}  text")
    for o in outs:
        m = o.metrics
        text = o.text.replace("\n", "\\n")
        print(f"{o.request_id:>3} {m.prompt_tokens:>6} {len(o.token_ids):>4} {m.ttft * 1e3:>8.0f} "
              f"{m.mean_tbt * 1e3:>11.1f}  {text[:70]}")
    ntok = sum(len(o.token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {ntok} tokens in {wall:.2f}s ({ntok / wall:.1f} tok/s, batch {len(outs)})")
    return 0


# ---------------------------------------------------------------------- models
def add_models(sub):
    sub.add_parser("models", help="list the registered model names")


def run_models(args):
    for n in known_models():
        print(n)
    return 0


def add_eval(sub):
    from .eval.cli import add_parser

    add_parser(sub)


def run_eval(args):
    from .eval.cli import run

    return run(args)


def add_train_hata(sub):
    from .selection.hata_train import add_parser

    add_parser(sub)


def run_train_hata(args):
    from .selection.hata_train import run

    return run(args)


COMMANDS = {"generate": (add_generate, run_generate), "compare": (add_compare, run_compare),
            "eval": (add_eval, run_eval), "train-hata": (add_train_hata, run_train_hata),
            "demo": (add_demo, run_demo), "models": (add_models, run_models), "serve": (add_serve, run_serve)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jkv", description="JAX/Pallas disaggregated LLM inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command][1](args) or 0
    except (ModelLoadError, ValueError, TypeError, RuntimeError) as e:
        print(f"jkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
