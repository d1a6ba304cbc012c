"""`jkv serve --role all` as one replica spanning several processes (jax.distributed; issue 21 item 4).

    rank 0:   jkv serve --role all --tensor-parallel 4 --coordinator-address 10.0.0.1:8476 \\
                  --num-processes 2 --process-id 0      # HTTP, the scheduler, the step broadcast
    rank 1..: the same command with its --process-id    # no HTTP: follows rank 0's steps

The model and the paged KV cache are laid out over the global devices (TP over every device of
every process), so every jitted step is one SPMD program that every rank must enter with the same
inputs. Each rank runs its own copy of the paged engine (`PagedBatcher`), and the copies are kept
in lock-step the way sglang-jax keeps its schedulers: only rank 0 receives requests, and before
every engine iteration it broadcasts what its inbox delivered — admissions (request id, prompt
token ids, sampling params with the seed rank 0 drew, log-prob options) and cancellations — in one
fixed-shape i32[words] array (`StepChannel`: JSON bytes in a padded int32 buffer, several
broadcasts when a message is longer, so the collective's shape never changes). Every rank then
applies the same items and runs the same `_step()`: admission, page tables, positions, chunked
prefill, the decode batch and the sampled tokens follow deterministically (greedy and seeded
sampling alike run on the replicated logits on every rank). Each broadcast also carries a digest
of rank 0's engine state (tokens, positions, seats, pages in use) after its previous step; a rank
whose own differs stops with `MultiHostError` instead of stepping a diverged batch.

Liveness. Rank 0 broadcasts at least every 0.5 s (an empty step while idle), so a rank that dies
shows up within one step: gloo (CPU) fails the collective with "Connection closed by peer" (and
NCCL / ICI fail theirs), rank 0's engine thread fails every open request with `ReplicaLostError`
naming the replica, /ready and /health turn 503 / "degraded", and every later request gets a 503
with the same message: the replica must be restarted as a whole (a LeaderWorkerSet recreates the
group). A follower whose rank 0 dies fails its collective the same way and exits non-zero. On a
clean shutdown rank 0 broadcasts a stop step and every follower returns 0.

Concurrency. On rank 0, the HTTP event loop and the engine thread as in `ContinuousBatcher` (the
engine thread alone makes the broadcasts and touches the device). On a follower, the main thread
runs `FollowerBatcher.run()`; it starts no other thread.

Scope: the paged engine without host / remote prefix-cache tiers (their reads finish at times that
differ per rank); `check_multihost_serve` refuses the rest naming the flag.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading

import numpy as np

from ..multihost import MultiHost, MultiHostError
from ..sampling import SamplingParams
from .batcher import EngineRequest
from .paged_batcher import PagedBatcher

log = logging.getLogger(__name__)

MAGIC = 0x4A4B5631  # "JKV1": a buffer that does not start with it was not written by a StepChannel
HEADER_WORDS = 3  # magic, payload bytes in this broadcast, 1 when another broadcast continues it
DEFAULT_WORDS = 2048  # i32 words per broadcast (8 KiB, one collective every step): a step whose inbox
# holds more (long prompts: about 6 bytes a token) takes several broadcasts


class ReplicaLostError(RuntimeError):
    """A rank of a multi-host replica died or failed: no further step can run on any rank."""


def check_multihost_serve(cfg, mh: MultiHost, device_count: int | None = None) -> None:
    """Refuse a `jkv serve` config that cannot span processes (ValueError naming the flag);
    device_count: the global device count once jax.distributed is up (checks --tensor-parallel)."""
    if cfg.role != "all" or cfg.uses_disaggregation:
        what = "--disaggregation" if cfg.role == "all" else f"--role {cfg.role}"
        raise MultiHostError(f"{what} cannot span processes yet (--num-processes {mh.num_processes}); a multi-host "
                             "replica runs `jkv serve --role all` (the colocated paged engine); docs/scale.md")
    if cfg.batcher.kv_layout != "paged":
        raise MultiHostError(f"--kv-layout {cfg.batcher.kv_layout} cannot span processes: a multi-host replica runs the paged "
                             "engine (drop --kv-layout or pass --kv-layout paged)")
    if cfg.batcher.prefix_cache_host_bytes or cfg.batcher.prefix_cache_l3:
        flag = "--prefix-cache-host-bytes" if cfg.batcher.prefix_cache_host_bytes else "--prefix-cache-l3"
        raise MultiHostError(f"{flag} cannot be used in a multi-host replica: its reads finish at different times on "
                             "each rank, and every rank must admit the same requests at the same step; drop it")
    if device_count is not None and cfg.tensor_parallel != device_count:
        raise MultiHostError(f"--tensor-parallel {cfg.tensor_parallel} must equal the replica's global device count "
                             f"{device_count} ({mh.num_processes} processes): every device of every rank holds a "
                             "shard, so every rank takes part in every step")


class StepChannel:
    """Rank 0 -> every rank: one JSON-able message per engine iteration over fixed-shape i32[words]
    broadcasts (`multihost_utils.broadcast_one_to_all`), so no rank ever waits in a collective of
    another shape. Every rank calls `broadcast` the same number of times, in the same order."""

    def __init__(self, words: int = DEFAULT_WORDS):
        import jax

        if words <= HEADER_WORDS:
            raise ValueError(f"words={words} must be > {HEADER_WORDS} (the header)")
        self.words = words
        self.rank = jax.process_index()
        self.processes = jax.process_count()

    def broadcast(self, message: dict | None = None) -> dict:
        """Rank 0 passes its message, the others None; every rank returns rank 0's message.
        Raises ReplicaLostError when the collective fails (a rank died)."""
        capacity = 4 * (self.words - HEADER_WORDS)
        data = json.dumps(message, separators=(",", ":")).encode() if self.rank == 0 else b""
        chunks = [data[i:i + capacity] for i in range(0, len(data), capacity)] or [b""]
        received = []
        while True:
            chunk = chunks[len(received)] if self.rank == 0 else b""
            more = self.rank == 0 and len(received) + 1 < len(chunks)
            got = self._exchange(self._pack(chunk, more))
            if int(got[0]) != MAGIC:
                raise MultiHostError(f"step broadcast {got[:HEADER_WORDS].tolist()} does not start with the StepChannel "
                                     "header: every rank of a replica must run the same jkv version")
            received.append(got[HEADER_WORDS:].tobytes()[:int(got[1])])
            if not got[2]:
                return json.loads(b"".join(received))

    def _pack(self, chunk: bytes, more: bool) -> np.ndarray:
        buf = np.zeros(self.words, np.int32)
        buf[:HEADER_WORDS] = (MAGIC, len(chunk), int(more))
        body = np.frombuffer(chunk + b"\0" * (-len(chunk) % 4), np.int32)
        buf[HEADER_WORDS:HEADER_WORDS + len(body)] = body
        return buf

    def _exchange(self, buf: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        try:
            return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=self.rank == 0))
        except Exception as e:  # XLA reports a dead peer as a runtime error of the collective
            raise ReplicaLostError(
                f"the multi-host replica lost a rank: the step broadcast of rank {self.rank} to all "
                f"{self.processes} processes failed ({type(e).__name__}: {str(e)[:300]}); restart every rank of the "
                "replica") from e


def encode_request(req: EngineRequest) -> dict:
    """The fields of a request every rank needs to schedule it (not its emit callback)."""
    return dict(id=req.request_id, ids=list(req.prompt_token_ids), params=dataclasses.asdict(req.params),
                logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, prompt_only=req.prompt_only,
                prefix_cache=req.prefix_cache)


def decode_request(d: dict, emit) -> EngineRequest:
    return EngineRequest(d["id"], d["ids"], SamplingParams(**d["params"]), emit, logprobs=d["logprobs"],
                         prompt_logprobs=d["prompt_logprobs"], prompt_only=d["prompt_only"],
                         prefix_cache=d["prefix_cache"])


class _Replicated(PagedBatcher):
    """The paged engine plus what every rank of a replica shares: the channel and the state digest."""

    def __init__(self, model, config, metrics=None, channel: StepChannel | None = None):
        if config.schedule != "fifo":
            # every rank must admit in rank 0's order; the cost-model policies time loads and
            # prefills on each rank (and EDF reads local arrival times), so their picks would diverge
            log.warning("multi-host replica: admission is FIFO on every rank (--schedule %s is for a "
                        "single-process server)", config.schedule)
            config = dataclasses.replace(config, schedule="fifo", cost_model=None)
        super().__init__(model, config, metrics)
        self.channel = channel or StepChannel()

    def state_digest(self) -> list[int]:
        """u32[4] as ints: the tokens, positions, seats and pages in use of this rank's engine."""
        seats = [run.key if run is not None else None for run in self._slots]
        state = (self._tokens.tolist(), self._positions.tolist(), seats, self.kv.pages_in_use)
        return np.frombuffer(hashlib.blake2b(repr(state).encode(), digest_size=16).digest(), np.uint32).tolist()


class LeaderBatcher(_Replicated):
    """Rank 0: the HTTP server's engine; broadcasts each iteration's inbox before stepping it."""

    def __init__(self, model, config, metrics=None, channel: StepChannel | None = None):
        super().__init__(model, config, metrics, channel)
        self._lost: str | None = None
        self._lost_lock = threading.Lock()  # a submit never lands in the inbox after the failure drained it

    def submit(self, req: EngineRequest):
        with self._lost_lock:
            if self._lost is not None:
                raise ReplicaLostError(self._lost)
            if req.params.seed is None:  # drawn here, once, so every rank samples the same stream
                req.params = dataclasses.replace(req.params, seed=int(np.random.randint(0, 2**31)))
            super().submit(req)

    def readiness(self) -> tuple[bool, str | None]:
        if self._lost is not None:
            return False, self._lost
        return super().readiness()

    def health(self) -> dict:
        return {"multihost": {"processes": self.channel.processes, "rank": self.channel.rank,
                              "lost": self._lost}}

    def _drain_inbox(self, block: bool):
        items = self._take_inbox(block)
        wire = [[kind, encode_request(payload) if kind == "submit" else payload]
                for kind, payload in items if kind in ("submit", "cancel")]
        try:
            self.channel.broadcast({"items": wire, "state": self.state_digest()})
        finally:  # also when it fails: then the failure path must find these requests to fail them
            if items:
                self._apply_inbox(items)

    def _crash_message(self, e: Exception) -> str:
        """Any failed step ends the replica (a rank died, or the ranks may have left a collective at
        different points): remember why, so every later submit and /ready says so."""
        message = str(e) if isinstance(e, ReplicaLostError) else (
            f"the multi-host replica failed in a step on rank 0 ({type(e).__name__}: {str(e)[:300]}); a rank may have "
            "died: restart every rank of the replica")
        with self._lost_lock:
            self._lost = message
        return message

    def _loop(self):
        try:
            super()._loop()
        except Exception:  # logged, every open request failed with the reason, which _lost keeps
            return
        try:
            self.channel.broadcast({"stop": True})
        except ReplicaLostError as e:
            log.warning("multi-host: could not send the stop step: %s", e)
            return
        log.info("multi-host: sent the stop step to ranks 1..%d", self.channel.processes - 1)


class FollowerBatcher(_Replicated):
    """A rank > 0: no HTTP, no inbox of its own; `run()` steps whatever rank 0 broadcasts."""

    def run(self) -> int:
        """Follow rank 0's steps until its stop step (returns 0). Raises ReplicaLostError when rank 0
        or another rank dies, MultiHostError when this rank's engine state diverged from rank 0's."""
        self.kv = self._new_cache()
        self._start_scheduler()  # FIFO, as on rank 0 (see _Replicated)
        steps = 0
        try:
            while True:
                msg = self.channel.broadcast(None)
                if msg.get("stop"):
                    log.info("multi-host: rank %d got the stop step after %d steps", self.channel.rank, steps)
                    return 0
                mine = self.state_digest()
                if msg["state"] != mine:
                    raise MultiHostError(f"rank {self.channel.rank}'s engine state diverged from rank 0's before step "
                                         f"{steps} (digest {mine} != {msg['state']}): every rank must run the same "
                                         "jkv version, model and flags")
                items = [(kind, decode_request(p, _drop) if kind == "submit" else p) for kind, p in msg["items"]]
                if items:
                    self._apply_inbox(items)
                self._step()
                steps += 1
        finally:
            self.kv.close()


def _drop(event) -> None:
    """A follower's requests answer nobody: rank 0 sends the responses."""
