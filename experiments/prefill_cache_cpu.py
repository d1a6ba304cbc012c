"""CPU seconds of one follow-up prefill with and without the prefill role's prefix cache
(jkv/disagg/prefill_cache.py), side by side in one process.

    python experiments/prefill_cache_cpu.py --cached 1990 --new 58 --runs 5

A random 4-layer qwen2 (hidden 256, 8 heads, 2 KV heads); turn 1 (`--cached` tokens) is prefilled
once into a warmed cache; the follow-up (turn 1 + `--new` tokens) is then prefilled `--runs` times
each way, alternately: `prefill_rows` from the first uncached token (storing the new pages, as the
worker does) vs `Model.prefill` of the whole prompt (storing nothing). Both shapes are compiled before timing. Process CPU time (every thread) per run;
a loaded box inflates both: compare within one invocation and record `uptime`.
"""
from __future__ import annotations

import argparse
import resource

import numpy as np

from jkv.disagg.prefill_cache import PrefillPrefixCache, prefill_rows
from models import tiny_model


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def padded(prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    T = -(-len(prompt) // 64) * 64
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(prompt)] = prompt
    return tokens, np.asarray([len(prompt)], np.int32)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cached", type=int, default=1990)
    p.add_argument("--new", type=int, default=58)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    m = tiny_model("qwen2", 0, num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                   intermediate_size=512, max_position_embeddings=8192)
    rng = np.random.default_rng(0)
    first = rng.integers(3, 300, args.cached).tolist()
    cache = PrefillPrefixCache(m, (args.runs + 3) * (args.cached + args.new))

    def storing(plan):
        return lambda layer, K, V: cache.store_layer(plan, layer, np.stack(
            [np.asarray(K)[0, :, :plan.num_tokens], np.asarray(V)[0, :, :plan.num_tokens]]))

    plan = cache.plan(first)
    prefill_rows(m, cache, *padded(first), [plan], storing(plan))
    tokens, lengths = padded(first + rng.integers(3, 300, args.new).tolist())

    def with_cache():  # a new follow-up each time (the previous one's pages are cached, as a worker would)
        second = first + rng.integers(3, 300, args.new).tolist()
        plan = cache.plan(second)
        assert plan.start == len(first) // cache.page_size * cache.page_size
        np.asarray(prefill_rows(m, cache, *padded(second), [plan], storing(plan)))

    def whole():
        np.asarray(m.prefill(tokens, lengths)[0])

    runs = {"cache": [], "whole": []}
    for f in (with_cache, whole):
        f()  # compiles
    for _ in range(args.runs):
        for name, f in (("cache", with_cache), ("whole", whole)):
            t0 = cpu_s()
            f()
            runs[name].append(cpu_s() - t0)
    for name, v in runs.items():
        print(f"{name}: median CPU s {np.median(v):.4f} ({', '.join(f'{x:.4f}' for x in v)})")
    print(f"whole / cache: {np.median(runs['whole']) / np.median(runs['cache']):.1f}x")


if __name__ == "__main__":
    main()
