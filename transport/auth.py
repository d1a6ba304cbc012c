"""Mutual HMAC handshake run on a fresh connection before any region is exposed.

Client C and server S share ``secret``. The client proves first, so nothing keyed by the
secret ever reaches a peer that has not proved it (an anonymous client cannot collect
``(nonce, HMAC)`` pairs to guess the secret offline)::

    C -> S  HELLO      nonce_c(32) | backend(8) | C's name
    S -> C  CHALLENGE  nonce_s(32) | S's name          (nothing here depends on the secret)
    C -> S  AUTH       proof_c(32) | extra
    S -> C  WELCOME    proof_s(32) | extra             (or ERROR "authentication failed", close)

    transcript = "jkvt-v2" | backend | nonce_c | nonce_s | u16 len | C's name | u16 len | S's name
    proof_c    = HMAC-SHA256(secret, "client\\0" | transcript)
    proof_s    = HMAC-SHA256(secret, "server\\0" | transcript)

Both proofs cover both nonces, both names and the backend, and the role label differs, so a
proof cannot be reflected back (a client proof is never a valid server proof) or replayed on
another connection (nonces are fresh per connection). The server checks ``proof_c`` before it
computes anything with the secret; the client checks ``proof_s`` before it trusts the
WELCOME ``extra`` (the shm ring names). A client that connects to an impostor does hand it one
proof over a transcript with the client's own fresh nonce; clients only connect to addresses
they were configured with.

Every handshake runs under one overall :class:`Deadline` (``Endpoint(handshake_timeout=)``),
not just a per-read timeout, so a peer dribbling a byte at a time is cut off when it expires.
A server over its cap of unauthenticated connections (``Endpoint(max_handshakes=)``) answers
with an ERROR "busy: ..." frame and closes (:class:`HandshakeBusy` on the client, which
``Endpoint.connect`` retries until its connect deadline).
The AUTH and WELCOME ``extra`` may carry the application's configuration (``Endpoint(config=,
check_config=)``): the server checks the client's before it sends WELCOME and refuses a mismatch
with an ERROR "config mismatch: ..." frame naming the field and both values (:class:`ConfigMismatch`
on the client); the client checks the server's before it adopts the connection. So no frame of a
mismatched peer is ever read, and nothing lands in a registered region before both agreed.

Handshake frames are capped at 4 KiB and use the wire ``VERSION``; a peer speaking another
version gets an ERROR naming this side's version (and its own header check names both). Anything unexpected raises
:class:`~transport.errors.AuthError`. Runs on the calling thread.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

from transport.errors import AuthError, FrameError
from transport.wire import HEADER_SIZE, MAGIC, VERSION, Header, Op, crc32c, decode_header, encode_header

MAX_HANDSHAKE_PAYLOAD = 4096  # AUTH/WELCOME carry a few hundred bytes of JSON config
CONFIG_PREFIX = "config mismatch:"
NONCE_BYTES = 32
PROOF_BYTES = 32
BUSY_PREFIX = "busy:"


class HandshakeBusy(AuthError):
    """The server refused the connection because too many handshakes are in progress."""


class VersionMismatch(AuthError):
    """The peer's frames carry another wire protocol version."""


class ConfigMismatch(AuthError):
    """The peers authenticated but run incompatible configurations; the text names the field
    and both values."""


class _Refused(AuthError):
    """The peer answered with an ERROR frame; ``text`` is its reason."""

    def __init__(self, text: str):
        super().__init__(f"peer refused the connection: {text}")
        self.text = text


class Deadline:
    """One time budget for a whole handshake (monotonic clock)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left; raises AuthError once the budget is spent."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> AuthError:
        return AuthError(f"handshake did not complete within its {self.seconds:g}s deadline "
                         f"(handshake_timeout)")


class ConfigCheck:
    """What an endpoint tells its peers about itself in the handshake, and how it judges theirs.

    ``config``: a JSON-serialisable dict sent in AUTH (client) / WELCOME (server);
    ``check(peer_config) -> str | None``: the refusal reason (naming the field and both values)
    or None to accept; ``peer_config`` is None when the peer sent no config."""

    def __init__(self, config: dict, check):
        import json
        if len(json.dumps(config)) > MAX_HANDSHAKE_PAYLOAD - 512:
            raise ValueError(f"handshake config of {len(json.dumps(config))} bytes of JSON leaves no room in a "
                             f"{MAX_HANDSHAKE_PAYLOAD}-byte handshake frame; shorten its values")
        self.config, self.check = config, check

    def verify(self, peer_extra: dict) -> None:
        """Raise ConfigMismatch with the reason when the peer's config (in its extra) is refused."""
        reason = self.check(peer_extra.get("config"))
        if reason:
            raise ConfigMismatch(reason)


def _nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _transcript(tag: bytes, nonce_c: bytes, nonce_s: bytes, client: bytes, server: bytes) -> bytes:
    return (b"jkvt-v2" + tag + nonce_c + nonce_s + struct.pack("<H", len(client)) + client
            + struct.pack("<H", len(server)) + server)


def proof(secret: bytes, role: str, transcript: bytes) -> bytes:
    """HMAC-SHA256 proof of ``role`` ("client" or "server") over a handshake transcript."""
    return hmac.new(secret, role.encode() + b"\0" + transcript, hashlib.sha256).digest()


def send_frame(sock, op: Op, payload: bytes, seq: int, deadline: Deadline | None = None) -> None:
    """One handshake frame (also used to refuse a connection with Op.ERROR)."""
    h = Header(op, 0, 0, seq, 0, len(payload), 0, crc32c(payload))
    if deadline is None:
        sock.sendall(encode_header(h) + payload)
        return
    sock.settimeout(deadline.remaining())
    try:
        sock.sendall(encode_header(h) + payload)
    except socket.timeout:
        raise deadline.expired() from None


def _recv_exact(sock, n: int, deadline: Deadline) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        sock.settimeout(deadline.remaining())  # per read: what is left of the whole budget
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            raise deadline.expired() from None
        if k == 0:
            raise AuthError(f"peer closed the connection during the handshake (after {got} of {n} "
                            f"bytes); a peer speaking an older transport protocol than version "
                            f"{VERSION} closes without a reason")
        got += k
    return bytes(buf)


def recv_frame(sock, expect: Op, deadline: Deadline) -> bytes:
    """Receive one handshake frame of type ``expect``; an ERROR frame raises _Refused."""
    raw = _recv_exact(sock, HEADER_SIZE, deadline)
    if raw[:4] == MAGIC and raw[4] != VERSION:
        raise VersionMismatch(f"peer speaks transport protocol version {raw[4]}, this side version {VERSION}: "
                        f"run the same jkv release on both sides")
    try:
        h = decode_header(raw)
    except FrameError as e:
        raise AuthError(f"handshake failed: {e}") from None
    if h.length > MAX_HANDSHAKE_PAYLOAD:
        raise AuthError(f"handshake frame of {h.length} bytes exceeds {MAX_HANDSHAKE_PAYLOAD}")
    payload = _recv_exact(sock, h.length, deadline)
    if crc32c(payload) != h.payload_crc:
        raise AuthError("handshake payload checksum mismatch")
    if h.op == Op.ERROR and expect != Op.ERROR:
        text = payload.decode(errors="replace")
        raise HandshakeBusy(f"peer refused the connection: {text}") if text.startswith(BUSY_PREFIX) \
            else _Refused(text)
    if h.op != expect:
        raise AuthError(f"handshake expected {expect.name}, got {h.op.name}")
    return payload


def backend_tag(backend: str) -> bytes:
    return backend.encode().ljust(8, b"\0")[:8]


def client_handshake(sock, secret: bytes, name: str, backend: str, deadline: Deadline,
                     extra_fn=lambda: b"") -> tuple[str, bytes]:
    """Run the client side. Returns (server name, server's WELCOME extra)."""
    tag = backend_tag(backend)
    nonce_c = _nonce()
    send_frame(sock, Op.HELLO, nonce_c + tag + name.encode(), 1, deadline)
    payload = recv_frame(sock, Op.CHALLENGE, deadline)
    if len(payload) < NONCE_BYTES:
        raise AuthError("malformed CHALLENGE")
    nonce_s, server_raw = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    server_name = server_raw.decode(errors="replace")
    transcript = _transcript(tag, nonce_c, nonce_s, name.encode(), server_raw)
    send_frame(sock, Op.AUTH, proof(secret, "client", transcript) + extra_fn(), 2, deadline)
    try:
        payload = recv_frame(sock, Op.WELCOME, deadline)
    except _Refused as e:
        if e.text.startswith(CONFIG_PREFIX):
            raise ConfigMismatch(f"endpoint {server_name!r} refused this endpoint: {e.text}") from None
        raise AuthError(f"endpoint {server_name!r} refused this endpoint ({e.text}): it failed to prove "
                        f"the shared secret (secrets differ)") from None
    if len(payload) < PROOF_BYTES or not hmac.compare_digest(payload[:PROOF_BYTES],
                                                              proof(secret, "server", transcript)):
        raise AuthError(f"endpoint {server_name!r} failed to prove the shared secret "
                        f"(secrets differ, or it is not the jkv endpoint this side meant to reach)")
    return server_name, payload[PROOF_BYTES:]


def server_handshake(sock, secret: bytes, name: str, backend: str, deadline: Deadline,
                     extra_fn=lambda client_extra: b"") -> tuple[str, bytes]:
    """Run the server side. Returns (client name, client's AUTH extra). ``extra_fn`` is
    called only after the client proved the secret and returns the WELCOME extra; when it
    raises ConfigMismatch the client gets an ERROR frame with that text instead."""
    tag = backend_tag(backend)
    try:
        payload = recv_frame(sock, Op.HELLO, deadline)
    except VersionMismatch:  # tell the old peer why; its header check names both versions
        send_frame(sock, Op.ERROR, f"transport protocol version mismatch: this endpoint speaks "
                                   f"version {VERSION}".encode(), 1, deadline)
        raise
    if len(payload) < NONCE_BYTES + 8:
        raise AuthError("malformed HELLO")
    nonce_c, client_tag = payload[:NONCE_BYTES], payload[NONCE_BYTES:NONCE_BYTES + 8]
    client_raw = payload[NONCE_BYTES + 8:]
    client_name = client_raw.decode(errors="replace")
    if client_tag != tag:
        send_frame(sock, Op.ERROR, f"backend mismatch: server uses {backend!r}".encode(), 1, deadline)
        raise AuthError(f"client {client_name!r} uses backend "
                        f"{client_tag.rstrip(bytes(1)).decode(errors='replace')!r}, server {backend!r}")
    nonce_s = _nonce()
    send_frame(sock, Op.CHALLENGE, nonce_s + name.encode(), 1, deadline)
    payload = recv_frame(sock, Op.AUTH, deadline)
    transcript = _transcript(tag, nonce_c, nonce_s, client_raw, name.encode())
    if not hmac.compare_digest(payload[:PROOF_BYTES], proof(secret, "client", transcript)):
        send_frame(sock, Op.ERROR, b"authentication failed: wrong shared secret", 2, deadline)
        raise AuthError(f"client {client_name!r} failed to prove the shared secret")
    client_extra = payload[PROOF_BYTES:]
    try:
        extra = extra_fn(client_extra)
    except ConfigMismatch as e:
        text = f"{CONFIG_PREFIX} {e}".encode()[:MAX_HANDSHAKE_PAYLOAD]
        send_frame(sock, Op.ERROR, text, 2, deadline)
        raise
    send_frame(sock, Op.WELCOME, proof(secret, "server", transcript) + extra, 2, deadline)
    return client_name, client_extra
