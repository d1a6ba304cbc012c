"""A decode step compiles nothing: the decode worker compiles every program a step can run when a
batch's shape class (B, N_cap) first appears (decode_program.LayerPrograms.warm_up,
DecodePages.warm_up), so no XLA compile lands inside a timed step. smartgen's first step is the
first to run select / split / attend, the lookahead hint and landing pieces of new sizes; before
the warm-up those ~10 compiles sat inside it, in its time to second token (`make demo`).

XLA compiles are counted with jax's backend-compile event (fired for a compile and for a
persistent-cache hit alike), on the decode side's threads only (the engine thread and the
lookahead helper; the in-process prefill workers compile their own programs)."""
import threading

import numpy as np
import pytest
from jax import monitoring

from jkv.disagg import decode_pages
from jkv.disagg.decode_worker import DecodeWorker
from jkv.engine import Request
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Shape classes no other test of this package uses (B=3 at N_cap 768, B=2 at N_cap 1024), so the
# process has not compiled them before, whatever ran earlier.
STATIC_LENS = (520, 431, 610)
SUBMITTED_LENS = (900, 777)


class StepCompiles:
    """Counts the decode side's compiles inside and outside `DecodeWorker._decode_step`."""

    def __init__(self, monkeypatch):
        self.in_step: list[tuple[int, str]] = []
        self.outside: list[str] = []
        self._step = None
        self._engine = threading.get_ident()
        real = DecodeWorker._decode_step

        def decode_step(worker):
            self._step = len(worker.phases.steps)
            try:
                return real(worker)
            finally:
                self._step = None

        monkeypatch.setattr(DecodeWorker, "_decode_step", decode_step)
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kw):
        t = threading.current_thread()
        if event != COMPILE_EVENT or not (t.ident == self._engine or t.name.startswith("jkv-lookahead")):
            return
        name = kw.get("fun_name", "?")
        if self._step is None:
            self.outside.append(name)
        else:
            self.in_step.append((self._step, name))

    def close(self):
        monitoring.unregister_event_duration_listener(self._on_event)


@pytest.fixture(scope="module", params=["infinigen", "oracle"])
def setup(request, model, selectors, profiles):
    w = InProcessWorkers(model, selectors[request.param], 1)
    yield selectors[request.param], profiles[request.param], w
    w.close()


def test_smartgen_decode_steps_compile_nothing(model, setup, monkeypatch):
    sel, profile, workers = setup
    rng = np.random.default_rng(11)
    counter = StepCompiles(monkeypatch)
    try:
        decode = DecodeWorker(model, sel, TransferConfig(mode="smartgen", kr_fraction=0.3, max_blocks=16),
                              secret=SECRET, profile=profile)
        try:
            decode.connect(workers.addresses)
            # a static batch: every step of it, fetches (step 1), speculation, then all local
            prompts = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in STATIC_LENS]
            outs = decode.generate(make_requests(prompts, max_tokens=10, tag="c"))
            assert all(o.finish_reason == "length" for o in outs)
            assert sum(o.metrics.extra["on_demand_ratio"] for o in outs) > 0  # the remote path ran
            assert counter.outside  # the warm-up compiled this new shape class (the count is live)
            assert counter.in_step == []
            # continuous admission (submit / step) of a new shape class: its warm-up is at the drain
            done = []
            for i, n in enumerate(SUBMITTED_LENS):
                decode.submit(Request(f"s{i}", None, rng.integers(3, model.cfg.vocab_size, n).tolist(),
                                      SamplingParams(max_tokens=6, ignore_eos=True)), on_done=done.append)
            while decode.step(wait=0.5) or len(done) < len(SUBMITTED_LENS):
                pass
            assert [o.finish_reason for o in done] == ["length"] * len(SUBMITTED_LENS)
            assert counter.in_step == []
            assert decode.pages.cache.pages_in_use == 0 and decode.pool.live() == []
        finally:
            decode.close()
    finally:
        counter.close()


def test_upload_pieces_are_a_fixed_set_of_sizes():
    """Every landing batch splits into pieces of the log2(MAX_PIECE) + 1 sizes the warm-up compiles."""
    sizes = {1 << b for b in range(decode_pages.MAX_PIECE.bit_length())}
    for n in (1, 3, 255, 4096, 4097, 6144, 3 * 4096 + 5, 100_000):
        pieces = decode_pages.upload_pieces(n)
        assert sum(pieces) == n and set(pieces) <= sizes
        assert pieces == sorted(pieces, reverse=True)
