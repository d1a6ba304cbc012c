"""`jkv` command line: generate, compare, demo, models, eval, train-hata, pool, compress-profile, serve,
profile, prefill-worker, decode-worker.

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

from .serving.launch import add_decode_worker, add_serve, run_decode_worker, run_serve

log = logging.getLogger("jkv")


def _add_model_args(p):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name ({', '.join(known_models())}), HF directory or .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_tensor_parallel_arg(p):
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the weights and KV cache over N devices (default 1; docs/scale.md)")


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
    _add_tensor_parallel_arg(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: one batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="multi-host replica: rank 0's address; every rank runs this command with the same prompts "
                        "and --tensor-parallel up to the global device count (env JKV_COORDINATOR_ADDRESS; "
                        "docs/scale.md)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: ranks in the replica "
                                                                   "(env JKV_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's rank, 0 prints "
                                                                "(env JKV_PROCESS_ID)")


def run_generate(args):
    from .multihost import MultiHost, initialize

    mh = MultiHost.from_values(args.coordinator_address, args.num_processes, args.process_id)
    if mh is not None:
        initialize(mh)  # before the model touches a device
    from .api import LLM

    sp = _sampling(args)
    llm = LLM(args.model, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
    prompts = [[{"role": "user", "content": p}] if args.chat else p for p in args.prompt]
    outputs = llm.generate(prompts, sp)
    if mh is not None and mh.process_id != 0:  # every rank holds the same outputs; rank 0 prints them
        return 0
    for o in outputs:
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


# ---------------------------------------------------------------------- smartgen workers and profile
def add_profile(sub):
    p = sub.add_parser("profile", help="offline SmartGen importance profile (Eq. 1) of a selector on the "
                                       "calibration split, with prefill time per prompt-length bin")
    _add_model_args(p)
    p.add_argument("--selector", default="infinigen")
    p.add_argument("--bins", default="512,1024,2048", help="comma-separated prompt lengths")
    p.add_argument("--prompts-per-bin", type=int, default=2)
    p.add_argument("--steps", type=int, default=16, help="decode steps per calibration prompt")
    p.add_argument("--max-blocks", type=int, default=1024, help="M, blocks per layer")
    p.add_argument("--bandwidth", default=None, help="the link the profile assumes, e.g. 25gbit")
    p.add_argument("--out", required=True, help="profile file (.npz)")


def run_profile(args):
    from models import load_model
    from transport import parse_bandwidth

    from .disagg.selectors import build_selector
    from .selection.calibration import calibration_tokens
    from .transfer.profile import build_profile

    model = load_model(args.model, dtype=args.dtype)
    bins = [int(b) for b in args.bins.split(",")]
    ids = calibration_tokens(model, max(bins) * args.prompts_per_bin)  # calibration split, never eval data
    prompts = {n: [ids[i * n:(i + 1) * n] for i in range(args.prompts_per_bin)] for n in bins}
    selector = build_selector(model, args.selector)
    prof = build_profile(model, selector, args.selector, prompts, args.steps, max_blocks=args.max_blocks,
                         bandwidth_bps=parse_bandwidth(args.bandwidth) if args.bandwidth else None,
                         model_name=args.model)
    prof.save(args.out)
    for b in prof.bins:
        print(f"bin {b.prompt_len:>6} tokens: Tp={b.prefill_s:.3f}s, I[L={b.importance.shape[0]}, "
              f"M={b.importance.shape[1]}]")
    print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------- models
def add_models(sub):
    sub.add_parser("models", help="list the registered model names")


def run_models(args):
    for n in known_models():
        print(n)
    return 0


def _delegate(module: str, name: str | None = None, help_: str | None = None, run: str = "run"):
    """(add, run) for a subcommand whose module defines its arguments and entry point, imported
    only when the parser is built or the command runs. Without `name` the module adds its own
    parser (`add_parser(subparsers)`); with one, it fills this one in (`add_args(parser)`)."""
    import importlib

    def add(sub):
        mod = importlib.import_module(module, __package__)
        if name is None:
            mod.add_parser(sub)
        else:
            mod.add_args(sub.add_parser(name, help=help_))

    def run_(args):
        return getattr(importlib.import_module(module, __package__), run)(args)

    return add, run_


COMMANDS = {"generate": (add_generate, run_generate), "compare": (add_compare, run_compare),
            "eval": _delegate(".eval.cli"), "train-hata": _delegate(".selection.hata_train"),
            "pool": _delegate(".kvpool.server"),
            "demo": _delegate(".disagg.demo", "demo", "the main job: disaggregated prefill/decode on SmolLM2, full vs "
                              "SmartGen transfer over a paced link (one decode + two prefill worker processes)"),
            "models": (add_models, run_models), "serve": (add_serve, run_serve),
            "prefill-worker": _delegate(".disagg.prefill_worker", "prefill-worker", "run a SmartGen prefill worker "
                                        "(JKV_SECRET must be set); prints 'JKV-READY main|bulk' for the decode "
                                        "side to connect to", run="run_from_args"),
            "profile": (add_profile, run_profile),
            "decode-worker": (add_decode_worker, run_decode_worker),
            "compress-profile": _delegate(".compression.cli")}


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
