"""Mutual HMAC challenge-response run on a fresh connection before any region is exposed.

Client C and server S share ``secret``; ``backend`` is bound into every proof so a tcp
client cannot talk to an shm server by accident::

    C -> S  HELLO      nonce_c(32) | backend(8) | C's name
    S -> C  CHALLENGE  nonce_s(32) | proof_s(32) | S's name
                       proof_s = HMAC-SHA256(secret, "jkvt-server" | nonce_c | nonce_s | backend)
    C -> S  AUTH       proof_c(32) | extra      (C checked proof_s first: S knows the secret)
                       proof_c = HMAC-SHA256(secret, "jkvt-client" | nonce_s | nonce_c | backend)
    S -> C  WELCOME    extra                    (or ERROR "authentication failed" and close)

``extra`` carries the shm ring names. Nonces are fresh per connection, so a recorded
exchange cannot be replayed. Handshake frames are capped at 1 KiB; anything unexpected
raises :class:`~transport.errors.AuthError`. Runs on the calling thread with a socket timeout.
"""
from __future__ import annotations

import hashlib
import hmac
import os

from transport.errors import AuthError, FrameError
from transport.wire import HEADER_SIZE, Header, Op, crc32c, decode_header, encode_header

MAX_HANDSHAKE_PAYLOAD = 1024
_NONCE = 32


def _proof(secret: bytes, role: bytes, a: bytes, b: bytes, backend: bytes) -> bytes:
    return hmac.new(secret, b"jkvt-" + role + a + b + backend, hashlib.sha256).digest()


def _send(sock, op: Op, payload: bytes, seq: int) -> None:
    h = Header(op, 0, 0, seq, 0, len(payload), 0, crc32c(payload))
    sock.sendall(encode_header(h) + payload)


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise AuthError("peer closed the connection during the handshake")
        got += k
    return bytes(buf)


def _recv(sock, expect: Op) -> bytes:
    try:
        h = decode_header(_recv_exact(sock, HEADER_SIZE))
    except FrameError as e:
        raise AuthError(f"handshake failed: {e}") from None
    if h.length > MAX_HANDSHAKE_PAYLOAD:
        raise AuthError(f"handshake frame of {h.length} bytes exceeds {MAX_HANDSHAKE_PAYLOAD}")
    payload = _recv_exact(sock, h.length)
    if crc32c(payload) != h.payload_crc:
        raise AuthError("handshake payload checksum mismatch")
    if h.op == Op.ERROR and expect != Op.ERROR:
        raise AuthError(f"peer refused the connection: {payload.decode(errors='replace')}")
    if h.op != expect:
        raise AuthError(f"handshake expected {expect.name}, got {h.op.name}")
    return payload


def _backend_tag(backend: str) -> bytes:
    return backend.encode().ljust(8, b"\0")[:8]


def client_handshake(sock, secret: bytes, name: str, backend: str,
                     extra_fn=lambda: b"") -> tuple[str, bytes]:
    """Run the client side. Returns (server name, server's WELCOME extra)."""
    tag = _backend_tag(backend)
    nonce_c = os.urandom(_NONCE)
    _send(sock, Op.HELLO, nonce_c + tag + name.encode(), 1)
    payload = _recv(sock, Op.CHALLENGE)
    if len(payload) < 2 * _NONCE:
        raise AuthError("malformed CHALLENGE")
    nonce_s, proof_s, server_name = payload[:32], payload[32:64], payload[64:].decode(errors="replace")
    if not hmac.compare_digest(proof_s, _proof(secret, b"server", nonce_c, nonce_s, tag)):
        raise AuthError(f"endpoint {server_name!r} failed to prove the shared secret "
                        f"(secrets differ, or backend mismatch: this side uses {backend!r})")
    _send(sock, Op.AUTH, _proof(secret, b"client", nonce_s, nonce_c, tag) + extra_fn(), 2)
    return server_name, _recv(sock, Op.WELCOME)


def server_handshake(sock, secret: bytes, name: str, backend: str,
                     extra_fn=lambda client_extra: b"") -> tuple[str, bytes]:
    """Run the server side. Returns (client name, client's AUTH extra). ``extra_fn`` is
    called only after the client proved the secret and returns the WELCOME extra."""
    tag = _backend_tag(backend)
    payload = _recv(sock, Op.HELLO)
    if len(payload) < _NONCE + 8:
        raise AuthError("malformed HELLO")
    nonce_c, client_tag = payload[:32], payload[32:40]
    client_name = payload[40:].decode(errors="replace")
    if client_tag != tag:
        _send(sock, Op.ERROR, f"backend mismatch: server uses {backend!r}".encode(), 1)
        raise AuthError(f"client {client_name!r} uses backend "
                        f"{client_tag.rstrip(bytes(1)).decode(errors='replace')!r}, server {backend!r}")
    nonce_s = os.urandom(_NONCE)
    _send(sock, Op.CHALLENGE, nonce_s + _proof(secret, b"server", nonce_c, nonce_s, tag)
          + name.encode(), 1)
    payload = _recv(sock, Op.AUTH)
    if not hmac.compare_digest(payload[:32], _proof(secret, b"client", nonce_s, nonce_c, tag)):
        _send(sock, Op.ERROR, b"authentication failed: wrong shared secret", 2)
        raise AuthError(f"client {client_name!r} failed to prove the shared secret")
    client_extra = payload[32:]
    _send(sock, Op.WELCOME, extra_fn(client_extra), 2)
    return client_name, client_extra
