"""What a lossy selector-metadata codec would buy before the first token (issue 22, TTST >= 5x).

InfiniGen's metadata (the partial keys, float16 [B, H_kv, N, d_p]) crosses the link before the
first token with only a lossless codec (`zstd1` on byte-shuffled floats, `compression.paths.
pack_metadata`): 23.7 MB of the 75 MB a 4 x 2K smartgen + compression batch moves before TTST. This
probe quantizes each token's partial key per KV head to int8 with a float16 absmax scale (codes and
scales zstd-1 compressed, scales byte-shuffled as pack_metadata does) and measures, on SmolLM2's
real keys of one 2,048-token text:

  bytes     the metadata of layers dense_layers..L-1, f16 + zstd1 vs int8 + scale + zstd1
  overlap   per KV head, |top-20% set with int8 metadata  n  top-20% set with float16| / top-20%,
            InfiniGen's own ranking (`infinigen_rank`), for real decode queries (every 8th of the
            64 tokens that follow the text)

It is a probe, not the codec: nothing here is served, and a selection overlap is not a task score.

    PYTHONPATH=. python experiments/metadata_q8_probe.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import RESULTS, add_model_arg, describe_machine, machine_info, write_csv  # noqa: E402


def shuffled(a):
    """Byte-shuffle (the bytes of equal significance together), as `pack_metadata` does."""
    import numpy as np

    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8).reshape(-1, a.dtype.itemsize).T.copy()


def quantize_rows(meta):
    """f16 [..., d_p] -> (int8 codes, f16 scale [..., 1]): per-row absmax / 127."""
    import numpy as np

    f = meta.astype(np.float32)
    scale = (np.abs(f).max(-1, keepdims=True) / 127.0).astype(np.float16)
    scale = np.where(scale == 0, np.float16(1), scale)
    codes = np.clip(np.round(f / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return codes, scale


def main(argv=None) -> int:
    import jax.numpy as jnp
    import numpy as np
    import zstandard

    from jkv.selection import get_selector
    from jkv.selection.calibration import calibration_tokens, collect_calibration
    from jkv.selection.infinigen import infinigen_rank
    from models import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--out", default=str(RESULTS / "metadata_q8_probe.csv"))
    args = ap.parse_args(argv)

    model = load_model(args.model)
    fit = collect_calibration(model, calibration_tokens(model, 1024 + 192), 1024, 192)  # as `jkv eval`
    sel = get_selector("infinigen", max_ratio=args.ratio, calibration=fit)
    n = args.tokens
    text = collect_calibration(model, calibration_tokens(model, n + 64), n, 64)  # keys [N+64, H_kv, D] a layer
    zc = zstandard.ZstdCompressor(level=1)
    rows = []
    for layer in range(sel.config.dense_layers, model.cfg.num_layers):
        K = jnp.asarray(text.keys[layer][:n].transpose(1, 0, 2)[None])  # [1, H_kv, N, D]
        meta = np.asarray(sel.prepare(layer, K, jnp.asarray([n])))
        codes, scale = quantize_rows(meta)
        deq = (codes.astype(np.float32) * scale.astype(np.float32)).astype(meta.dtype)
        f16_bytes = len(zc.compress(shuffled(meta).tobytes()))
        q8_bytes = len(zc.compress(codes.tobytes())) + len(zc.compress(shuffled(scale).tobytes()))
        k = int(args.ratio * n)
        overlaps = []
        for q in text.queries[layer][::8]:
            q = jnp.asarray(q[None])
            want, _ = infinigen_rank(sel.config, sel.skew[layer], q, jnp.asarray(meta), jnp.asarray([n]))
            got, _ = infinigen_rank(sel.config, sel.skew[layer], q, jnp.asarray(deq), jnp.asarray([n]))
            a, b = np.argsort(-np.asarray(want), -1)[0, :, :k], np.argsort(-np.asarray(got), -1)[0, :, :k]
            overlaps += [len(np.intersect1d(x, y)) / k for x, y in zip(a, b)]
        rows.append(dict(layer=layer, tokens=n, f16_zstd1_bytes=f16_bytes, q8_zstd1_bytes=q8_bytes,
                         overlap_mean=float(np.mean(overlaps)), overlap_min=float(np.min(overlaps)),
                         queries=len(overlaps) // model.cfg.num_kv_heads))
    info = machine_info()
    f16, q8 = sum(r["f16_zstd1_bytes"] for r in rows), sum(r["q8_zstd1_bytes"] for r in rows)
    ov = [r["overlap_mean"] for r in rows]
    print(f"{n}-token text, layers {rows[0]['layer']}-{rows[-1]['layer']}: f16 + zstd1 {f16 / 1e6:.2f} MB, "
          f"int8 + f16 scale + zstd1 {q8 / 1e6:.2f} MB ({f16 / q8:.2f}x fewer bytes); top-{args.ratio:.0%} overlap "
          f"mean {np.mean(ov):.4f}, worst layer mean {min(ov):.4f}, worst head {min(r['overlap_min'] for r in rows):.4f}")
    print(describe_machine(info))
    write_csv(args.out, [dict(r, model=args.model, ratio=args.ratio) for r in rows])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
