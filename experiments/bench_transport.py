"""Transport benchmark: jkv transport vs raw sockets, measured side by side in one run.

Two OS processes on loopback (the receiver is a child process):

* throughput of one-sided writes for 64 KiB, 1 MiB and 16 MiB blocks, tcp and shm backends
  (and tcp with ``payload_checksum=False``, to separate framing cost from checksum cost),
  vs a raw-socket baseline (``sendall`` of the block / ``recv_into`` the same rotating slots of a
  16 MiB region as the transport's writes, no framing, no checksum) — ratio goal >= 0.85x for blocks >= 1 MiB, with the checksum on
  (its XXH3-64 rides in a trailer, computed on side threads with >= 4 cores, transport/checksum.py,
  else on the socket threads); 64 KiB
  blocks also batched 32 per ``write_many`` (how a layer's blocks are pushed);
* RPC latency p50/p99 for 64 KiB replies (the decode worker's remote-row fetch);
* pacing accuracy: achieved / target over ~1 s at 100 Mbit/s, 1 Gbit/s, 2 Gbit/s.

Receivers stay up for the whole run; each round measures raw and then every transport
configuration back to back, and the reported ratio is the median over rounds of
transport / raw-of-the-same-round (with its interquartile range), so background load on
a shared machine hits both sides alike. Prints a table with ratios and writes
``experiments/results/bench_transport.csv``.

Next to each ratio: CPU seconds per GiB moved (sender process + receiver process, user + system),
the transport's over raw's — on a loaded machine wall-clock rates swing with the load while CPU per
byte stays comparable, so it says whether the checksum and framing cost CPU or only wait.

The first line printed (and every CSV row) records the CPU model and the load average: on a
shared machine the ratios are what to compare, and a high load average says how far to trust them.

    python experiments/bench_transport.py [--quick]
    python experiments/bench_transport.py --blocks 1m,16m --configs tcp,tcp-nocrc --skip-rpc-pacing  # integrity check
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Idle OpenBLAS worker threads spin: a perf profile of this benchmark on 2 cores found them in
# ~5% of all samples, CPU taken from the socket threads of both sides. Nothing here does BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transport import Endpoint  # noqa: E402
from transport.tool import read_request  # noqa: E402

from experiments.common import RESULTS, add_out_arg, describe_machine, machine_info, write_csv  # noqa: E402

SECRET = "bench-secret-123"
KiB, MiB = 1 << 10, 1 << 20


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of process ``pid`` so far (Linux /proc), every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(run, child_pid: int, nbytes: int) -> tuple[float, float]:
    """(bits/s that ``run`` returns, CPU seconds per GiB of this process + the receiver child)."""
    cpu0 = time.process_time() + _cpu_s(child_pid)
    bps = run()
    return bps, (time.process_time() + _cpu_s(child_pid) - cpu0) / (nbytes / (1 << 30))


# ------------------------------------------------------------------ raw-socket baseline
def region_bytes(block: int) -> int:
    """The receiving region of a run, the same for raw and jkv: blocks land at rotating offsets."""
    return max(block, 16 * MiB)


def _raw_receiver(port_q, block: int, total: int) -> None:
    """Accept one connection per round; receive ``total`` bytes in ``block`` pieces; ack.

    Each block lands at the next slot of a ``region_bytes(block)`` buffer, as the transport's
    writes do: receiving every block into one block-sized buffer would keep a 1 MiB destination
    hot in cache, a copy the transport (and any real receiver of KV) does not get to make."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port_q.put(srv.getsockname()[1])
    region = memoryview(bytearray(region_bytes(block)))
    slots = len(region) // block
    while True:
        conn, _ = srv.accept()
        got = 0
        while got < total:
            pos = 0
            buf = region[(got // block) % slots * block:][:block]
            while pos < block:
                n = conn.recv_into(buf[pos:])
                if n == 0:
                    conn.close()
                    srv.close()
                    return  # an empty connection ends the receiver
                pos += n
            got += block
        conn.sendall(b"k")
        conn.close()


class RawSink:
    def __init__(self, block: int, total: int):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_raw_receiver, args=(q, block, total))
        self.proc.start()
        self.port = q.get(timeout=60)
        self.block, self.total = block, total
        self.data = memoryview(np.random.default_rng(0).bytes(block))

    def run(self) -> float:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for _ in range(self.total // self.block):
            sock.sendall(self.data)
        assert sock.recv(1) == b"k"
        seconds = time.perf_counter() - t0
        sock.close()
        return 8 * self.total / seconds

    def close(self):
        socket.create_connection(("127.0.0.1", self.port)).close()
        self.proc.join(10)


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


class TransportSink:
    """A receiver process and a connected endpoint; ``run`` pushes ``total`` bytes."""

    def __init__(self, backend: str, block: int, total: int, *, window: int = 8,
                 batch: int = 1, checksum: bool = True, streams: int = 1):
        self.child = Child(backend, region_bytes(block), checksum)
        self.ep = Endpoint("bench", backend, secret=SECRET, payload_checksum=checksum)
        self.peer = self.ep.connect(self.child.address, streams=streams)
        self.slots = self.peer.regions()["pool"].nbytes // block
        self.block, self.total, self.window, self.batch = block, total, window, batch
        self.data = np.frombuffer(np.random.default_rng(0).bytes(block), np.uint8)

    def run(self) -> float:
        n = self.total // self.block // self.batch * self.batch
        inflight = []
        t0 = time.perf_counter()
        for i in range(0, n, self.batch):
            inflight.append(self.peer.write_many(
                [("pool", ((i + j) % self.slots) * self.block, self.data) for j in range(self.batch)]))
            if len(inflight) >= self.window:
                inflight.pop(0).wait(60)
        for t in inflight:
            t.wait(60)
        return 8 * n * self.block / (time.perf_counter() - t0)

    def close(self):
        self.ep.close()
        self.child.stop()


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
        # `total` bytes as writes of at most one block each (the last one shorter)
        items = [("pool", 0, block[:min(block.nbytes, total - start)])
                 for start in range(0, total, block.nbytes)]
        t = peer.write_many(items)
        t.wait(seconds * 4 + 10)
        return target, 8 * total / t.elapsed
    finally:
        ep.close()
        child.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller transfers (smoke run)")
    ap.add_argument("--repeats", type=int, default=9, help="measurement rounds per block size")
    ap.add_argument("--blocks", default="64k,1m,16m", help="subset of 64k,1m,16m")
    ap.add_argument("--configs", default=None,
                    help="subset of tcp,shm,tcp-nocrc,tcp-3streams,tcp+wm32,shm+wm32 (default: all that apply)")
    ap.add_argument("--skip-rpc-pacing", action="store_true")
    add_out_arg(ap, RESULTS / "bench_transport.csv")
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    rows = []
    info = machine_info()
    print(describe_machine(info), flush=True)
    print(f"{'backend':10} {'block':>8} {'raw Gbit/s':>11} {'jkv Gbit/s':>11} {'ratio':>6}")
    sizes = {"64k": (64 * KiB, 64 * MiB), "1m": (1 * MiB, 256 * MiB), "16m": (16 * MiB, 512 * MiB)}
    for key in args.blocks.split(","):
        block, total = sizes[key]
        total = max(block * 8, int(total * scale) // block * block)
        configs = {"tcp": dict(backend="tcp"), "shm": dict(backend="shm"),
                   "tcp-nocrc": dict(backend="tcp", checksum=False)}
        if block >= MiB:  # more streams: more threads (cores) move and checksum bytes
            configs["tcp-3streams"] = dict(backend="tcp", streams=3)
        if block < MiB:  # a layer's small blocks go out 32 per write_many
            configs["tcp+wm32"] = dict(backend="tcp", batch=32, window=4)
            configs["shm+wm32"] = dict(backend="shm", batch=32, window=4)
        if args.configs:
            wanted = set(args.configs.split(","))
            unknown = wanted - {"tcp", "shm", "tcp-nocrc", "tcp-3streams", "tcp+wm32", "shm+wm32"}
            if unknown:
                ap.error(f"--configs {sorted(unknown)} unknown")
            configs = {k: v for k, v in configs.items() if k in wanted}
        raw_sink = RawSink(block, total)
        sinks = {name: TransportSink(block=block, total=total, **cfg) for name, cfg in configs.items()}
        raws, results = [], {name: [] for name in sinks}
        raw_cpu, cpu = [], {name: [] for name in sinks}
        try:
            names = list(sinks)
            for rnd in range(args.repeats):  # each round: raw, then every config right after it
                bps, c = measured(raw_sink.run, raw_sink.proc.pid, total)
                raws.append(bps)
                raw_cpu.append(c)
                # the configs' order rotates between rounds: none is always the one right after raw
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    sink = sinks[name]
                    bps, c = measured(sink.run, sink.child.proc.pid, total // block // sink.batch * sink.batch * block)
                    results[name].append(bps)
                    cpu[name].append(c)
        finally:
            raw_sink.close()
            for sink in sinks.values():
                sink.close()
        raw = statistics.median(raws)
        for name, values in results.items():
            ratios = sorted(x / r for x, r in zip(values, raws))
            ratio = statistics.median(ratios)
            q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
            v = statistics.median(values)
            cpu_raw, cpu_jkv = statistics.median(raw_cpu), statistics.median(cpu[name])
            print(f"{name:10} {block // KiB:>6}Ki {raw / 1e9:11.2f} {v / 1e9:11.2f} {ratio:6.2f}"
                  f"   (ratio IQR {q1:.2f}-{q3:.2f}, {len(ratios)} rounds)"
                  f"   CPU s/GiB raw {cpu_raw:.2f} jkv {cpu_jkv:.2f} ({cpu_jkv / cpu_raw:.2f}x)", flush=True)
            rows.append(dict(metric="throughput", config=name, block_bytes=block,
                             raw_bps=raw, jkv_bps=v, ratio=ratio, ratio_q1=q1, ratio_q3=q3,
                             rounds=len(ratios), total_bytes=total, raw_cpu_s_per_gib=cpu_raw,
                             jkv_cpu_s_per_gib=cpu_jkv))
    for backend in () if args.skip_rpc_pacing else ("tcp", "shm"):
        p50, p99 = rpc_latency(backend, 64 * KiB, int(2000 * scale))
        print(f"rpc 64KiB reply {backend}: p50 {p50:.0f} us  p99 {p99:.0f} us")
        rows.append(dict(metric="rpc_latency_us", config=backend, block_bytes=64 * KiB,
                         p50_us=p50, p99_us=p99))
    for rate in () if args.skip_rpc_pacing else ("100mbit", "1gbit", "2gbit"):
        target, achieved = paced_rate(rate, 1.0)
        print(f"pacing {rate:>8}: achieved {achieved / 1e6:8.1f} Mbit/s = {achieved / target:.3f} x target")
        rows.append(dict(metric="pacing", config="tcp", target_bps=target, jkv_bps=achieved,
                         ratio=achieved / target))
    end = machine_info()
    print(f"after the run: {describe_machine(end)}")
    rows = [dict(r, cpu_model=info["cpu_model"], cpu_count=info["cores"], loadavg_start=info["loadavg_1m"],
                 loadavg_end=end["loadavg_1m"]) for r in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out, rows, fields=sorted({k for r in rows for k in r}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
