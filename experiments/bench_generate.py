"""jkv vs Hugging Face transformers on SmolLM2-135M-Instruct (CPU, fp32), side by side in one run.

Measures prefill time for 1K and 2K-token prompts and decode throughput for 64 tokens at batch 1
and 8 (1K-token context), each as the median of --repeats runs after a warm-up (jkv compiles in
the warm-up). Prints ratios and writes experiments/results/bench_generate.csv.

    python experiments/bench_generate.py [--repeats 3] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jkv.compare import hf_step, load_hf_reference  # noqa: E402
from experiments.common import RESULTS, write_csv  # noqa: E402
from models import load_model  # noqa: E402


def corpus_tokens(tok, n: int) -> list[int]:
    """Real English text from this machine (license texts), repeated as needed, tokenized to n tokens."""
    texts = []
    for p in sorted(Path("/usr/share/common-licenses").glob("*"))[:6]:
        if p.is_file():
            texts.append(p.read_text(errors="ignore"))
    text = "\n".join(texts) or ("The quick brown fox jumps over the lazy dog. " * 400)
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def timed(fn, repeats):
    fn()  # warm-up (compiles)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def jkv_prefill(m, ids):
    def run():
        logits, kv = m.prefill(np.array([ids], np.int32), np.array([len(ids)], np.int32))
        logits.block_until_ready()
        kv[-1][1].block_until_ready()
    return run


def hf_prefill(hf, ids):
    import torch

    def run():
        with torch.no_grad():
            hf(torch.tensor([ids]), use_cache=True)
    return run


def jkv_decode(m, ids, batch, steps):
    toks = np.array([ids] * batch, np.int32)
    lengths = np.full(batch, len(ids), np.int32)
    _, kv = m.prefill(toks, lengths)

    def run():
        cache = m.cache_from_prefill(kv, len(ids) + steps)
        tok = np.zeros(batch, np.int32) + 42
        pos = lengths.copy()
        for _ in range(steps):
            logits, cache = m.decode_step(cache, tok, pos)
            tok = np.asarray(logits.argmax(-1), np.int32)  # host sync each step, as a real engine does
            pos = pos + 1
    return run


def hf_decode(hf, ids, batch, steps):
    import copy

    import torch

    with torch.no_grad():
        _, past0 = hf_step(hf, torch.tensor([ids] * batch))

    def run():
        past = copy.deepcopy(past0)
        tok = torch.full((batch, 1), 42)
        with torch.no_grad():
            for _ in range(steps):
                logits, past = hf_step(hf, tok, past)
                tok = logits[:, -1].argmax(-1, keepdim=True)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="256/512-token prompts, 16 steps, 1 repeat")
    args = ap.parse_args()
    import torch

    print(f"torch threads {torch.get_num_threads()}, cores {os.cpu_count()}")
    m = load_model("smollm2-135m-instruct")
    hf = load_hf_reference("smollm2-135m-instruct")
    lens = (256, 512) if args.quick else (1024, 2048)
    steps = 16 if args.quick else args.steps
    reps = 1 if args.quick else args.repeats
    rows = []
    for n in lens:
        ids = corpus_tokens(m.tokenizer, n)
        tj = timed(jkv_prefill(m, ids), reps)
        th = timed(hf_prefill(hf, ids), reps)
        rows.append(dict(case=f"prefill {n}", jkv_s=tj, hf_s=th, metric="time ratio jkv/hf", ratio=tj / th))
    ids = corpus_tokens(m.tokenizer, lens[0])
    for b in (1, 8):
        tj = timed(jkv_decode(m, ids, b, steps), reps)
        th = timed(hf_decode(hf, ids, b, steps), reps)
        rows.append(dict(case=f"decode b={b} ctx={lens[0]}", jkv_s=tj, hf_s=th,
                         metric="tok/s ratio jkv/hf", ratio=th / tj,
                         jkv_tok_s=b * steps / tj, hf_tok_s=b * steps / th))
    print(f"\n{'case':<22} {'jkv s':>8} {'hf s':>8} {'jkv tok/s':>10} {'hf tok/s':>9}  ratio")
    for r in rows:
        print(f"{r['case']:<22} {r['jkv_s']:>8.3f} {r['hf_s']:>8.3f} {r.get('jkv_tok_s', float('nan')):>10.1f} "
              f"{r.get('hf_tok_s', float('nan')):>9.1f}  {r['metric']} = {r['ratio']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("bench_generate_quick.csv" if args.quick else "bench_generate.csv")
    write_csv(out, rows, fields=["case", "jkv_s", "hf_s", "jkv_tok_s", "hf_tok_s", "metric", "ratio"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
