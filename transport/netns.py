"""Two network namespaces joined by a veth pair, optionally shaped with ``tc tbf``.

For realistic thin-link tests on one machine (DESIGN.md "Emulating the papers' testbed")::

    with VethLink(rate="1gbit") as link:          # needs root (CAP_NET_ADMIN)
        server = subprocess.Popen(link.exec_in("b") + [sys.executable, ...,
                                  "--listen", f"{link.addr_b}:0"])
        client = subprocess.Popen(link.exec_in("a") + [...])

Namespace ``a`` holds ``addr_a`` and namespace ``b`` holds ``addr_b`` on a /30; ``tbf``
shapes the egress of both veth ends (``burst 1mb latency 50ms``, measured to give 95–96 %
of the rate here). Namespaces are deleted on exit — also when setup fails half way — and
deleting a namespace deletes its veth end. Names carry the pid so parallel runs don't clash.

:func:`netns_available` says whether this machine permits it (and why not), so tests can
skip with a reason. Command line: ``python -m transport.netns --rate 1gbit -- CMD`` runs
nothing itself; it creates the link, prints the namespace names and addresses, and waits
for Enter before cleaning up.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess

from transport.pacing import parse_bandwidth

log = logging.getLogger(__name__)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def netns_available() -> tuple[bool, str]:
    """(True, "") if namespaces + veth + tbf can be created here, else (False, reason)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 ('ip' and 'tc') is not installed"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"jkvtp{os.getpid() % 100000}{secrets.token_hex(2)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"'ip netns add' is not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


class _ShapedNamespaces:
    """What `VethLink` and `StarNetwork` share: the rate and tbf options, a pid-tagged name stem,
    the namespaces made so far (deleted by `close`, also after a failed setup), putting one veth
    end into a namespace, and shaping a device. Subclasses build in `_build` and undo in `close`."""

    _what = "namespaces"  # named in a setup failure

    def __init__(self, rate: str | float | None, burst: str, latency: str):
        self.rate_bps = None if rate is None else parse_bandwidth(rate)
        self.burst, self.latency = burst, latency
        self._tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self._created: list[str] = []

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)

    def _move_into(self, ns: str, dev: str, cidr: str) -> None:
        """Veth end `dev` into namespace `ns` with address `cidr`, up, with the namespace's loopback."""
        _ip("link", "set", dev, "netns", ns)
        _ip("-n", ns, "addr", "add", cidr, "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _shape(self, dev: str, ns: str | None) -> None:
        if self.rate_bps is None:
            return
        where = ["-n", ns] if ns else []
        subprocess.run(["tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                        f"{int(self.rate_bps)}bit", "burst", self.burst, "latency", self.latency],
                       check=True, capture_output=True, text=True, timeout=10)

    def close(self) -> None:
        for ns in self._created:
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, r.stderr.strip())
        self._created.clear()

    def __enter__(self):
        try:
            self._build()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            stderr = getattr(e, "stderr", "") or ""
            self.close()
            raise RuntimeError(f"setting up the {self._what} failed: {e} {stderr.strip()}") from None
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VethLink(_ShapedNamespaces):
    _what = "veth link"

    def __init__(self, rate: str | float | None = None, *, burst: str = "1mb",
                 latency: str = "50ms"):
        super().__init__(rate, burst, latency)
        tag = self._tag
        self.ns_a, self.ns_b = f"jkvta{tag}", f"jkvtb{tag}"
        self.dev_a, self.dev_b = f"jva{tag}"[:15], f"jvb{tag}"[:15]
        octet2, octet3 = secrets.randbelow(200) + 20, secrets.randbelow(250)
        self.addr_a, self.addr_b = f"10.{octet2}.{octet3}.1", f"10.{octet2}.{octet3}.2"

    def exec_in(self, side: str) -> list[str]:
        """Command prefix that runs a program inside namespace ``side`` ('a' or 'b')."""
        if side not in ("a", "b"):
            raise ValueError(f"side={side!r} must be 'a' or 'b'")
        return ["ip", "netns", "exec", self.ns_a if side == "a" else self.ns_b]

    def _build(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            self._add_namespace(ns)
        _ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
        for ns, dev, addr in ((self.ns_a, self.dev_a, self.addr_a), (self.ns_b, self.dev_b, self.addr_b)):
            self._move_into(ns, dev, f"{addr}/30")
            self._shape(dev, ns)

    def close(self) -> None:
        # a veth still in the root namespace (setup failed before the move) goes too
        _ip("link", "del", self.dev_a, check=False)
        super().close()


class StarNetwork(_ShapedNamespaces):
    """Several namespaces on one shaped switch: a bridge in the calling (root) namespace holds
    ``host_addr``, and each named namespace a veth to it with ``addr[name]`` on one /24, shaped by
    ``tbf`` at ``rate`` on both ends (so every path between two namespaces crosses two shaped
    links). The caller reaches every namespace through the bridge (e.g. a client talking to a
    router); the namespaces reach each other and the caller. Deleted on exit like `VethLink`::

        with StarNetwork(["router", "prefill-a", "decode"], rate="1gbit") as net:
            subprocess.Popen(net.exec_in("router") + [...,"--host", net.addr["router"]])
    """

    _what = "star network"

    def __init__(self, names: list[str], rate: str | float | None = None, *, burst: str = "1mb",
                 latency: str = "50ms"):
        if not names or len(set(names)) != len(names) or len(names) > 200:
            raise ValueError(f"names={names!r} must be 1..200 distinct namespace labels")
        super().__init__(rate, burst, latency)
        tag = self._tag
        self.bridge = f"jkbr{tag}"[:15]
        subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
        self.host_addr = f"{subnet}.254"
        self.names = list(names)
        self.ns = {n: f"jkvt{i}s{tag}" for i, n in enumerate(names)}
        self.addr = {n: f"{subnet}.{i + 1}" for i, n in enumerate(names)}
        self._dev = {n: (f"jsa{i}x{tag}"[:15], f"jsb{i}x{tag}"[:15]) for i, n in enumerate(names)}
        self._bridge_made = False

    def exec_in(self, name: str) -> list[str]:
        """Command prefix that runs a program inside namespace ``name``."""
        if name not in self.ns:
            raise ValueError(f"name={name!r} is not one of {self.names}")
        return ["ip", "netns", "exec", self.ns[name]]

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name in self.names:
            ns, (inner, outer) = self.ns[name], self._dev[name]
            self._add_namespace(ns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            self._move_into(ns, inner, f"{self.addr[name]}/24")
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            self._shape(inner, ns)
            self._shape(outer, None)

    def close(self) -> None:
        for inner, outer in self._dev.values():  # a veth still in the root namespace goes too
            _ip("link", "del", outer, check=False)
        super().close()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m transport.netns", description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default=None, help="tbf rate, e.g. 1gbit (default: unshaped)")
    args = ap.parse_args(argv)
    ok, reason = netns_available()
    if not ok:
        print(f"not available: {reason}")
        return 1
    with VethLink(args.rate) as link:
        print(f"namespace a: {link.ns_a} {link.addr_a}\nnamespace b: {link.ns_b} {link.addr_b}\n"
              f"run: {' '.join(link.exec_in('a'))} <cmd>   (Enter to tear down)")
        input()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
