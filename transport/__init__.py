"""KV block transport between processes (DESIGN.md "Transport"; SmartGen §4.1–4.3).

RDMA-style semantics on every backend (``tcp`` default, ``shm`` same host, ``rdma`` pyverbs):

* :meth:`Endpoint.register` a named buffer; peers write into it by name:
  ``peer.write(region, offset, data, then=Mask(mask_region, offset, value))`` — the mask
  write becomes visible only after the block (SmartGen §4.1 doorbell batching);
  ``peer.write_many([...])`` sends one layer's blocks as one transfer.
* ``peer.call(method, payload)`` / :meth:`Endpoint.serve` — two-sided RPC (on-demand fetch).
* ``peer.notify(kind, payload)`` — small ordered control messages (speculative trigger, free KV).
* Every operation returns a :class:`Transfer` (CONNECTING → TRANSFERRING → COMPLETE |
  FAILED(reason)); a dead or silent peer fails pending operations within ``timeout``.
* Pacing: ``bandwidth="10gbit"`` per endpoint or per peer (token bucket).
* ``Endpoint(config_check=ConfigCheck(config, check))``: peers exchange their configuration in
  the handshake and a mismatch refuses the connection before any frame is exchanged.
* ``Endpoint.metrics.snapshot()`` — counters for a Prometheus exporter.

This package imports neither jax nor the model code.
"""
from transport.auth import ConfigCheck, ConfigMismatch
from transport.endpoint import BACKENDS, Endpoint, Notification
from transport.errors import (AuthError, BackendUnavailable, FrameError, OpTimeout, PeerDeadError,
                              RemoteError, TransportError)
from transport.pacing import TokenBucket, parse_bandwidth
from transport.peer import Mask, Peer, WriteItem
from transport.region import Region, RemoteRegion, aligned_empty
from transport.transfer import Transfer, TransferState, wait_all

__all__ = [
    "BACKENDS", "Endpoint", "Notification", "Peer", "Mask", "WriteItem", "Region", "RemoteRegion",
    "aligned_empty", "Transfer", "TransferState", "wait_all", "TokenBucket", "parse_bandwidth",
    "TransportError", "PeerDeadError", "OpTimeout", "AuthError", "FrameError", "RemoteError",
    "BackendUnavailable", "ConfigCheck", "ConfigMismatch",
]
