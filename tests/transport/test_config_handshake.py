"""Configuration exchanged in the handshake (Endpoint(config_check=)): a refused peer is never
adopted, the reason reaches both sides, and endpoints without a check are unaffected."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from transport import AuthError, ConfigCheck, ConfigMismatch, Endpoint

from transport_consts import SECRET  # noqa: E402  (tests/transport is on sys.path)


def _same_colour(mine: dict):
    def check(peer):
        if peer is None:
            return "the peer sent no config"
        if peer["colour"] != mine["colour"]:
            return f"{mine['side']} runs colour={mine['colour']} but {peer['side']} runs {peer['colour']}"
        return None
    return ConfigCheck(mine, check)


def _pair(server_check, client_check):
    server = Endpoint("server", secret=SECRET, config_check=server_check)
    client = Endpoint("client", secret=SECRET, config_check=client_check)
    server.register("pool", np.zeros(4096, np.uint8))
    return server, client


def test_a_mismatch_is_refused_on_both_sides_and_no_peer_is_adopted(caplog):
    server, client = _pair(_same_colour({"side": "prefill", "colour": "red"}),
                           _same_colour({"side": "decode", "colour": "blue"}))
    caplog.set_level(logging.WARNING, logger="transport")
    try:
        with pytest.raises(ConfigMismatch, match="prefill runs colour=red but decode runs blue"):
            client.connect(server.listen())
        assert client.peers == {} and server.peers == {}
        deadline = time.monotonic() + 10  # the server's handshake thread logs after it sent the refusal
        while not any("prefill runs colour=red but decode runs blue" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
        assert client.metrics.snapshot()["auth_failures"] == 1
    finally:
        client.close()
        server.close()


def test_the_client_refuses_a_server_whose_config_it_rejects():
    """The server accepts anything (no check of its own): the client's check still refuses it."""
    server, client = _pair(ConfigCheck({"side": "prefill", "colour": "red"}, lambda peer: None),
                           _same_colour({"side": "decode", "colour": "blue"}))
    try:
        with pytest.raises(ConfigMismatch, match="decode runs colour=blue but prefill runs red"):
            client.connect(server.listen())
        assert client.peers == {}
    finally:
        client.close()
        server.close()


def test_matching_configs_connect_and_a_checker_refuses_a_peer_without_config():
    server, client = _pair(_same_colour({"side": "prefill", "colour": "red"}),
                           _same_colour({"side": "decode", "colour": "red"}))
    plain = Endpoint("plain", secret=SECRET)
    try:
        address = server.listen()
        peer = client.connect(address)
        peer.write("pool", 0, b"\x07" * 8).wait(5)
        with pytest.raises(AuthError, match="the peer sent no config"):
            plain.connect(address)
    finally:
        for ep in (plain, client, server):
            ep.close()


def test_a_config_too_large_for_a_handshake_frame_is_refused_at_construction():
    with pytest.raises(ValueError, match="handshake config of .* bytes"):
        ConfigCheck({"model": "x" * 5000}, lambda peer: None)
