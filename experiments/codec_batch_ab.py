"""Prefill-side codec CPU, per chunk vs batched per layer, side by side in one run (issue 22).

A: `kv_transfer.absorb_reference` (one `Pipeline.roundtrip_block` per 128-token chunk, K and V:
a compiled encode and decode each, the path before the batching) and the receiver decoding each
container with `decode_block`. B: `RequestCodec.absorb` (`Pipeline.roundtrip_chunks`: one vmapped
encode and decode per layer and kind) and `apply_frame` (`decode_blocks`). Each round runs A and B
on a fresh copy of the same KV, in alternating order (ABBA...), after one untimed warm-up of each
(compilation); CPU seconds are the process's (`time.process_time`, XLA's threads included). Every
round also checks that A and B wrote the same containers and values.

KV: synthetic, seeded, at SmolLM2-135M's geometry (L=30, H_kv=3, D=64), N tokens in the
smartgen transfer geometry (64 blocks a layer -> 128-token chunks), with per-channel scales over
25x (key-like outliers) and a token trend; the codec's cost depends on the data only through the
lossless codec.

    PYTHONPATH=. python experiments/codec_batch_ab.py --rounds 6
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import RESULTS, add_out_arg, describe_machine, machine_info, write_csv  # noqa: E402

PIPELINES = ("identity+kivi4g32+zstdh3", "hadamard+kivi4g32+zstdh3")


def synthetic_kv(layers: int, heads: int, tokens: int, head_dim: int, seed: int) -> np.ndarray:
    """f32[2, L, H_kv, N, D] with per-channel scales spanning 25x and a smooth token trend."""
    rng = np.random.default_rng(seed)
    shape = (2, layers, heads, tokens, head_dim)
    channel_scale = np.linspace(0.2, 5.0, head_dim)[rng.permutation(head_dim)]
    trend = np.cumsum(rng.standard_normal(shape, np.float32) * 0.1, axis=3)
    return ((rng.standard_normal(shape, np.float32) + trend) * channel_scale).astype(np.float32)


def receive_per_container(header: dict, payload: bytes, kv: np.ndarray) -> None:
    """The receiver before the batching: `decode_block` per container (apply_frame's loop)."""
    from jkv.compression.pipeline import decode_block

    layer, pos = header["layer"], 0
    for start, stop, k_len, v_len in header["chunks"]:
        for i, n in ((0, k_len), (1, v_len)):
            kv[i, layer, :, start:stop] = np.asarray(decode_block(payload[pos:pos + n]), np.float32)
            pos += n


def run_once(codec, spec: str, geometry, kv: np.ndarray, batched: bool) -> dict:
    """Absorb every layer of a copy of kv, then receive every layer's frame: CPU and wall seconds."""
    from jkv.compression.kv_transfer import absorb_reference, apply_frame
    from jkv.framing import unpack

    L = kv.shape[1]
    prefill = kv.copy()
    state = codec.start(spec, geometry)
    c0, w0 = time.process_time(), time.perf_counter()
    for layer in range(L):
        if batched:
            state.absorb(layer, prefill[:, layer])
        else:
            absorb_reference(state, layer, prefill[:, layer])
    c1, w1 = time.process_time(), time.perf_counter()
    frames = [unpack(state.frame("ab", layer, range(state.chunks.num_chunks))) for layer in range(L)]
    pool = np.zeros_like(kv)
    mask = np.zeros(kv.shape[1:2] + kv.shape[3:4], np.int8)
    c2, w2 = time.process_time(), time.perf_counter()
    for header, payload in frames:
        if batched:
            apply_frame(header, payload, pool, mask)
        else:
            receive_per_container(header, bytes(payload), pool)
    c3, w3 = time.process_time(), time.perf_counter()
    return dict(absorb_cpu_s=c1 - c0, absorb_wall_s=w1 - w0, receive_cpu_s=c3 - c2, receive_wall_s=w3 - w2,
                containers=[state._containers[key] for key in sorted(state._containers)], prefill=prefill, pool=pool)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=64, help="transfer blocks a layer (smartgen: 64)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap, RESULTS / "codec_batch_ab.csv")
    args = ap.parse_args()

    from jkv.compression.kv_transfer import KVCodec
    from jkv.kvbuffers.geometry import BlockGeometry

    kv = synthetic_kv(args.layers, args.heads, args.tokens, args.head_dim, args.seed)
    geometry = BlockGeometry(args.tokens, args.layers, args.blocks)
    codec = KVCodec(min_chunk_tokens=128)
    mb = kv.nbytes / 1e6
    info = machine_info()
    print(f"{describe_machine(info)}; KV f32[2, {args.layers}, {args.heads}, {args.tokens}, {args.head_dim}] "
          f"= {mb:.1f} MB", flush=True)
    rows = []
    for spec in args.pipelines.split(","):
        for batched in (False, True):  # warm-up: compile both paths' shapes
            run_once(codec, spec, geometry, kv[:, :1], batched)
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            results = {}
            for batched in order:
                load = machine_info()["loadavg_1m"]
                results[batched] = res = run_once(codec, spec, geometry, kv, batched)
                rows.append(dict(pipeline=spec, round=r, impl="batched" if batched else "per_chunk",
                                 absorb_cpu_s=round(res["absorb_cpu_s"], 4), absorb_wall_s=round(res["absorb_wall_s"], 4),
                                 receive_cpu_s=round(res["receive_cpu_s"], 4), receive_wall_s=round(res["receive_wall_s"], 4),
                                 absorb_MBps_cpu=round(mb / res["absorb_cpu_s"], 1), loadavg_1m=load,
                                 layers=args.layers, heads=args.heads, tokens=args.tokens, head_dim=args.head_dim,
                                 cpu_model=info["cpu_model"], cores=info["cores"]))
            old, new = results[False], results[True]
            if old["containers"] != new["containers"] or not np.array_equal(old["prefill"], new["prefill"]) \
                    or not np.array_equal(old["pool"], new["pool"]) or not np.array_equal(new["pool"], new["prefill"]):
                raise SystemExit(f"{spec}: the batched path wrote different containers or values than the per-chunk one")
            print(f"{spec} round {r}: absorb CPU {old['absorb_cpu_s']:.3f} -> {new['absorb_cpu_s']:.3f} s, "
                  f"receive CPU {old['receive_cpu_s']:.3f} -> {new['receive_cpu_s']:.3f} s "
                  f"(load {rows[-1]['loadavg_1m']})", flush=True)
        for what in ("absorb", "receive"):
            med = {impl: statistics.median(row[f"{what}_cpu_s"] for row in rows
                                           if row["pipeline"] == spec and row["impl"] == impl)
                   for impl in ("per_chunk", "batched")}
            print(f"{spec} {what}: median CPU per_chunk {med['per_chunk']:.3f} s, batched {med['batched']:.3f} s "
                  f"({med['per_chunk'] / med['batched']:.2f}x; {mb / med['per_chunk']:.0f} -> "
                  f"{mb / med['batched']:.0f} MB/s float32)", flush=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}; {describe_machine(machine_info())}")


if __name__ == "__main__":
    main()
