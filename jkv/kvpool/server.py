"""The built-in `jkv pool` server: a `HostKVPool` (capacity limit, LRU eviction) behind a
`transport.Endpoint`, so prefill engines on this or other hosts reach it over tcp, shm or rdma.

    jkv pool --capacity 8GiB --secret-env JKV_SECRET [--backend tcp|shm|rdma] [--listen ADDR]
             [--bandwidth 10gbit]

prints one JSON line `{"address": ..., "pid": ...}` and serves until SIGTERM/SIGINT or until
its stdin closes (`--stdin-eof-exits`, how tests and benchmarks tie it to their lifetime).
Clients use `RemoteKVPool(address, secret=...)` (`jkv/kvpool/remote_pool.py`).

Data path: a get is one RPC whose reply (the hits' payloads, concatenated) the client receives
straight into a preallocated staging buffer (`Peer.call(into=)`). The transport offers one-sided
*writes* (RDMA WRITE on rdma) but no one-sided *reads*, and its RPCs travel on the tcp control
connection on every backend, so a pool read is a request/reply on all three. `--bandwidth`
paces everything the server sends (replies included) with the transport's token bucket: that
is how benchmarks emulate a thin pool link on one machine. (On shm, replies travel over the
control socket, which the transport does not pace; use tcp for a paced link.)

Concurrency: the endpoint's RPC worker pool (`rpc_workers` threads) runs the handlers; they
share one `HostKVPool`, whose lock makes each call atomic. The main thread only waits for a
stop signal. Handlers never block on the network: replies are queued to the connection's
sender thread by the transport.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading

from jkv.kvpool import protocol
from jkv.kvpool.hashing import key_from_name
from jkv.kvpool.host_pool import HostKVPool

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str | int) -> int:
    """Bytes from `1073741824`, `512MiB`, `8GiB`, `2gb` (ValueError naming the value otherwise)."""
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"capacity {value!r} is not a size; write e.g. 4GiB, 512MiB or bytes")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < 1:
        raise ValueError(f"capacity {value!r} must be at least 1 byte")
    return size


class PoolServer:
    """Serves `pool` (a HostKVPool) over an Endpoint. `start()` returns the listen address."""

    def __init__(self, capacity_bytes: int, *, secret: bytes | str, backend: str = "tcp",
                 bandwidth: str | float | None = None, name: str = "jkv-pool",
                 rpc_workers: int = 4, timeout: float = 5.0):
        from transport import Endpoint

        self.pool = HostKVPool(capacity_bytes)
        self.endpoint = Endpoint(name, backend, secret=secret, bandwidth=bandwidth,
                                 rpc_workers=rpc_workers, timeout=timeout)
        for method, handler in ((protocol.PUT, self._put), (protocol.GET, self._get),
                                (protocol.CONTAINS, self._contains),
                                (protocol.DELETE, self._delete), (protocol.STATS, self._stats)):
            self.endpoint.serve(method, handler)

    def start(self, listen: str | None = None) -> str:
        return self.endpoint.listen(listen)

    def close(self) -> None:
        self.endpoint.close()
        self.pool.close()

    # -- handlers (run on the endpoint's RPC workers) --------------------------------------------
    def _put(self, peer: str, message) -> bytes:
        header, payload = protocol.decode(message)
        key = key_from_name(header["key"])
        meta = protocol.meta_from_dict(header["meta"])
        return protocol.encode({"stored": self.pool.put(key, payload, meta)})

    def _get(self, peer: str, message) -> bytes:
        header, _ = protocol.decode(message)
        names, caps = header["keys"], header["caps"]
        if len(names) != len(caps):
            raise ValueError(f"kvpool.get got {len(names)} keys but {len(caps)} buffer sizes")
        entries = self.pool.lookup_many([key_from_name(n) for n in names])
        metas, tail = [], []
        for (entry, cap) in zip(entries, caps):
            if entry is None:
                metas.append(None)
            elif entry[1].nbytes > cap:
                metas.append({"too_big": entry[1].nbytes})
            else:
                metas.append(protocol.meta_to_dict(entry[1]))
                tail.append(entry[0])
        return protocol.encode({"metas": metas}, b"".join(tail))

    def _contains(self, peer: str, message) -> bytes:
        header, _ = protocol.decode(message)
        keys = [key_from_name(n) for n in header["keys"]]
        return protocol.encode({"present": self.pool.contains_many(keys)})

    def _delete(self, peer: str, message) -> bytes:
        header, _ = protocol.decode(message)
        return protocol.encode({"deleted": self.pool.delete(key_from_name(header["key"]))})

    def _stats(self, peer: str, message) -> bytes:
        return protocol.encode(dataclasses.asdict(self.pool.stats()))


# -- command line (`jkv pool`, or `python -m jkv.kvpool.server`) -----------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("pool", help="run the built-in KV pool server (host-memory LRU prefix "
                                    "cache reached over the transport)")
    add_args(p)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", default="4GiB", help="payload bytes to keep, e.g. 8GiB (LRU "
                                                      "eviction beyond it)")
    p.add_argument("--backend", default="tcp", choices=("tcp", "shm", "rdma"))
    p.add_argument("--listen", default=None, help="address (default 127.0.0.1:0; shm: abstract "
                                                  "unix name)")
    p.add_argument("--secret-env", default="JKV_SECRET",
                   help="environment variable holding the shared secret (default JKV_SECRET)")
    p.add_argument("--bandwidth", default=None, help="pace everything the server sends, e.g. "
                                                     "10gbit (emulates a thin pool link)")
    p.add_argument("--rpc-workers", type=int, default=4)
    p.add_argument("--stdin-eof-exits", action="store_true",
                   help="stop when stdin closes (ties the server to a parent process)")


def run(args) -> int:
    secret = os.environ.get(args.secret_env)
    if not secret:
        raise ValueError(f"environment variable {args.secret_env} is empty; set it to the "
                         "shared secret (>= 8 bytes) every pool client uses")
    server = PoolServer(parse_size(args.capacity), secret=secret, backend=args.backend,
                        bandwidth=args.bandwidth, rpc_workers=args.rpc_workers)
    stop = threading.Event()
    try:
        address = server.start(args.listen)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        if args.stdin_eof_exits:
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True,
                             name="jkv-pool-stdin").start()
        print(json.dumps({"address": address, "pid": os.getpid(),
                          "capacity_bytes": server.pool.capacity_bytes}), flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jkv.kvpool.server", description=__doc__.split("\n")[0])
    add_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        return run(args)
    except ValueError as exc:
        print(f"jkv pool: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
