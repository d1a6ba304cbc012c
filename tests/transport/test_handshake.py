"""The handshake against adversarial peers (loopback sockets): no secret-keyed byte reaches an
unauthenticated client, proofs cannot be reflected, one overall deadline, a cap on
unauthenticated connections with rate-limited logging, and a clear protocol-version error."""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest

from transport import AuthError
from transport.admission import RefusalLog
from transport.auth import (NONCE_BYTES, PROOF_BYTES, Deadline, backend_tag, recv_frame, send_frame)
from transport.wire import HEADER_SIZE, MAGIC, VERSION, Header, Op, crc32c, decode_header, encode_header

from transport_consts import SECRET  # noqa: E402  (tests/transport is on sys.path)

TAG = backend_tag("tcp")


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


def _hello(name: bytes = b"anon", nonce: bytes = b"c" * NONCE_BYTES) -> bytes:
    payload = nonce + TAG + name
    return encode_header(Header(Op.HELLO, 0, 0, 1, 0, len(payload), 0, crc32c(payload))) + payload


def test_server_sends_nothing_keyed_by_the_secret_before_the_client_proved_it(make_endpoint, monkeypatch):
    """Same client bytes and same server randomness, two different secrets: the server's whole
    answer to an unauthenticated client — CHALLENGE, then the refusal — is byte-identical, so it
    carries no information about the secret (the old handshake sent HMAC(secret, nonce_c, ...))."""
    monkeypatch.setattr("transport.auth._nonce", lambda: b"s" * NONCE_BYTES)
    answers = []
    for secret in ("first-secret-123", "second-secret-456"):
        server = make_endpoint("server", secret=secret)
        server.register("pool", np.zeros(4096, np.uint8))
        with _connect(server.listen()) as s:
            s.sendall(_hello())
            h = decode_header(s.recv(HEADER_SIZE, socket.MSG_WAITALL))
            assert h.op == Op.CHALLENGE
            challenge = s.recv(h.length, socket.MSG_WAITALL)
            assert challenge == b"s" * NONCE_BYTES + b"server"  # its nonce and name, nothing else
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):  # and nothing more until the client proves itself
                s.recv(1)
            s.sendall(encode_header(Header(Op.AUTH, 0, 0, 2, 0, PROOF_BYTES, 0, crc32c(bytes(PROOF_BYTES))))
                      + bytes(PROOF_BYTES))
            answers.append(encode_header(h) + challenge + _read_until_closed(s))
        server.close()
    assert answers[0] == answers[1]
    assert b"authentication failed" in answers[0]


def _fake_server(behaviour):
    """A listener that runs ``behaviour(sock)`` on its first connection; returns (address, thread)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    lst.settimeout(10)

    def run():
        try:
            conn, _ = lst.accept()
            with conn:
                behaviour(conn)
        except OSError:
            pass
        finally:
            lst.close()

    t = threading.Thread(target=run, name="fake-server")
    t.start()
    return f"127.0.0.1:{lst.getsockname()[1]}", t


@pytest.mark.parametrize("welcome", ["reflected", "forged"])
def test_client_refuses_a_server_that_cannot_prove_the_secret(make_endpoint, welcome):
    """The client proves first, but it trusts nothing (no ring, no peer) until the server proved
    the secret over the same transcript: its own proof reflected back, or a forgery, is refused."""
    def server(conn):
        hello = recv_frame(conn, Op.HELLO, Deadline(5))
        send_frame(conn, Op.CHALLENGE, b"s" * NONCE_BYTES + b"impostor", 1)
        auth = recv_frame(conn, Op.AUTH, Deadline(5))
        assert len(hello) > NONCE_BYTES
        proof = auth[:PROOF_BYTES] if welcome == "reflected" else b"\x01" * PROOF_BYTES
        send_frame(conn, Op.WELCOME, proof + b'{"ring": null}', 2)
        _read_until_closed(conn)

    address, t = _fake_server(server)
    client = make_endpoint("client")
    with pytest.raises(AuthError, match="'impostor' failed to prove the shared secret"):
        client.connect(address)
    t.join(10)
    assert client.peers == {}


def test_a_byte_dribbling_client_is_cut_at_the_handshake_deadline(make_endpoint):
    """The per-read timeout never fires when a byte arrives every 0.2 s; the overall deadline does."""
    server = make_endpoint("server", handshake_timeout=1.0)
    stop = threading.Event()
    with _connect(server.listen()) as s:
        hello = _hello(name=b"slow" * 20)

        def dribble():
            for i in range(len(hello)):
                if stop.wait(0.2):
                    return
                try:
                    s.send(hello[i:i + 1])
                except OSError:
                    return

        t0 = time.monotonic()
        dribbler = threading.Thread(target=dribble, name="dribbler")
        dribbler.start()
        try:
            assert _read_until_closed(s, timeout=10) == b""
            held = time.monotonic() - t0
        finally:
            stop.set()
            dribbler.join()
    assert 0.9 < held < 3.0, held  # without the deadline: ~len(hello) * 0.2 s = 26 s
    deadline = time.monotonic() + 2
    while server.metrics.snapshot()["auth_failures"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metrics.snapshot()["auth_failures"] == 1


def test_idle_connections_are_capped_closed_and_logged_once_per_interval(make_endpoint, caplog):
    cap, n = 8, 200
    server = make_endpoint("server", handshake_timeout=1.5, max_handshakes=cap)
    address = server.listen()
    threads_before = threading.active_count()
    peak = threads_before
    socks = []
    with caplog.at_level(logging.WARNING, logger="transport"):
        try:
            t0 = time.monotonic()
            for _ in range(n):
                socks.append(_connect(address))
                peak = max(peak, threading.active_count())
            # slots free up every handshake_timeout: on a slow box more than one batch of `cap` gets one
            batches = 2 + int((time.monotonic() - t0) / 1.5)
            closed_by_server = 0
            busy = 0
            for s in socks:  # every one is closed by the server: over the cap at once, else at the deadline
                data = _read_until_closed(s, timeout=10)
                closed_by_server += 1
                busy += b"busy:" in data
                peak = max(peak, threading.active_count())
        finally:
            for s in socks:
                s.close()
        assert closed_by_server == n
        assert peak - threads_before <= cap, f"{peak - threads_before} handshake threads for {n} idle connections"
        snap = server.metrics.snapshot()
        assert busy >= n - batches * cap and snap["connections_refused"] == busy
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(refusals) <= 3, [r.getMessage() for r in refusals]
    assert make_endpoint("friend").connect(address).alive  # the listener still serves


def test_connect_retries_a_busy_server_until_a_slot_frees(make_endpoint):
    server = make_endpoint("server", handshake_timeout=1.0, max_handshakes=1)
    server.register("pool", np.zeros(4096, np.uint8))
    address = server.listen()
    with _connect(address) as idle:  # holds the only slot until its deadline
        time.sleep(0.1)
        client = make_endpoint("client")
        peer = client.connect(address, connect_timeout=5)
        assert peer.regions()["pool"].nbytes == 4096
        assert client.metrics.snapshot()["retries"] >= 1
        assert server.metrics.snapshot()["connections_refused"] >= 1
        _read_until_closed(idle)


def test_refusal_log_summarises_a_flood_in_one_line_per_interval(caplog):
    now = [0.0]
    log = RefusalLog(logging.getLogger("transport.test"), "ep", interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="transport.test"):
        for _ in range(6):
            log.refused("bad proof")
        now[0] = 5.0
        log.flush()
        assert [r.getMessage() for r in caplog.records] == ["'ep' refused an incoming connection: bad proof"]
        now[0] = 10.5
        log.flush()
        log.refused("deadline")  # the flood goes on: counted into the next summary
        now[0] = 21.0
        log.flush()
        now[0] = 32.0
        log.flush()  # a quiet interval ends the window: the next refusal is logged at once
        log.refused("again")
    assert [r.getMessage() for r in caplog.records] == [
        "'ep' refused an incoming connection: bad proof",
        "'ep' refused 5 more incoming connections in the last 10s (latest: bad proof)",
        "'ep' refused 1 more incoming connections in the last 10s (latest: deadline)",
        "'ep' refused an incoming connection: again"]


def test_protocol_version_mismatch_is_named_on_both_sides(make_endpoint):
    server = make_endpoint("server")
    address = server.listen()
    old = bytearray(_hello())  # a version-2 client's HELLO (crc32c trailers)
    old[4] = 2
    old[48:52] = struct.pack("<I", crc32c(bytes(old[:48])))
    with _connect(address) as s:
        s.sendall(old)
        reply = _read_until_closed(s)
    assert reply[:4] == MAGIC and reply[4] == VERSION == 3
    assert b"protocol version mismatch: this endpoint speaks version 3" in reply

    def old_server(conn):
        recv_frame(conn, Op.HELLO, Deadline(5))
        frame = bytearray(encode_header(Header(Op.CHALLENGE)))
        frame[4] = 1
        frame[48:52] = struct.pack("<I", crc32c(bytes(frame[:48])))
        conn.sendall(frame)
        _read_until_closed(conn)

    fake, t = _fake_server(old_server)
    with pytest.raises(AuthError, match="peer speaks transport protocol version 1, this side version 3"):
        make_endpoint("client", secret=SECRET).connect(fake)
    t.join(10)
