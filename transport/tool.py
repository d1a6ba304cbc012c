"""Stand-alone peer process for link checks, tests and benchmarks.

``python -m transport.tool serve`` registers zeroed regions, serves a few RPC methods and
prints one JSON line ``{"address": ..., "pid": ...}`` on stdout; it exits when stdin closes
or a ``shutdown`` notification arrives. Methods served:

* ``echo``      — returns the payload.
* ``read``      — payload ``<region name>\\0<u64 offset><u64 length>``: returns those bytes
                  (the shape of the decode worker's remote-row fetch).
* ``digest``    — payload ``region name``: sha256 of the region.
* ``sleep``     — payload ascii seconds: replies after sleeping (a slow handler).
* ``notify_back`` — payload ascii count: sends that many ``seq`` notifications (payload
                  the ascii index) back to the caller, in order.
* ``notified``  — the ``seq`` payloads received so far, comma separated.

``python -m transport.tool send`` connects, writes ``--bytes`` in ``--block`` chunks into
region ``pool`` and prints ``{"bytes", "seconds", "bits_per_s"}`` (used by the netns test).

Concurrency: the serving process runs the endpoint's threads (see :mod:`transport.endpoint`);
the main thread only waits for stdin EOF or the shutdown notification.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import struct
import sys
import threading
import time

import numpy as np

from transport.endpoint import Endpoint, Notification
from transport.region import aligned_empty


def read_request(region: str, offset: int, length: int) -> bytes:
    return region.encode() + b"\0" + struct.pack("<QQ", offset, length)


def _serve(args) -> int:
    ep = Endpoint(args.name, args.backend, secret=args.secret, timeout=args.timeout,
                  bandwidth=args.bandwidth, payload_checksum=not args.no_payload_checksum)
    for spec in args.region:
        name, _, size = spec.partition(":")
        buf = aligned_empty(int(size), np.uint8)
        buf[:] = 0
        ep.register(name, buf)
    received: list[str] = []
    done = threading.Event()

    def read(peer, payload):
        name, _, tail = bytes(payload).partition(b"\0")
        offset, length = struct.unpack("<QQ", tail)
        region = ep.regions.by_name(name.decode())
        if region is None or offset + length > region.nbytes:
            raise ValueError(f"bad read of {name!r} [{offset}, {offset + length})")
        return region.view[offset:offset + length]

    def digest(peer, payload):
        return hashlib.sha256(ep.regions.by_name(bytes(payload).decode()).view).digest()

    def sleep(peer, payload):
        time.sleep(float(bytes(payload)))
        return b"slept"

    def notify_back(peer, payload):
        p = ep.peer(peer)
        last = None
        for i in range(int(bytes(payload))):
            last = p.notify("seq", str(i).encode())
        if last is not None:
            last.wait()
        return b"sent"

    def on_seq(n: Notification):
        received.append(n.payload.decode())

    ep.serve("echo", lambda peer, payload: bytes(payload))
    ep.serve("read", read)
    ep.serve("digest", digest)
    ep.serve("sleep", sleep)
    ep.serve("notify_back", notify_back)
    ep.serve("notified", lambda peer, payload: ",".join(received).encode())
    ep.on_notify("seq", on_seq)
    ep.on_notify("shutdown", lambda n: done.set())
    address = ep.listen(args.listen)
    print(json.dumps({"address": address, "pid": __import__("os").getpid()}), flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    ep.close()
    return 0


def _send(args) -> int:
    ep = Endpoint(args.name, args.backend, secret=args.secret, timeout=args.timeout,
                  payload_checksum=not args.no_payload_checksum)
    try:
        peer = ep.connect(args.connect, bandwidth=args.bandwidth)
        block = np.frombuffer(np.random.default_rng(0).bytes(args.block), np.uint8)
        pool = peer.regions()["pool"].nbytes
        n = args.bytes // args.block
        t0 = time.perf_counter()
        last = None
        for i in range(n):
            last = peer.write("pool", (i * args.block) % (pool - args.block + 1), block)
        last.wait()
        seconds = time.perf_counter() - t0
        print(json.dumps({"bytes": n * args.block, "seconds": seconds,
                          "bits_per_s": 8 * n * args.block / seconds}), flush=True)
    finally:
        ep.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m transport.tool", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("serve", "send"):
        p = sub.add_parser(cmd)
        p.add_argument("--backend", default="tcp", choices=("tcp", "shm", "rdma"))
        p.add_argument("--secret", required=True)
        p.add_argument("--name", default=cmd)
        p.add_argument("--timeout", type=float, default=5.0)
        p.add_argument("--bandwidth", default=None, help="pacing, e.g. 1gbit")
        p.add_argument("--no-payload-checksum", action="store_true",
                       help="skip crc32c of write payloads (trusted links only)")
    s = sub.choices["serve"]
    s.add_argument("--listen", default=None, help="address (default 127.0.0.1:0 / abstract unix)")
    s.add_argument("--region", action="append", default=[], help="NAME:BYTES (repeatable)")
    c = sub.choices["send"]
    c.add_argument("--connect", required=True)
    c.add_argument("--bytes", type=int, default=64 << 20)
    c.add_argument("--block", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return _serve(args) if args.cmd == "serve" else _send(args)


if __name__ == "__main__":
    sys.exit(main())
