"""Listen/connect addresses of the two socket backends: tcp 'host:port' and shm '@name'
(abstract unix sockets)."""
from __future__ import annotations


def parse_tcp(address) -> tuple[str, int]:
    """'host:port' or (host, port) -> (host, port); a ValueError names a malformed address."""
    if isinstance(address, tuple):
        host, port = address
    else:
        host, sep, port = str(address).rpartition(":")
        if not sep or not host:
            raise ValueError(f"tcp address {address!r} must look like 'host:port'")
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"tcp address {address!r} has a non-numeric port") from None
    return host, port


def parse_unix(address: str) -> str:
    """'@name' (what an shm listen() returns) -> the abstract unix socket path '\\0name'."""
    if not isinstance(address, str) or not address.startswith("@") or len(address) < 2:
        raise ValueError(f"shm address {address!r} must look like '@jkvt-name' "
                         f"(the string listen() returned)")
    return "\0" + address[1:]
