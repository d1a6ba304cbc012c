"""Transport benchmark: jkv transport vs raw sockets, measured side by side in one run.

Two OS processes on loopback (the receiver is a child process):

* throughput of one-sided writes for 64 KiB, 1 MiB and 16 MiB blocks, tcp and shm backends
  (and tcp with ``payload_checksum=False``, to separate framing cost from checksum cost),
  vs a raw-socket baseline (``sendall`` of the block / ``recv_into`` a preallocated buffer,
  no framing, no checksum) — ratio goal >= 0.85x for blocks >= 1 MiB; 64 KiB blocks also
  batched 32 per ``write_many`` (how a layer's blocks are pushed);
* RPC latency p50/p99 for 64 KiB replies (the decode worker's remote-row fetch);
* pacing accuracy: achieved / target over ~1 s at 100 Mbit/s, 1 Gbit/s, 2 Gbit/s.

Each throughput point alternates raw and transport runs ``--repeats`` times and reports
medians, so background load hits both sides alike. Prints a table with ratios and writes
``experiments/results/bench_transport.csv``.

    python experiments/bench_transport.py [--quick]
"""
from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transport import Endpoint  # noqa: E402
from transport.tool import read_request  # noqa: E402

SECRET = "bench-secret-123"
KiB, MiB = 1 << 10, 1 << 20


# ------------------------------------------------------------------ raw-socket baseline
def _raw_receiver(port_q, block: int, total: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(block))
    got = 0
    while got < total:
        pos = 0
        while pos < block:
            n = conn.recv_into(buf[pos:])
            if n == 0:
                return
            pos += n
        got += block
    conn.sendall(b"k")
    conn.close()
    srv.close()


def raw_throughput(block: int, total: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_raw_receiver, args=(q, block, total))
    proc.start()
    port = q.get(timeout=30)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(np.random.default_rng(0).bytes(block))
    t0 = time.perf_counter()
    for _ in range(total // block):
        sock.sendall(data)
    assert sock.recv(1) == b"k"
    seconds = time.perf_counter() - t0
    sock.close()
    proc.join(10)
    return 8 * total / seconds


# ------------------------------------------------------------------ transport
class Child:
    def __init__(self, backend: str, region_bytes: int, checksum: bool = True):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transport.tool", "serve", "--backend", backend, "--secret",
             SECRET, "--name", "sink", "--region", f"pool:{region_bytes}",
             *([] if checksum else ["--no-payload-checksum"])],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def stop(self):
        self.proc.stdin.close()
        self.proc.wait(10)


def transport_throughput(backend: str, block: int, total: int, window: int = 8,
                         batch: int = 1, checksum: bool = True) -> float:
    """Writes of ``block`` bytes, ``batch`` blocks per ``write_many``, ``window`` in flight."""
    child = Child(backend, max(block, 16 * MiB), checksum)
    ep = Endpoint("bench", backend, secret=SECRET, payload_checksum=checksum)
    try:
        peer = ep.connect(child.address)
        pool = peer.regions()["pool"].nbytes
        data = np.frombuffer(np.random.default_rng(0).bytes(block), np.uint8)
        n = total // block // batch * batch
        slots = pool // block
        inflight = []
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            inflight.append(peer.write_many([("pool", ((i + j) % slots) * block, data)
                                             for j in range(batch)]))
            if len(inflight) >= window:
                inflight.pop(0).wait(60)
        for t in inflight:
            t.wait(60)
        seconds = time.perf_counter() - t0
        return 8 * n * block / seconds
    finally:
        ep.close()
        child.stop()


def rpc_latency(backend: str, reply_bytes: int, calls: int) -> tuple[float, float]:
    child = Child(backend, 16 * MiB)
    ep = Endpoint("bench", backend, secret=SECRET)
    try:
        peer = ep.connect(child.address)
        into = np.empty(reply_bytes, np.uint8)
        req = read_request("pool", 4096, reply_bytes)
        for _ in range(20):
            peer.call("read", req, into=into)
        lat = []
        for _ in range(calls):
            t0 = time.perf_counter()
            peer.call("read", req, into=into)
            lat.append(time.perf_counter() - t0)
        q = np.percentile(lat, [50, 99])
        return float(q[0]) * 1e6, float(q[1]) * 1e6
    finally:
        ep.close()
        child.stop()


def paced_rate(rate: str, seconds: float) -> tuple[float, float]:
    from transport import parse_bandwidth
    target = parse_bandwidth(rate)
    child = Child("tcp", 16 * MiB)
    ep = Endpoint("bench", "tcp", secret=SECRET)
    try:
        peer = ep.connect(child.address, bandwidth=rate)
        block = np.ones(4 * MiB, np.uint8)
        total = int(target / 8 * seconds)
        items, left = [], total
        while left:
            k = min(left, block.nbytes)
            items.append(("pool", 0, block[:k]))
            left -= k
        t = peer.write_many(items)
        t.wait(seconds * 4 + 10)
        return target, 8 * total / t.elapsed
    finally:
        ep.close()
        child.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller transfers (smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", default="64k,1m,16m", help="subset of 64k,1m,16m")
    ap.add_argument("--skip-rpc-pacing", action="store_true")
    ap.add_argument("--out", default=str(REPO / "experiments/results/bench_transport.csv"))
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    rows = []
    print(f"{'backend':10} {'block':>8} {'raw Gbit/s':>11} {'jkv Gbit/s':>11} {'ratio':>6}")
    sizes = {"64k": (64 * KiB, 128 * MiB), "1m": (1 * MiB, 512 * MiB), "16m": (16 * MiB, 1024 * MiB)}
    for key in args.blocks.split(","):
        block, total = sizes[key]
        total = max(block * 8, int(total * scale) // block * block)
        raws, jkv = [], {"tcp": [], "shm": [], "tcp-nocrc": []}
        for _ in range(args.repeats):  # raw and jkv back to back, so load drifts hit both
            raws.append(raw_throughput(block, total))
            for backend in jkv:
                jkv[backend].append(transport_throughput(
                    backend.split("-")[0], block, total, checksum="nocrc" not in backend))
            print(f"  repeat {block // KiB}Ki: raw {raws[-1] / 1e9:.2f}  "
                  + "  ".join(f"{b} {v[-1] / 1e9:.2f}" for b, v in jkv.items()), flush=True)
        batched = {"tcp": [], "shm": []} if block < MiB else {}
        for _ in range(args.repeats if batched else 0):
            for backend in batched:
                batched[backend].append(transport_throughput(backend, block, total, window=4, batch=32))
        raw = statistics.median(raws)
        for label, results, batch in (("", jkv, 1), ("+wm32", batched, 32)):
            for backend, values in results.items():
                v = statistics.median(values)
                # ratio: median over repeats of jkv / the raw run measured right before it
                ratio = statistics.median(x / r for x, r in zip(values, raws))
                name = backend + label
                print(f"{name:10} {block // KiB:>6}Ki {raw / 1e9:11.2f} {v / 1e9:11.2f} {ratio:6.2f}")
                rows.append(dict(metric="throughput", backend=backend, block_bytes=block,
                                 blocks_per_op=batch, raw_bps=raw, jkv_bps=v, ratio=ratio,
                                 total_bytes=total))
    for backend in () if args.skip_rpc_pacing else ("tcp", "shm"):
        p50, p99 = rpc_latency(backend, 64 * KiB, int(2000 * scale))
        print(f"rpc 64KiB reply {backend}: p50 {p50:.0f} us  p99 {p99:.0f} us")
        rows.append(dict(metric="rpc_latency_us", backend=backend, block_bytes=64 * KiB,
                         p50_us=p50, p99_us=p99))
    for rate in () if args.skip_rpc_pacing else ("100mbit", "1gbit", "2gbit"):
        target, achieved = paced_rate(rate, 1.0)
        print(f"pacing {rate:>8}: achieved {achieved / 1e6:8.1f} Mbit/s = {achieved / target:.3f} x target")
        rows.append(dict(metric="pacing", backend="tcp", target_bps=target, jkv_bps=achieved,
                         ratio=achieved / target))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in rows for k in r})
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
