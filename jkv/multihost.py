"""Multi-host replicas: one model laid out over the devices of several processes (jax.distributed).

    mh = MultiHost("10.0.0.1:8476", num_processes=2, process_id=0)   # or MultiHost.from_env()
    initialize(mh)                       # before anything touches a device
    llm = LLM("smollm2-135m-instruct", tensor_parallel=jax.device_count())   # every rank
    outs = llm.generate(prompts)         # every rank, the same prompts; rank 0 prints

Every process of a replica runs the same program over one `("data", "tensor")` mesh of the global
devices (JAX's multi-controller model, as in sglang-jax): the params and the KV cache are split
across processes, and XLA's collectives cross them (gloo on CPU, NCCL / ICI on accelerators).
Each rank runs every step, so every rank must step the same batch: `LLM.generate` checks that
with one fixed-shape all-gather of a digest of the batch (`agree_on_batch`) before the first
cross-host step, and every rank refuses a batch that differs on any rank (none hangs in a
collective its peers never enter).

The coordinator (rank 0's address) comes from flags (`jkv generate --coordinator-address
--num-processes --process-id`) or the environment (`JKV_COORDINATOR_ADDRESS`, `JKV_NUM_PROCESSES`,
`JKV_PROCESS_ID`; deploy/k8s/leaderworkerset.yaml maps the LeaderWorkerSet's variables onto them).

Scope today: the colocated engine (`LLM`, `jkv generate`) and `jkv serve --role all`
(jkv/serving/replica.py: rank 0 broadcasts each engine step's admissions and cancellations). The
SmartGen prefill/decode workers run in one process each (docs/scale.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import numpy as np

log = logging.getLogger(__name__)

ENV = {"coordinator_address": "JKV_COORDINATOR_ADDRESS", "num_processes": "JKV_NUM_PROCESSES",
       "process_id": "JKV_PROCESS_ID"}


class MultiHostError(ValueError):
    """A multi-host setting or batch that the ranks of a replica cannot run together."""


@dataclasses.dataclass(frozen=True)
class MultiHost:
    """One rank of a replica: the coordinator's host:port (rank 0 listens there), the number of
    processes, and this process's rank in [0, num_processes)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    timeout_s: int = 300  # how long initialize waits for every rank to join

    def __post_init__(self):
        host, _, port = str(self.coordinator_address).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MultiHostError(f"coordinator_address={self.coordinator_address!r} must be host:port (rank 0's "
                                 "address and a free port, e.g. 10.0.0.1:8476)")
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise MultiHostError(f"num_processes={self.num_processes!r} must be an int >= 1")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise MultiHostError(f"process_id={self.process_id!r} must be in [0, {self.num_processes}) "
                                 f"(num_processes={self.num_processes})")

    @classmethod
    def from_values(cls, coordinator_address: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, environ=None) -> "MultiHost | None":
        """From explicit values, each falling back to its JKV_* variable; None when no coordinator
        is given anywhere (a single-process run). Raises MultiHostError for a partial setting."""
        environ = os.environ if environ is None else environ
        given = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
        for name, var in ENV.items():
            if given[name] is None and environ.get(var):
                given[name] = environ[var]
        if given["coordinator_address"] is None:
            extra = [n for n in ("num_processes", "process_id") if given[n] is not None]
            if extra:
                raise MultiHostError(f"{extra[0]} is set but no coordinator address: give --coordinator-address "
                                     f"(or {ENV['coordinator_address']}) too")
            return None
        missing = [n for n in ("num_processes", "process_id") if given[n] is None]
        if missing:
            raise MultiHostError(f"coordinator_address={given['coordinator_address']!r} needs {missing[0]} too "
                                 f"(--{missing[0].replace('_', '-')} or {ENV[missing[0]]})")
        try:
            n, rank = int(given["num_processes"]), int(given["process_id"])
        except ValueError:
            raise MultiHostError(f"num_processes={given['num_processes']!r} and process_id={given['process_id']!r} "
                                 "must be integers") from None
        return cls(str(given["coordinator_address"]), n, rank)


def initialize(mh: MultiHost) -> None:
    """Join the replica: jax.distributed over the coordinator, with gloo collectives for CPU devices
    (XLA's CPU client has no cross-process collectives otherwise). Call before any JAX computation;
    returns once every rank has joined (or raises after mh.timeout_s)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client reads it
    jax.distributed.initialize(coordinator_address=mh.coordinator_address, num_processes=mh.num_processes,
                               process_id=mh.process_id, initialization_timeout=mh.timeout_s)
    log.info("multi-host: rank %d of %d joined %s; %d local of %d global devices", jax.process_index(),
             jax.process_count(), mh.coordinator_address, jax.local_device_count(), jax.device_count())


def batch_digest(batch) -> np.ndarray:
    """u32[4]: a digest of a batch (any repr-stable value, e.g. token ids and sampling params)."""
    return np.frombuffer(hashlib.blake2b(repr(batch).encode(), digest_size=16).digest(), np.uint32).copy()


def agree_on_batch(batch) -> None:
    """Every rank calls this with its batch; raises MultiHostError on every rank when any differs
    (one fixed-shape all-gather of u32[4] digests, so it never hangs on a shape mismatch).
    A no-op in a single process."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digests = np.asarray(multihost_utils.process_allgather(batch_digest(batch))).reshape(jax.process_count(), -1)
    differ = [r for r in range(len(digests)) if not np.array_equal(digests[r], digests[0])]
    if differ:
        raise MultiHostError(f"ranks {differ} of a {len(digests)}-process replica got a different batch than rank 0: "
                             "every rank must call generate with the same prompts and sampling params in the "
                             "same order (each rank runs every step of the one SPMD program)")
