"""The start-up probe of the live engine that fits `--schedule`'s cost model (jkv/serving/admission.py).

Before the engine thread starts, on the engine's own cache: prefills of the two shortest prompt
buckets (16 and 32 tokens: the first is compiled by warm-up anyway, the second is one small
program; each run once untimed and once timed) give the compute line, and host-to-device loads of
1 and 8 pages (L2's copy-back) the load line. Every write goes to the null page (page 0: the
scratch page idle rows write), so no request's KV is touched. The probe is kept this small
because a start-up on a loaded CPU pays every compile for many seconds; L3 is not probed (a write
to it at start-up would also count as a failure and pause L3 when it is down). The live refit
(`admission.Refit`) then replaces both lines from real loads, L3 reads included, and real
prefills.
"""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from ..engine import bucket_prompt_len
from ..kvcache import bucket_pages
from ..kvcache.host_tier import load_pages
from .admission import fit_probe

log = logging.getLogger(__name__)

LOAD_PAGES = (1, 8)
PROMPT_TOKENS = (16, 32)


def _timed(run) -> float:
    """Seconds of run() (which returns something to block on), after one untimed run that compiles."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - t0


def probe_compute(model, kv) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of single-chunk prefills of 16 and 32 tokens into the null page."""
    samples = []
    for n in PROMPT_TOKENS:
        table = np.zeros((1, bucket_pages(kv.page_cfg.pages_for(n))), np.int32)
        tokens = np.zeros((1, bucket_prompt_len(n)), np.int32)

        def run(n=n, table=table, tokens=tokens):
            logits, kv.kv = model.prefill_chunk(kv.kv, table, tokens, np.zeros(1, np.int32), np.array([n], np.int32))
            return np.asarray(logits)
        samples.append((n, _timed(run)))
    return samples


def probe_loads(kv) -> list[tuple[int, float]]:
    """(tokens, seconds) of host-to-device loads of LOAD_PAGES pages into the null page."""
    samples = []
    for k in LOAD_PAGES:
        buffers = [np.zeros(kv.page_shape, kv.dtype) for _ in range(k)]

        def run(k=k, buffers=buffers):
            kv.kv = load_pages(kv.kv, [0] * k, buffers)
            return kv.kv
        samples.append((k * kv.page_size, _timed(run)))
    return samples


def probe_cost_model(model, kv):
    """The cost model fitted from a probe of `model` on the PagedKVCache `kv` (see the module docstring)."""
    t0 = time.perf_counter()
    cost = fit_probe(probe_loads(kv), probe_compute(model, kv), deployment=f"probe of {model.cfg.family}")
    log.info("cost model from a %.1f s probe: load %.3g s/token + %.3g s, prefill %.3g s/token + %.3g s",
             time.perf_counter() - t0, cost.a, cost.b, cost.c, cost.d)
    return cost
