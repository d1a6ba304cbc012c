"""Why a pipeline with relative task score 0.983 generated tokens that agree 0.08-1.00 with the
uncompressed run (issue 22; `smartgen_ttst.py --quick --compression auto`).

The same 4 x 512-token prompts as the quick SmartGen run (`jkv.disagg.harness.text_prompts`: eval
corpus windows + a summarization question, chat template), prefilled once to a float32 host pool
(what serving's uncompressed path moves). Each variant replaces the prompt's KV by the profile
evaluation's round trip (`workloads.chunked_roundtrip` of the fp16 KV at 128-token chunks — the
served KV bit for bit, `tests/compression_tests/test_kv_transfer.py::test_served_kv_is_the_profile_evaluations_round_trip`),
then decodes `--tokens` greedy tokens with dense attention and with InfiniGen (the selector the
SmartGen run decodes with; token-level here, `jkv.selection.sparse_decode`). Per request and
variant: generated-token agreement with the float32 run of the same selector (prefix, fraction:
`jkv.eval.fidelity.generation_agreement`), and teacher-forced along the float32 run's own tokens,
top-1 agreement and KL (how often a single step flips; greedy decoding then follows another path).

Writes experiments/results/kvserve_gen_agreement.csv. Usage:
    nice -n 5 python experiments/kvserve_gen_agreement.py [--tokens 24] [--requests 4]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments.common import RESULTS, write_csv  # noqa: E402

VARIANTS = ("identity+none+zstd3", "hadamard+kivi4g128+zstdh3", "hadamard+kivi3g128+zstdh3")


def replaced(host, pipe, chunk_tokens: int):
    """host's KV with every request's prompt rows replaced by the chunked round trip of their fp16 copy."""
    from jkv.compression.workloads import chunked_roundtrip

    keys, values = [k.copy() for k in host.keys], [v.copy() for v in host.values]
    for b, n in enumerate(host.prompt_lengths):
        kv16 = [(k[b, :, :n].astype(np.float16), v[b, :, :n].astype(np.float16)) for k, v in zip(keys, values)]
        decoded = chunked_roundtrip(pipe, kv16, chunk_tokens)[0]
        for layer, (k, v) in enumerate(decoded):
            keys[layer][b, :, :n], values[layer][b, :, :n] = k, v
    return keys, values


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default=str(RESULTS / "kvserve_gen_agreement.csv"))
    args = ap.parse_args(argv)
    from jkv.compression.pipeline import Pipeline
    from jkv.compression.spec import PipelineSpec
    from jkv.disagg.harness import text_prompts
    from jkv.disagg.selectors import build_selector
    from jkv.eval.fidelity import fidelity_metrics, generation_agreement
    from jkv.selection.simple import Dense
    from jkv.selection.sparse_decode import decode, pool_capacity, prefill_to_host
    from models import load_model

    model = load_model("smollm2-135m-instruct")
    prompts = text_prompts(model.tokenizer, "eval", args.requests, args.prompt_len)
    host = prefill_to_host(model, prompts, pool_capacity(prompts, args.tokens))
    original = ([k.copy() for k in host.keys], [v.copy() for v in host.values])
    variants = {sid: replaced(host, Pipeline(PipelineSpec.parse(sid)), 128) for sid in VARIANTS}
    rows = []
    for name, selector in (("dense", Dense()), ("infinigen", build_selector(model, "infinigen"))):
        host.keys, host.values = [k.copy() for k in original[0]], [v.copy() for v in original[1]]
        ref = decode(model, host, selector, args.tokens, keep_logits=True)
        for sid, (keys, values) in variants.items():
            host.keys, host.values = [k.copy() for k in keys], [v.copy() for v in values]
            free = decode(model, host, selector, args.tokens)
            host.keys, host.values = [k.copy() for k in keys], [v.copy() for v in values]
            # step i feeds the float32 run's token i, so logits[:, i + 1] score its token i + 1
            forced = decode(model, host, selector, args.tokens, forced_tokens=ref.tokens, keep_logits=True)
            for b in range(len(prompts)):
                agree = generation_agreement(ref.tokens[b].tolist(), free.tokens[b].tolist())
                m = fidelity_metrics(ref.logits[b, 1:], forced.logits[b, 1:], ref.tokens[b, 1:])
                rows.append(dict(selector=name, spec=sid, request=b, prompt_tokens=len(prompts[b]),
                                 gen_tokens=args.tokens, gen_prefix=agree["prefix"],
                                 gen_fraction=round(agree["fraction"], 3), forced_top1=round(m["top1"], 3),
                                 forced_kl=round(m["kl"], 4), flips=m["agree"].count("0"),
                                 load=round(os.getloadavg()[0], 1)))
                print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
            write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
