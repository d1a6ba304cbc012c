"""Bayesian profiling (KVServe Alg. 1) vs exhaustive search on REAL SmolLM2-135M KV.

Objective: `FidelityObjective` on the prefill KV of `--tokens` tokens of the repo's docs (accuracy =
1 - relative attention-output error, queries = the last 16 keys of each head; CR with all container
bytes; latency = encode + decode). Space: {identity, hadamard, delta16} x KIVI {2,3,4,8} bits x
groups {32, 64, 128} x codecs {none, zstd3} = 72 pipelines. Prints the optimum each search finds
and how many evaluations it took; writes experiments/results/kvserve_profile_search.csv and the
BO profile (3D Pareto set) as experiments/results/kvserve_profile_docs.json. Every spec is measured
once (by the exhaustive pass); the BO runs reuse those measurements, so their `wall_s` is the
search's own overhead (GP fits), and their cost in objective time is evaluations/72 of exhaustive's.

    python experiments/kvserve_profile_search.py [--tokens 512] [--threshold 0.9]
"""
from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from jkv.compression import (CodecSpec, FidelityObjective, QuantizerSpec, SearchConfig, TransformSpec,
                             bayesian_search, build_profile, enumerate_space, exhaustive_search, nominal_cr,
                             save_profile)

from experiments.common import RESULTS, write_csv
from experiments.kvserve_real_kv import document_tokens


class Cached:
    """Evaluate each spec once, so both searches see identical (noisy-latency) measurements."""

    def __init__(self, fn):
        self.fn, self.cache, self.calls = fn, {}, 0

    def __call__(self, spec):
        self.calls += 1
        if spec.id not in self.cache:
            self.cache[spec.id] = self.fn(spec)
        return self.cache[spec.id]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threshold", type=float, default=0.9)
    args = ap.parse_args()
    from models import load_model

    model = load_model("smollm2-135m-instruct")
    ids = document_tokens(model.tokenizer, args.tokens)[: args.tokens]
    _, kv = model.prefill(jnp.array([ids]), jnp.array([args.tokens]))
    kv16 = [(np.asarray(k[0], np.float16), np.asarray(v[0], np.float16)) for k, v in kv]
    space = enumerate_space([TransformSpec(), TransformSpec("hadamard"), TransformSpec("delta", 16)],
                            [QuantizerSpec("kivi", b, g) for b in (2, 3, 4, 8) for g in (32, 64, 128)],
                            [CodecSpec(), CodecSpec("zstd", 3)])
    objective = Cached(FidelityObjective(kv16))

    t0 = time.perf_counter()
    exhaustive = exhaustive_search(space, objective, args.threshold)
    t_ex = time.perf_counter() - t0
    rows = [{"method": "exhaustive", "evaluations": len(exhaustive.evaluations), "best": exhaustive.best.spec_id,
             "best_cr": round(exhaustive.best.cr, 3), "best_acc": round(exhaustive.best.accuracy, 4),
             "wall_s": round(t_ex, 1)}]
    shape = kv16[0][0].shape
    for seed in range(3):
        for use_prior in (True, False):
            counting = Cached(lambda s: objective.cache[s.id])
            t0 = time.perf_counter()
            result = bayesian_search(space, counting, SearchConfig(args.threshold, seed=seed),
                                     cr_prior=(lambda s: nominal_cr(s, shape)) if use_prior else None)
            best = result.best
            rows.append({"method": f"bo seed={seed} prior={use_prior}", "evaluations": len(result.evaluations),
                         "best": best.spec_id if best else "", "best_cr": round(best.cr, 3) if best else 0,
                         "best_acc": round(best.accuracy, 4) if best else 0,
                         "wall_s": round(time.perf_counter() - t0, 1)})
            if seed == 0 and use_prior:
                out = RESULTS / "kvserve_profile_docs.json"
                save_profile(out, build_profile(result, "docs", objective.fn.probe_bytes))
    for r in rows:
        ratio = r["best_cr"] / rows[0]["best_cr"]
        print(f"{r['method']:28s} evals {r['evaluations']:3d}/{len(space)}  best {r['best']:28s} "
              f"CR {r['best_cr']:6.3f} ({ratio:.3f} of exhaustive)  acc {r['best_acc']:.4f}  (search {r['wall_s']} s)")
    out = RESULTS / "kvserve_profile_search.csv"
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
