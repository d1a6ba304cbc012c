"""Exceptions raised by the transport.

Every failure of an operation is a :class:`TransportError`; callers that only care whether
an operation worked catch that one class. Subclasses say why, so tests and the engine can
react differently to a dead peer (re-fetch elsewhere) and a programming error (fix the call).
"""
from __future__ import annotations


class TransportError(Exception):
    """An operation could not complete (connection lost, peer dead, bad frame, timeout)."""


class PeerDeadError(TransportError):
    """The peer closed the connection, was killed, or stayed silent past the liveness timeout."""


class OpTimeout(TransportError, TimeoutError):
    """An operation did not complete within its per-operation timeout."""


class AuthError(TransportError):
    """The shared-secret handshake failed (wrong secret, or a peer that is not a jkv endpoint)."""


class FrameError(TransportError):
    """A received frame failed validation (magic, version, checksum, region, bounds, size)."""


class RemoteError(TransportError):
    """The remote RPC handler raised, or the remote endpoint rejected the request."""


class BackendUnavailable(TransportError):
    """The requested backend cannot run on this machine (e.g. no pyverbs or RDMA device)."""
