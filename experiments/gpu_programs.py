"""Decode programs on the device: an end-to-end generate and each program's time per backend.

    python experiments/gpu_programs.py --out DIR [--small]

1. generate: a random-weight model (experiments/decode_programs.small_config: SmolLM2-135M's layer
   geometry, 4 layers) prefills token-id prompts and greedily decodes, densely (Model.decode_step)
   and through jkv's sparse decode with the Quest selector under every kernel backend; the
   tokens must be valid ids (same_tokens_as_xla says whether a backend matched XLA's).
2. programs: median time of the dense decode step (XLA), of the SmartGen sparse decode layer and
   of the decode worker's own layer programs (`fused`, `landed`, `attend_landed`:
   experiments/decode_programs.worker_layer_programs) under every kernel backend this device has
   (mosaic / pallas / xla), with the achieved
   bandwidth over the bytes each program must read (weights + the KV it attends over), as a
   fraction of the H200's 4.8 TB/s.
Writes DIR/programs.csv and DIR/generate.csv; --small shrinks every size (the CPU dry run).
"""
from __future__ import annotations

import argparse
import csv
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments import decode_programs as dp  # noqa: E402
from experiments.bench_kernels import median_seconds  # noqa: E402
from models import transformer as tfm  # noqa: E402
from models.model import Model  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402

H200_HBM_BYTES_PER_S = 4.8e12


def _random(aval, rng):
    if jnp.issubdtype(aval.dtype, jnp.integer):
        return jnp.asarray(rng.integers(0, 2, aval.shape), aval.dtype)
    return jnp.asarray(rng.standard_normal(aval.shape, np.float32) * 0.1, aval.dtype)


def kernel_backends() -> list[str]:
    if jax.default_backend() != "gpu":
        return ["xla"]
    chosen = dispatch.resolved_backend() if dispatch.get_backend() == "auto" else "pallas"
    return ["mosaic", "pallas", "xla"] if chosen == "mosaic" else ["pallas", "xla"]


def generate_sparse(cfg, prompts: list[list[int]], max_tokens: int, backend: str) -> np.ndarray:
    """Greedy tokens i32[B, max_tokens] through jkv's host-offloaded sparse decode with the Quest
    selector, whose top-k goes through `dispatch` (so through the kernels of `backend`)."""
    from jkv.selection import get_selector
    from jkv.selection.sparse_decode import generate_sparse as run

    with dispatch.backend(backend):
        model = Model(cfg, tfm.init_params(cfg, 0), name="random-small")
        return run(model, prompts, get_selector("quest", max_ratio=0.5), max_tokens).tokens


def generate(cfg, prompts: list[list[int]], max_tokens: int, backend: str) -> np.ndarray:
    """Greedy tokens i32[B, max_tokens] from token-id prompts (right-padded prefill), dense."""
    with dispatch.backend(backend):
        model = Model(cfg, tfm.init_params(cfg, 0), name="random-small")
        lengths = np.array([len(p) for p in prompts], np.int32)
        width = int(lengths.max())
        tokens = np.zeros((len(prompts), width), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = p
        logits, kv = model.prefill(tokens, lengths)
        cache = model.cache_from_prefill(kv, width + max_tokens)
        out = []
        positions = jnp.asarray(lengths)
        for _ in range(max_tokens):
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out.append(np.asarray(nxt))
            logits, cache = model.decode_step(cache, nxt, positions)
            positions = positions + 1
        return np.stack(out, axis=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU dry run)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    device = jax.devices()[0].device_kind
    if args.small:
        cfg = dp.small_config(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=512)
        batch, n_max, repeats, new_tokens = 2, 256, 2, 4
    else:
        cfg = dp.small_config()
        batch, n_max, repeats, new_tokens = 8, 32_768, 20, 32
    status = 0

    # 1. End-to-end generate from token ids, XLA vs the device's kernels.
    prompts = [list(rng.integers(3, cfg.vocab_size, size=n)) for n in (5, 17, 9)[: max(2, batch // 3)]]
    gen_rows = []
    results = {}
    runs = [("dense", generate, "xla")] + [("sparse[quest 50%]", generate_sparse, b)
                                           for b in reversed(kernel_backends())]  # xla first
    for kind, fn, backend in runs:
        start = time.perf_counter()
        try:
            results[kind, backend] = fn(cfg, prompts, new_tokens, backend)
            error = ""
        except Exception as exc:  # noqa: BLE001 - recorded; the other backends still run
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            status = 1
        seconds = time.perf_counter() - start
        toks = results.get((kind, backend))
        ok = toks is not None and bool(((toks >= 0) & (toks < cfg.vocab_size)).all())
        if not ok:
            status = 1
        want = results.get((kind, "xla"))
        agrees = "" if toks is None or want is None else bool((toks == want).all())
        gen_rows.append(dict(device=device, kind=kind, backend=backend, prompts=len(prompts),
                             new_tokens=new_tokens, seconds=f"{seconds:.2f}", valid_ids=ok,
                             same_tokens_as_xla=agrees, first_tokens=" ".join(map(str, toks[0][:8])) if toks is not None else "",
                             error=error))
        print(f"generate {kind}[{backend}] {seconds:.2f} s valid={ok} same_as_xla={agrees} {error}")
    with open(os.path.join(args.out, "generate.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(gen_rows[0]))
        writer.writeheader()
        writer.writerows(gen_rows)

    # 2. Program timings and achieved bandwidth.
    rows = []
    dense_fn, dense_avals = dp.dense_decode_program(cfg, batch=batch, n_max=n_max)
    sparse_fn, sparse_avals = dp.sparse_decode_layer_program(cfg, batch=batch, n_max=n_max)
    k = -(-n_max // 5)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    kv_row = cfg.num_kv_heads * cfg.head_dim * itemsize
    layer_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(sparse_avals[0]))
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(dense_avals[0]))
    programs = [("decode_step[dense]", dense_fn, dense_avals, ["xla"],
                 param_bytes + 2 * cfg.num_layers * batch * n_max * kv_row)]
    # The sparse layer reads the layer weights, the partial keys it scores (d_p columns of every
    # cached key), and the selected K/V rows.
    d_p = -(-3 * cfg.head_dim // 10)
    sparse_bytes = (layer_bytes + batch * n_max * cfg.num_kv_heads * d_p * itemsize
                    + 2 * batch * k * kv_row)
    programs.append(("sparse_decode_layer", sparse_fn, sparse_avals, kernel_backends(), sparse_bytes))
    # The decode worker's own layer programs (oracle: it scores every cached key, f32 metadata),
    # on inputs of random 0/1 ids: every page id, slot and table entry is a valid one.
    attend_bytes = layer_bytes + 2 * batch * k * kv_row
    for name, (fn, avals, _) in dp.worker_layer_programs(cfg, batch, 16, n_max).items():
        meta_bytes = 0 if name == "attend_landed" else batch * n_max * cfg.num_kv_heads * cfg.head_dim * 4
        programs.append((f"worker_{name}", fn, avals, kernel_backends(), attend_bytes + meta_bytes))
    positions = jnp.full((batch,), n_max - 1, jnp.int32)
    for name, fn, avals, backends, nbytes in programs:
        inputs = [jax.tree_util.tree_map(lambda a: _random(a, rng), a) for a in avals]
        if name.startswith("decode"):  # (params, cache, tokens, positions)
            inputs[-2] = jnp.asarray(rng.integers(3, cfg.vocab_size, batch), jnp.int32)
            inputs[-1] = positions
        elif name == "sparse_decode_layer":  # (layer_params, x, K, V, positions, kv_mask: 2 remote / 1 local)
            inputs[-2] = positions
            inputs[-1] = jnp.asarray(rng.choice(np.array([1, 2], np.int8), (batch, n_max)))
        seconds = {}
        for backend in backends:
            error = ""
            try:
                with dispatch.backend(backend):
                    compiled = jax.jit(functools.wraps(fn)(lambda *a, f=fn: f(*a)))
                    seconds[backend] = median_seconds(compiled, inputs, repeats)
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                status = 1
            s = seconds.get(backend)
            gbps = nbytes / s / 1e9 if s else None
            rows.append(dict(device=device, program=name, backend=backend, batch=batch, cache_tokens=n_max,
                             k=k if not name.startswith("decode") else "", ms=f"{s * 1e3:.3f}" if s else "",
                             bytes=nbytes, gbps=f"{gbps:.1f}" if gbps else "",
                             hbm_fraction_of_4_8_tbs=f"{gbps * 1e9 / H200_HBM_BYTES_PER_S:.3f}" if gbps else "",
                             speedup_vs_xla="", error=error))
            print(f"{name}[{backend}] {rows[-1]['ms']} ms {rows[-1]['gbps']} GB/s {error}")
        for row in rows:
            if row["program"] == name and row["backend"] in seconds and "xla" in seconds:
                row["speedup_vs_xla"] = f"{seconds['xla'] / seconds[row['backend']]:.2f}"
    with open(os.path.join(args.out, "programs.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return status


if __name__ == "__main__":
    sys.exit(main())
