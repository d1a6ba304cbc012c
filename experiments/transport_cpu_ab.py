"""Where tcp's CPU goes, old code vs new side by side: per-thread CPU seconds and context switches
per MiB moved, and (``--count``) the socket calls of each connection, for raw sockets and jkv tcp
writes from two source trees in alternated rounds.

Every configuration is a pair of processes (sender, receiver) that import ``transport`` from the
tree it names — ``new`` (this checkout) or ``old`` (``--old REF``, exported with ``git archive``
into a temporary directory) — so both versions run in one session under the same load. The
driver imports no transport code: it starts the pairs, asks each sender to push ``--total`` MiB
of ``--block`` MiB writes (8 in flight, rotating slots of a 16 MiB region, as
bench_transport.py), and reads ``/proc/<pid>/task/*/{stat,status}`` of both processes before and
after each run. Threads are named by the workers (``tx:`` sender process, ``rx:`` receiver).
``--count`` wraps each connection's socket to histogram the sizes that ``sendmsg`` /
``recv_into`` / ``recvmsg_into`` / ``send`` / ``sendall`` moved (a Python call per syscall: leave it
off for the CPU figures). Numbers and their reading: docs/transport.md ("Benchmark").

    python experiments/transport_cpu_ab.py --block 1 --rounds 9 --configs raw,old:tcp,new:tcp,new:tcp-nocrc
    python experiments/transport_cpu_ab.py --block 16 --old main --count
"""
from __future__ import annotations
import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TCK = os.sysconf("SC_CLK_TCK")
SECRET = "bench-secret-123"


# ------------------------------------------------------------------ in the worker processes
class CountingSock:
    """A connection's socket that counts the bytes each send/recv call moved, by size."""

    def __init__(self, s):
        self._s = s
        self.sizes = collections.defaultdict(collections.Counter)

    def recv_into(self, buf, n=0, *a):
        k = self._s.recv_into(buf, n, *a)
        self.sizes["recv_into"][k] += 1
        return k

    def recvmsg_into(self, bufs, *a):
        r = self._s.recvmsg_into(bufs, *a)
        self.sizes["recvmsg_into"][r[0]] += 1
        return r

    def sendmsg(self, bufs, *a):
        k = self._s.sendmsg(bufs, *a)
        self.sizes["sendmsg"][k] += 1
        return k

    def send(self, b, *a):
        k = self._s.send(b, *a)
        self.sizes["send"][k] += 1
        return k

    def sendall(self, b, *a):
        self.sizes["sendall"][len(b)] += 1
        return self._s.sendall(b, *a)

    def __getattr__(self, name):
        return getattr(self._s, name)


SOCKS = []


def patch_counting():
    from transport import connection
    orig = connection.Connection.__init__

    def init(self, host, sock, *a, **k):
        cs = CountingSock(sock)
        SOCKS.append(cs)
        orig(self, host, cs, *a, **k)
    connection.Connection.__init__ = init


def socks_stats():
    out = collections.defaultdict(collections.Counter)
    for cs in SOCKS:
        for k, c in cs.sizes.items():
            out[k].update(c)
        cs.sizes.clear()
    return {k: dict(v) for k, v in out.items()}


def serve_commands(handlers):
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "threads":
            out = {t.native_id: t.name for t in threading.enumerate()}
        elif cmd == "socks":
            out = socks_stats()
        else:
            out = handlers[cmd](*args)
        print(json.dumps(out), flush=True)


def worker(role, kind, checksum, block):
    """One side of a pair: ``rx`` (receiver) or ``tx`` (sender) of ``raw`` sockets or ``jkv`` tcp;
    answers the driver's commands (``run N``, ``threads``, ``socks``) on stdin/stdout."""
    block = int(block)
    if os.environ.get("COUNT") and kind == "jkv":
        patch_counting()
    import numpy as np
    if role == "rx" and kind == "raw":
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(4)
        print(json.dumps({"address": srv.getsockname()[1], "pid": os.getpid()}), flush=True)
        region = memoryview(bytearray(max(block, 16 * MiB)))
        slots = len(region) // block
        while True:  # the bench's _raw_receiver loop
            conn, _ = srv.accept()
            hdr = conn.recv(16)
            if not hdr:
                return
            total = int(hdr.decode())
            got = 0
            while got < total:
                pos = 0
                buf = region[(got // block) % slots * block:][:block]
                while pos < block:
                    pos += conn.recv_into(buf[pos:])
                got += block
            conn.sendall(b"k")
            conn.close()
    if role == "rx":
        from transport import Endpoint
        from transport.region import aligned_empty
        ep = Endpoint("sink", "tcp", secret=SECRET, payload_checksum=checksum == "1")
        ep.register("pool", aligned_empty(max(block, 16 * MiB)))
        print(json.dumps({"address": ep.listen(), "pid": os.getpid()}), flush=True)
        serve_commands({})
        ep.close()
        return
    data = np.frombuffer(np.random.default_rng(0).bytes(block), np.uint8)
    address = json.loads(sys.stdin.readline())
    if kind == "raw":
        def run(total):
            total = int(total)
            sock = socket.create_connection(("127.0.0.1", address))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"%-16d" % total)
            t0 = time.perf_counter()
            for _ in range(total // block):
                sock.sendall(data)
            assert sock.recv(1) == b"k"
            s = time.perf_counter() - t0
            sock.close()
            return 8 * total / s
        print(json.dumps({"pid": os.getpid()}), flush=True)
        serve_commands({"run": run})
        return
    from transport import Endpoint
    ep = Endpoint("bench", "tcp", secret=SECRET, payload_checksum=checksum == "1")
    peer = ep.connect(address)
    slots = max(block, 16 * MiB) // block

    def run(total, window=8):
        n = int(total) // block
        inflight = []
        t0 = time.perf_counter()
        for i in range(n):
            inflight.append(peer.write("pool", (i % slots) * block, data))
            if len(inflight) >= window:
                inflight.pop(0).wait(60)
        for t in inflight:
            t.wait(60)
        return 8 * n * block / (time.perf_counter() - t0)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    serve_commands({"run": run})
    ep.close()


# ------------------------------------------------------------------ driver
class Pair:
    """A sender and a receiver process importing ``transport`` from ``tree``."""

    def __init__(self, name, tree, kind, checksum, block):
        env = dict(os.environ, PYTHONPATH=tree)
        args = [sys.executable, __file__, "worker"]
        self.name = name
        self.rx = subprocess.Popen(args + ["rx", kind, str(int(checksum)), str(block)], cwd=tree, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.rx.stdout.readline())
        self.tx = subprocess.Popen(args + ["tx", kind, str(int(checksum)), str(block)], cwd=tree, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.tx.stdin.write(json.dumps(info["address"]) + "\n"); self.tx.stdin.flush()
        self.txpid = json.loads(self.tx.stdout.readline())["pid"]
        self.rxpid = info["pid"]
        self.port = info["address"]
        self.kind = kind

    @staticmethod
    def ask(p, cmd):
        p.stdin.write(cmd + "\n"); p.stdin.flush()
        return json.loads(p.stdout.readline())

    def names(self):
        if self.kind == "raw":
            return {}
        return {**{int(k): "rx:" + v for k, v in self.ask(self.rx, "threads").items()},
                **{int(k): "tx:" + v for k, v in self.ask(self.tx, "threads").items()}}

    def close(self):
        if self.kind == "raw":
            self.tx.stdin.close(); self.tx.wait(10)
            socket.create_connection(("127.0.0.1", self.port)).close()  # an empty connection ends it
            self.rx.wait(10)
        else:
            self.tx.stdin.close(); self.tx.wait(10)
            self.rx.stdin.close(); self.rx.wait(10)


def thread_stats(pid):
    """{tid: (user s, system s, voluntary switches, involuntary switches)} of every thread."""
    out = {}
    for d in Path(f"/proc/{pid}/task").iterdir():
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            st = (d / "status").read_text()
        except OSError:
            continue
        vol = int(st.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        nonvol = int(st.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[int(d.name)] = (int(f[11]) / TCK, int(f[12]) / TCK, vol, nonvol)
    return out


def export_tree(ref: str, into: str) -> str:
    """``transport/`` of git ``ref`` under ``into`` (what PYTHONPATH=into imports)."""
    archive = subprocess.run(["git", "archive", ref, "transport"], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=float, default=1, help="MiB per write")
    ap.add_argument("--total", type=int, default=512, help="MiB per run")
    ap.add_argument("--rounds", type=int, default=9, help="alternated rounds over the configs")
    ap.add_argument("--configs", default="raw,old:tcp,old:tcp-nocrc,new:tcp,new:tcp-nocrc",
                    help="raw, or TREE:tcp / TREE:tcp-nocrc with TREE old, new or a directory "
                         "holding a transport/ package")
    ap.add_argument("--old", default="main", help="git ref of the old tree")
    ap.add_argument("--count", action="store_true", help="histogram socket call sizes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="jkv-ab-") as tmp:
        trees = {"new": str(REPO), "old": str(REPO)}
        if any(c.startswith("old:") for c in args.configs.split(",")):
            trees["old"] = export_tree(args.old, tmp)
        run_ab(args, trees)


def run_ab(args, trees: dict) -> None:
    if args.count:
        os.environ["COUNT"] = "1"
    block, total = int(args.block * MiB), args.total * MiB
    print(f"load average {os.getloadavg()}; {block} B writes, {total} B per run, {args.rounds} rounds", flush=True)
    pairs = {}
    for c in args.configs.split(","):
        if c == "raw":
            pairs[c] = Pair(c, trees["new"], "raw", False, block)
        else:
            tree, cfg = c.split(":")
            pairs[c] = Pair(c, trees.get(tree, tree), "jkv", cfg == "tcp", block)
    acc = {c: collections.defaultdict(lambda: [0.0, 0.0, 0, 0]) for c in pairs}
    bps = collections.defaultdict(list)
    tot_cpu = collections.defaultdict(list)
    socks = {}
    try:
        for r in range(args.rounds):
            for c, p in pairs.items():
                if args.count and p.kind == "jkv":
                    p.ask(p.tx, "socks"); p.ask(p.rx, "socks")
                a0, b0 = thread_stats(p.txpid), thread_stats(p.rxpid)
                bps[c].append(p.ask(p.tx, f"run {total}"))
                a1, b1 = thread_stats(p.txpid), thread_stats(p.rxpid)
                names = p.names()
                cpu = 0.0
                for pfx, x0, x1 in (("tx", a0, a1), ("rx", b0, b1)):
                    for tid, v in x1.items():
                        d = [y - x for x, y in zip(x0.get(tid, (0, 0, 0, 0)), v)]
                        cpu += d[0] + d[1]
                        name = names.get(tid, f"{pfx}:{'main' if tid in (p.txpid, p.rxpid) else tid}")
                        for i in range(4):
                            acc[c][name][i] += d[i]
                tot_cpu[c].append(cpu / (total / (1 << 30)))
                if args.count and p.kind == "jkv":
                    socks[c] = {"tx": p.ask(p.tx, "socks"), "rx": p.ask(p.rx, "socks")}
    finally:
        for p in pairs.values():
            p.close()
    gib = args.rounds * total / (1 << 30)
    mib = args.rounds * total / MiB
    print(f"load average after: {os.getloadavg()}")
    raw = bps.get("raw")
    for c in pairs:
        ratio = f" ratio/raw median {statistics.median(x / y for x, y in zip(bps[c], raw)):.2f}" if raw else ""
        print(f"== {c}: Gbit/s {[round(x / 1e9, 2) for x in bps[c]]}{ratio}  CPU s/GiB both procs "
              f"median {statistics.median(tot_cpu[c]):.3f} {[round(x, 3) for x in tot_cpu[c]]}")
        for name, v in sorted(acc[c].items()):
            if v[0] + v[1] < 0.005 * args.rounds:
                continue
            print(f"   {name:34} user {v[0] / gib:.3f} sys {v[1] / gib:.3f} s/GiB  "
                  f"ctxsw/MiB vol {v[2] / mib:.2f} invol {v[3] / mib:.2f}")
        if c in socks:
            for side in ("tx", "rx"):
                for call, hist in socks[c][side].items():
                    hist = {int(k): v for k, v in hist.items()}
                    n = sum(hist.values())
                    nbytes = sum(k * v for k, v in hist.items())
                    top = sorted(hist.items(), key=lambda kv: -kv[1])[:5]
                    print(f"   {side} {call}: {n / (total / MiB):.2f}/MiB (last round), mean "
                          f"{nbytes / max(n, 1) / 1024:.1f} KiB; most common {top}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(*sys.argv[2:])
    else:
        main()
