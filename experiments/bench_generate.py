"""jkv vs Hugging Face transformers on SmolLM2-135M-Instruct (CPU, fp32), side by side in one run.

Measures prefill time for 1K and 2K-token prompts and decode throughput for 64 tokens at batch 1
and 8 (1K-token context; jkv's step is the paged one `LLM` and `jkv serve` run, `--jkv-decode dense`
the contiguous-cache `Model.decode_step` that rows before 2026-12-02 measured, `paged-xla` the paged
step with the XLA page gather; several values give rows for each), each as the median of --repeats runs after a warm-up (jkv compiles in
the warm-up). Both sides run float32 weights and activations (transformers' default CPU matmul
precision keeps fp32: no AMX/bf16 path), in this one process, one side after the other.

Per case it records wall seconds and CPU seconds (process user+sys over every thread, around the
same calls) of each side, and the ratios of both: on a loaded box the wall ratio swings with what
else runs; CPU seconds leave out the time a side waited for a core, but not the time transformers'
OpenMP threads spin at a barrier for a descheduled peer, so under load neither is a speed claim. Each row carries the CPU model, its vector extensions, the load average before and
after the case, the torch thread count and XLA_FLAGS; `quiet` says whether the 1-minute load
average stayed under half the cores. A row that is not quiet is not a claim
(docs/performance.md). Refuses to run with XLA_FLAGS at -O0 (the test suite's setting).
Writes experiments/results/bench_generate.csv (or --out).

    PYTHONPATH=. python experiments/bench_generate.py [--repeats 3] [--quick]
    PYTHONPATH=. python experiments/bench_generate.py --prompt-lens 256 --batches 1 --steps 8   # small
    PYTHONPATH=. python experiments/bench_generate.py --jkv-decode paged paged-xla   # CPU kernel vs XLA gather
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
from experiments.common import RESULTS, describe_machine, machine_info, write_csv  # noqa: E402
from jkv.xla_options import require_optimized  # noqa: E402
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


def timed(fn, repeats) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of `repeats` calls after a warm-up (compiles).
    CPU seconds: this process's user+sys over all its threads (time.process_time), so a side's
    worker threads count, and so does a thread spinning at a barrier."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


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


def jkv_paged_decode(m, ids, batch, steps, page_size: int = 16, cpu_kernels: bool = True):
    """The decode step `LLM` and `jkv serve` run (`Model.paged_decode_step` over a page table), from
    the same prefill, with a host argmax each step; the pages are rewritten per run.
    cpu_kernels=False: the same step with the XLA gather reference for paged attention instead of
    the native CPU kernel (the step before 2026-12-02 16:00), a program of its own traced under
    `dispatch.cpu_kernels(False)` (the model's jitted step keeps the default)."""
    import functools

    import jax

    from models import paged
    from pallas_kernels import dispatch

    toks = np.array([ids] * batch, np.int32)
    lengths = np.full(batch, len(ids), np.int32)
    _, kv = m.prefill(toks, lengths)
    pages_per_row = -(-(len(ids) + steps) // page_size)
    table = 1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)  # page 0: null
    reference = jax.jit(functools.partial(paged.paged_decode_step_compute, m.cfg))

    def step(pages, tok, pos):
        if cpu_kernels:
            return m.paged_decode_step(pages, table, tok, pos)
        with dispatch.cpu_kernels(False):  # read when `reference` is first traced
            logits, new_k, new_v = reference(m.params, pages, table, tok, pos)
        return logits, m._paged_write(pages, table, pos, new_k, new_v)

    def run():
        pages = m.write_prefill_pages(m.init_paged_kv(1 + batch * pages_per_row, page_size), table, kv, lengths)
        tok = np.zeros(batch, np.int32) + 42
        pos = lengths.copy()
        for _ in range(steps):
            logits, pages = step(pages, tok, pos)
            tok = np.asarray(logits.argmax(-1), np.int32)
            pos = pos + 1
    return run


JKV_DECODE = {"paged": jkv_paged_decode, "dense": jkv_decode,
              "paged-xla": lambda *a: jkv_paged_decode(*a, cpu_kernels=False)}


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


FIELDS = ["case", "jkv_s", "hf_s", "jkv_cpu_s", "hf_cpu_s", "jkv_tok_s", "hf_tok_s", "metric", "ratio", "cpu_ratio",
          "quiet", "loadavg_1m", "loadavg_1m_after", "jkv_decode", "cpu_model", "vector_extensions", "cores", "torch_threads",
          "xla_flags", "jax_version", "torch_version", "transformers_version"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048],
                    help="prefill cases; decode runs at the first one's context")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--jkv-decode", choices=sorted(JKV_DECODE), nargs="+", default=["paged"],
                    help="jkv's decode step(s), each its own rows (transformers rerun next to each): paged (what "
                         "LLM and jkv serve run), paged-xla (the same with the XLA page gather instead of the "
                         "CPU kernel, the step before 2026-12-02 16:00) or dense (Model.decode_step, a "
                         "contiguous [B, H_kv, N, D] cache; what this script measured before 2026-12-02)")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="256/512-token prompts, 16 steps, 1 repeat")
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/bench_generate[_quick].csv)")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_lens, args.steps, args.repeats = [256, 512], 16, 1
    if args.out is None:
        args.out = str(RESULTS / ("bench_generate_quick.csv" if args.quick else "bench_generate.csv"))
    return args


def side_by_side(case: str, jkv_run, hf_run, reps: int, tokens: int | None = None) -> dict:
    """One row: both sides timed back to back, the load average around them."""
    load = os.getloadavg()[0]
    tj, cj = timed(jkv_run, reps)
    th, ch = timed(hf_run, reps)
    row = dict(case=case, jkv_s=tj, hf_s=th, jkv_cpu_s=cj, hf_cpu_s=ch, loadavg_1m=round(load, 2),
               loadavg_1m_after=round(os.getloadavg()[0], 2))
    if tokens is None:
        row.update(metric="time ratio jkv/hf", ratio=tj / th, cpu_ratio=cj / ch)
    else:  # throughput: higher is better, so hf over jkv
        row.update(metric="tok/s ratio jkv/hf", ratio=th / tj, cpu_ratio=ch / cj, jkv_tok_s=tokens / tj,
                   hf_tok_s=tokens / th)
    return row


def main(argv=None):
    args = parse_args(argv)
    require_optimized("bench_generate")
    import jax
    import torch
    import transformers

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    info = machine_info()
    run_info = dict(cpu_model=info["cpu_model"], vector_extensions=info["vector_extensions"], cores=info["cores"],
                    torch_threads=torch.get_num_threads(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                    jax_version=jax.__version__, torch_version=torch.__version__,
                    transformers_version=transformers.__version__)
    print(f"{describe_machine(info)}; torch threads {run_info['torch_threads']}, XLA_FLAGS {run_info['xla_flags']!r}, "
          f"jkv decode step: {' '.join(args.jkv_decode)}")
    m = load_model("smollm2-135m-instruct")
    hf = load_hf_reference("smollm2-135m-instruct")
    rows = []
    for n in args.prompt_lens:
        ids = corpus_tokens(m.tokenizer, n)
        rows.append(side_by_side(f"prefill {n}", jkv_prefill(m, ids), hf_prefill(hf, ids), args.repeats))
    ids = corpus_tokens(m.tokenizer, args.prompt_lens[0])
    for b in args.batches:
        for variant in args.jkv_decode:
            rows.append(dict(side_by_side(f"decode b={b} ctx={len(ids)}", JKV_DECODE[variant](m, ids, b, args.steps),
                                          hf_decode(hf, ids, b, args.steps), args.repeats, tokens=b * args.steps),
                             jkv_decode=variant))
    quiet_below = 0.5 * (info["cores"] or 1)
    for r in rows:
        r.update(run_info, quiet=max(r["loadavg_1m"], r["loadavg_1m_after"]) < quiet_below)
    print(f"\n{'case':<22} {'jkv step':<9} {'jkv s':>8} {'hf s':>8} {'jkv cpu-s':>9} {'hf cpu-s':>9} {'jkv tok/s':>10} "
          f"{'hf tok/s':>9}  ratio (wall) / (cpu)  load")
    for r in rows:
        print(f"{r['case']:<22} {r.get('jkv_decode', ''):<9} {r['jkv_s']:>8.3f} {r['hf_s']:>8.3f} {r['jkv_cpu_s']:>9.3f} {r['hf_cpu_s']:>9.3f} "
              f"{r.get('jkv_tok_s', float('nan')):>10.1f} {r.get('hf_tok_s', float('nan')):>9.1f}  "
              f"{r['metric']} = {r['ratio']:.2f} / {r['cpu_ratio']:.2f}  {r['loadavg_1m']:.1f}")
    if not all(r["quiet"] for r in rows):
        print(f"load average reached {quiet_below:.1f} or more ({info['cores']} cores): these figures are not "
              "claims (quiet=False in the CSV)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out, rows, fields=FIELDS)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
