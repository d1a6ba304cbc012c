"""The start-up probe of the live engine that gives `--schedule`'s first cost model (jkv/serving/admission.py).

Before the engine thread starts, on the engine's own cache: one timed 16-token prefill chunk (the
program warm-up compiles) and one timed host-to-device load of one page (L2's copy-back; one
small program), each after an untimed run. They give proportional lines, c = seconds per
computed token and a = seconds per loaded token (intercepts 0), enough to order requests by
size; the live refit (`admission.Refit`) replaces them with least-squares lines from real loads
(L3 reads included) and real prefills. Every write goes to the null page (page 0: the scratch
page idle rows write), so no request's KV is touched. The probe is this small because every
compile at start-up costs tens of seconds on a loaded CPU (a probe of three prefill lengths and
two load sizes took 30 s for a 2-layer model at load average 35); L3 is not probed (a write to it
at start-up would count as a failure and pause L3 when it is down).
"""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from ..engine import bucket_prompt_len
from ..kvcache import bucket_pages
from ..kvcache.host_tier import load_pages
from ..scheduling.cost_model import CostModel

log = logging.getLogger(__name__)

PROMPT_TOKENS = 16


def _timed(run) -> float:
    """Seconds of run() (which returns something to block on), after one untimed run that compiles."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - t0


def probe_compute(model, kv) -> tuple[int, float]:
    """(16, seconds) of a 16-token prefill chunk into the null page."""
    n = PROMPT_TOKENS
    table = np.zeros((1, bucket_pages(1)), np.int32)  # the shape warm-up compiled (positions past it: null page)
    tokens = np.zeros((1, bucket_prompt_len(n)), np.int32)

    def run():
        logits, kv.kv = model.prefill_chunk(kv.kv, table, tokens, np.zeros(1, np.int32), np.array([n], np.int32))
        return np.asarray(logits)
    return n, _timed(run)


def probe_load(kv) -> tuple[int, float]:
    """(page tokens, seconds) of a host-to-device load of one page into the null page."""
    buffers = [np.zeros(kv.page_shape, kv.dtype)]

    def run():
        kv.kv = load_pages(kv.kv, [0], buffers)
        return kv.kv
    return kv.page_size, _timed(run)


def probe_cost_model(model, kv):
    """The cost model fitted from a probe of `model` on the PagedKVCache `kv` (see the module docstring)."""
    t0 = time.perf_counter()
    (loaded, t_load), (computed, t_comp) = probe_load(kv), probe_compute(model, kv)
    cost = CostModel(t_load / loaded, 0.0, t_comp / computed, 0.0, deployment=f"probe of {model.cfg.family}")
    log.info("cost model from a %.1f s probe: load %.3g s/token, prefill %.3g s/token (refitted while serving)",
             time.perf_counter() - t0, cost.a, cost.c)
    return cost
