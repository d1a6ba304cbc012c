"""Task score of InfiniGen selection from int8 metadata (`q8+zstd1`) against exact metadata.

The lossy metadata codec (`jkv.compression.paths.METADATA_Q8`) changes which rows InfiniGen ranks
first, never a KV value. This runs `jkv eval`'s own harness (`jkv.eval.harness.evaluate`: the same
prompts, one prefill per sample, dense reference) with two selectors side by side — InfiniGen on
the metadata as computed, and InfiniGen on `q8_metadata_values` of it, exactly what the decode
worker reads from a `q8+zstd1` container — and reports per task the score of each relative to the
dense decode, and q8's relative to exact's. Fidelity rows (teacher-forced continuation of prose)
give top-1 agreement with the dense next-token and KL next to the task scores.

    PYTHONPATH=. python experiments/metadata_q8_quality.py [--limit 6] [--lengths 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import RESULTS, add_model_arg, describe_machine, machine_info, write_csv  # noqa: E402


class Q8Metadata:
    """A selector whose prefill-side metadata is what a `q8+zstd1` container decodes to."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def prepare(self, layer, K, lengths):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jkv.compression.paths import q8_metadata_values

        leaves, tree = jax.tree_util.tree_flatten(self._inner.prepare(layer, K, lengths))
        return jax.tree_util.tree_unflatten(tree, [jnp.asarray(x) for x in
                                                   q8_metadata_values([np.asarray(x) for x in leaves])])


def main(argv=None) -> int:
    import numpy as np

    from jkv.eval.harness import EvalConfig, build_selectors, evaluate, summarize
    from models import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--tasks", default="passkey,kv_retrieval,variable_tracking,code_completion,fidelity")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--out", default=str(RESULTS / "metadata_q8_quality.csv"))
    args = ap.parse_args(argv)

    info = machine_info()
    model = load_model(args.model)
    config = EvalConfig(tasks=tuple(args.tasks.split(",")), lengths=tuple(int(x) for x in args.lengths.split(",")),
                        selectors=("infinigen",), ratios=(args.ratio,), limit=args.limit, batch=args.limit)
    exact = build_selectors(model, config)[("infinigen", args.ratio)]
    rows = evaluate(model, config, {("infinigen", args.ratio): exact,
                                    ("infinigen-q8meta", args.ratio): Q8Metadata(exact)})
    summary = summarize(rows)
    by = {(r["task"], r["length"], r["selector"]): r for r in summary}
    out = []
    print(f"{'task':18} {'len':>5} {'exact/dense':>11} {'q8/dense':>9} {'q8/exact':>9}")
    for (task, length, sel), r in sorted(by.items()):
        if sel != "infinigen":
            continue
        q = by[(task, length, "infinigen-q8meta")]
        ex, q8 = r["relative_score"], q["relative_score"]
        rel = q8 / ex if ex else float("nan")
        extra = {}
        if task == "fidelity":  # its score is top-1 agreement with the dense next token; KL next to it
            extra = dict(exact_agree=r["score"], q8_agree=q["score"], exact_kl=r.get("kl"), q8_kl=q.get("kl"))
        print(f"{task:18} {length:>5} {ex:11.3f} {q8:9.3f} {rel:9.3f}" +
              (f"   top-1 agreement with dense: exact {extra['exact_agree']:.3f} q8 {extra['q8_agree']:.3f}; "
               f"KL exact {extra['exact_kl']:.4f} q8 {extra['q8_kl']:.4f}" if extra else ""))
        out.append(dict(task=task, length=length, exact_relative=ex, q8_relative=q8, q8_over_exact=rel,
                        exact_score=r["score"], q8_score=q["score"], samples=args.limit, ratio=args.ratio,
                        model=args.model, cpu_model=info["cpu_model"], loadavg_start=info["loadavg_1m"], **extra))
    mean = float(np.mean([r["q8_over_exact"] for r in out if np.isfinite(r["q8_over_exact"])]))
    print(f"mean q8/exact over tasks: {mean:.3f}")
    print(describe_machine(machine_info()))
    write_csv(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
