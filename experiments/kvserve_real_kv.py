"""CR and fidelity of compression pipelines on REAL KV from SmolLM2-135M-Instruct.

Prefills N tokens of a local document, takes each layer's K, V ([H_kv=3, N, D=64]) in float16
(the wire dtype: CR is relative to fp16 KV), and for each pipeline reports:

- CR with every container byte counted, per transfer-block size Nb (header overhead matters for
  small blocks);
- relative reconstruction error of K and V over all layers;
- model fidelity: teacher-forced decode of the next `--steps` tokens of the document on top of the
  decompressed KV vs the uncompressed KV: mean KL(p_ref || p_comp) and top-1 agreement;
- encode / decode throughput (whole KV, Nb = 256, best of 3, first pass compiles).

Two extra sweeps (rows after the pipelines): per-layer sensitivity — Hadamard + KIVI-2 g128 on one
group of 5 layers, the others unquantized (an explicit `mixed-` table) — and streaming-head pruning
(`jkv.compression.streaming`, heads classified from the prompt's last 32 queries, sink 16 + recent
64) alone and with KIVI-3, decoded with the per-head masked decoder; CR at Nb = 256 only.

Writes experiments/results/kvserve_real_kv.csv. Usage:
    python experiments/kvserve_real_kv.py [--tokens 1024] [--steps 32]
"""
from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jkv.compression import Calibration, Pipeline, PipelineSpec, decode_block
from jkv.compression.heads import observation_scores

from experiments.common import REPO as ROOT, RESULTS, add_out_arg, write_csv

SPECS = ["identity+none+zstd3", "identity+kivi8g32+none", "identity+kivi4g32+none", "identity+kivi4g32+zstd3",
         "identity+kivi2g32+none", "identity+kivi2g32+zstd3", "hadamard+kivi4g32+none", "hadamard+kivi2g32+none",
         "hadamard+tok4g32+none", "hadamard+tok2g32+none", "identity+tok4g32+none", "identity+tok2g32+none",
         "delta16+tok4g32+zstd3", "identity+mixhq8s2r25g32+zstd3", "hadamard+mixhq4s2r25g32+zstd3",
         # Toward >= 8x: larger groups amortize the fp16 scale + zero (1 bit/value at g32).
         "hadamard+kivi3g64+zstd3", "hadamard+kivi2g64+zstd3", "hadamard+kivi2g128+zstd3",
         "identity+kivi2g128+zstd3", "hadamard+mixhq4s1r25g64+zstd3",
         # zstdh (min match 7) and the entropy-coded uniform quantizer (step % of the group std)
         "hadamard+kivi2g128+zstdh3", "hadamard+kivi3g128+zstdh3", "hadamard+ec40g128+zstdh3",
         "hadamard+ec60g128+zstdh3", "hadamard+ec80g128+zstdh3", "hadamard+ec120g128+zstdh3"]
BLOCK_SIZES = [16, 64, 256, 1024]


def document_tokens(tokenizer, n: int) -> list[int]:
    texts = [Path(p).read_text() for p in sorted(glob.glob(str(ROOT / "docs" / "*.md"))) + [str(ROOT / "README.md")]]
    ids = tokenizer.encode("\n\n".join(texts))
    while len(ids) < n:
        ids = ids + ids
    return ids


def add_document_args(ap: argparse.ArgumentParser, tokens: int, steps: int) -> None:
    ap.add_argument("--tokens", type=int, default=tokens, help="prompt tokens (from the repository's docs)")
    ap.add_argument("--steps", type=int, default=steps, help="teacher-forced decode steps after the prompt")


def document_kv(tokens: int, steps: int):
    """smollm2-135m-instruct, `tokens` + `steps` ids of the repository's docs, the KV of one prefill
    of the first `tokens` (per layer (K, V) [1, H_kv, N, D]) and that prefill's seconds."""
    from models import load_model

    model = load_model("smollm2-135m-instruct")
    ids = document_tokens(model.tokenizer, tokens + steps)
    t0 = time.perf_counter()
    _, kv = model.prefill(np.asarray([ids[:tokens]], np.int32), np.asarray([tokens], np.int32))
    return model, ids, kv, time.perf_counter() - t0


def encode_all(pipe: Pipeline, kv16, nb: int) -> list[list[bytes]]:
    """Per layer, the containers of K and V blocks of nb tokens."""
    out = []
    for layer, (k, v) in enumerate(kv16):
        blocks = []
        for start in range(0, k.shape[1], nb):
            blocks += [pipe.encode_block(k[:, start:start + nb], layer=layer, kind="k"),
                       pipe.encode_block(v[:, start:start + nb], layer=layer, kind="v")]
        out.append(blocks)
    return out


def decode_all(encoded: list[list[bytes]]):
    kv = []
    for blocks in encoded:
        ks = [decode_block(b) for b in blocks[0::2]]
        vs = [decode_block(b) for b in blocks[1::2]]
        kv.append((jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1)))
    return kv


def teacher_forced_logits(model, kv, next_tokens, n: int):
    """Logits of `len(next_tokens)` decode steps on top of kv (list of [H_kv, N, D])."""
    dtype = model.cfg.dtype
    cache = model.cache_from_prefill([(k[None].astype(dtype), v[None].astype(dtype)) for k, v in kv],
                                     n + len(next_tokens))
    logits = []
    for i, tok in enumerate(next_tokens):
        step_logits, cache = model.decode_step(cache, jnp.array([tok]), jnp.array([n + i]))
        logits.append(np.asarray(step_logits[0], np.float64))
    return np.stack(logits)


def kl_and_top1(ref_logits, logits):
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))
    return kl, float(np.mean(ref_logits.argmax(-1) == logits.argmax(-1)))


def _row(spec, cr, kl, top1, **extra):
    return {"spec": spec, **{f"cr_nb{nb}": (round(cr, 3) if nb == 256 else "") for nb in BLOCK_SIZES},
            "rel_err_k": "", "rel_err_v": "", "kl": round(kl, 6), "top1_agree": round(top1, 3),
            "encode_MBps": "", "decode_MBps": "", **extra}


def layer_sensitivity(model, kv16, next_tokens, n, ref_logits, raw_bytes, group=5):
    """KIVI-2 g128 (Hadamard, zstdh3) on one group of layers at a time, the rest unquantized."""
    rows, n_layers, h = [], len(kv16), kv16[0][0].shape[0]
    for first in range(0, n_layers, group):
        table = ".".join(("2" if first <= layer < first + group else "f") * h for layer in range(n_layers))
        pipe = Pipeline(PipelineSpec.parse(f"hadamard+mixed-{table}-g128+zstdh3"))
        encoded = encode_all(pipe, kv16, 256)
        cr = raw_bytes / sum(len(b) for blocks in encoded for b in blocks)
        kl, top1 = kl_and_top1(ref_logits, teacher_forced_logits(model, decode_all(encoded), next_tokens, n))
        rows.append(_row(f"hadamard+kivi2g128+zstdh3 on layers {first}-{first + group - 1} only", cr, kl, top1))
        print(rows[-1], flush=True)
    return rows


def streaming_rows(model, prompt, kv16, next_tokens, n, ref_logits, raw_bytes):
    """Streaming-head pruning (sink 16 + recent 64) alone and with KIVI-3, per-head masked decode."""
    from jkv.compression.streaming import (MaskedDecoder, StreamingPlan, decode_request, encode_request,
                                           request_bytes)

    scores = observation_scores(model, prompt, kv16, window=32, sink=16, recent=64)
    rows = []
    for fraction in (0.25, 0.5, 0.75):
        plan = StreamingPlan.from_scores(scores, fraction, sink=16, recent=64)
        for sid in ("identity+none+none", "hadamard+kivi3g128+zstdh3"):
            blobs = encode_request(Pipeline(PipelineSpec.parse(sid)), plan, kv16, 256)
            kv, keep = decode_request(blobs)
            dec = MaskedDecoder(model, kv, keep, len(next_tokens))
            logits = np.stack([dec.step(t) for t in next_tokens]).astype(np.float64)
            kl, top1 = kl_and_top1(ref_logits, logits)
            rows.append(_row(f"duo{round(100 * fraction)}s16w64:{sid}", raw_bytes / request_bytes(blobs), kl, top1))
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_document_args(ap, tokens=1024, steps=32)
    add_out_arg(ap, RESULTS / "kvserve_real_kv.csv")
    args = ap.parse_args()
    n = args.tokens
    model, ids, kv, prefill_s = document_kv(n, args.steps)
    print(f"prefill {n} tokens: {prefill_s:.1f}s; {model}")
    kv16 = [(np.asarray(k[0], np.float16), np.asarray(v[0], np.float16)) for k, v in kv]
    raw_bytes = sum(k.nbytes + v.nbytes for k, v in kv16)
    next_tokens = ids[n:n + args.steps]
    ref_logits = teacher_forced_logits(model, [(jnp.asarray(k), jnp.asarray(v)) for k, v in kv16], next_tokens, n)

    # MixHQ head scores: the real queries of the prompt's last 32 tokens (observation window);
    # attention mass outside sinks + recent 128 tokens.
    scores = observation_scores(model, ids[:n], kv16, window=32, sink=4, recent=128)
    calib = Calibration(head_scores=scores)

    rows = []
    for sid in SPECS:
        pipe = Pipeline(PipelineSpec.parse(sid), calib)
        crs = {}
        for nb in BLOCK_SIZES:
            encoded = encode_all(pipe, kv16, nb)
            crs[nb] = raw_bytes / sum(len(b) for blocks in encoded for b in blocks)
        encoded = encode_all(pipe, kv16, 256)
        decoded = decode_all(encoded)
        jax.block_until_ready(decoded)
        enc_s = dec_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            encoded = encode_all(pipe, kv16, 256)
            t1 = time.perf_counter()
            decoded = jax.block_until_ready(decode_all(encoded))
            enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, time.perf_counter() - t1)
        err = {}
        for i, name in ((0, "k"), (1, "v")):
            num = sum(float(np.sum((np.asarray(d[i], np.float32) - o[i].astype(np.float32)) ** 2))
                      for d, o in zip(decoded, kv16))
            den = sum(float(np.sum(o[i].astype(np.float32) ** 2)) for o in kv16)
            err[name] = (num / den) ** 0.5
        kl, top1 = kl_and_top1(ref_logits, teacher_forced_logits(model, decoded, next_tokens, n))
        row = {"spec": sid, **{f"cr_nb{nb}": round(crs[nb], 3) for nb in BLOCK_SIZES},
               "rel_err_k": round(err["k"], 5), "rel_err_v": round(err["v"], 5), "kl": round(kl, 6),
               "top1_agree": round(top1, 3), "encode_MBps": round(raw_bytes / enc_s / 1e6, 1),
               "decode_MBps": round(raw_bytes / dec_s / 1e6, 1)}
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    rows += layer_sensitivity(model, kv16, next_tokens, n, ref_logits, raw_bytes)
    rows += streaming_rows(model, ids[:n], kv16, next_tokens, n, ref_logits, raw_bytes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
