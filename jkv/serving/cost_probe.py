"""The start-up probe of the live engine that fits `--schedule`'s cost model (jkv/serving/admission.py).

Before the engine thread starts, on the engine's own cache: prefills of three lengths (16 tokens,
one chunk, two chunks, each run once to compile and once timed) give the compute line, and page
loads of 1 and 8 pages give the load line: from L3 when one is configured (probe pages written
under random keys, then read back through the tier's loader, the path a request's prefetch takes),
else host-to-device copies (L2). Every write goes to the null page (page 0: the scratch page idle
rows write), so no request's KV is touched. A probe of a tiny model takes well under a second
after compilation; a real model's few seconds are paid once, at start-up.
"""
from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np

from ..engine import bucket_prompt_len
from ..kvcache import bucket_pages
from ..kvcache.host_tier import load_pages
from .admission import fit_probe

log = logging.getLogger(__name__)

LOAD_PAGES = (1, 8)


def _timed(run) -> float:
    """Seconds of run() (which returns something to block on), after one untimed run that compiles."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - t0


def probe_compute(model, kv, prefill_chunk: int) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of chunked prefills of three lengths into the null page."""
    samples = []
    for n in sorted({16, prefill_chunk, 2 * prefill_chunk}):
        width = bucket_pages(kv.page_cfg.pages_for(n))
        table = np.zeros((1, width), np.int32)

        def run(n=n, table=table):
            logits = None
            for start in range(0, n, prefill_chunk):
                c = min(prefill_chunk, n - start)
                tokens = np.zeros((1, min(bucket_prompt_len(c), prefill_chunk)), np.int32)
                logits, kv.kv = model.prefill_chunk(kv.kv, table, tokens, np.array([start], np.int32),
                                                    np.array([c], np.int32))
            return np.asarray(logits)
        samples.append((n, _timed(run)))
    return samples


def probe_loads(kv) -> tuple[str, list[tuple[int, float]]]:
    """(tier, [(tokens, seconds)]) of loading LOAD_PAGES pages: an L3 read when the cache has an L3
    tier that answers, else a host-to-device copy into the null page."""
    P = kv.page_size
    if kv.remote is not None:
        samples = _probe_remote(kv)
        if samples:
            return "l3", samples
    samples = []
    for k in LOAD_PAGES:
        buffers = [np.zeros(kv.page_shape, kv.dtype) for _ in range(k)]

        def run(k=k, buffers=buffers):
            kv.kv = load_pages(kv.kv, [0] * k, buffers)
            return kv.kv
        samples.append((k * P, _timed(run)))
    return "l2", samples


def _probe_remote(kv) -> list[tuple[int, float]]:
    """Timed L3 reads of probe pages written under random keys (none when L3 fails: it is retried
    by the serving path; the model then starts from the L2 line and is refitted from real reads)."""
    tier, P = kv.remote, kv.page_size
    keys = [os.urandom(16) for _ in range(max(LOAD_PAGES))]
    if tier.put_pages(np.zeros((len(keys), *kv.page_shape), kv.dtype), keys) < len(keys):
        return []
    samples = []
    for k in LOAD_PAGES:
        for _attempt in range(2):  # the first read also opens connections; the second is the sample
            t0 = time.perf_counter()
            pre = tier.prefetch(keys[:k], 0)
            if pre is None:
                return []
            try:
                pages = pre.future.result(timeout=tier.op_timeout_s)
            except Exception:
                return []
            if len(pages) < k:
                return []
        samples.append((k * P, time.perf_counter() - t0))
    return samples


def probe_cost_model(model, kv, prefill_chunk: int):
    """The cost model fitted from a probe of `model` on the PagedKVCache `kv` (see the module docstring)."""
    t0 = time.perf_counter()
    tier, loads = probe_loads(kv)
    computes = probe_compute(model, kv, prefill_chunk)
    cost = fit_probe(loads, computes, deployment=f"probe of {model.cfg.family} ({tier} loads)")
    log.info("cost model from a %.1f s probe: load %.3g s/token + %.3g s (%s), prefill %.3g s/token + %.3g s",
             time.perf_counter() - t0, cost.a, cost.b, tier, cost.c, cost.d)
    return cost
