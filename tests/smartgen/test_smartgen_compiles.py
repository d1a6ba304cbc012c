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

from jkv.disagg import decode_pages, decode_program
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.selectors import load_selector, save_selector
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


def test_a_worker_with_an_equal_selector_shares_the_programs_and_its_steps_compile_nothing(model, setup,
                                                                                          monkeypatch, tmp_path):
    """A second decode worker whose selector is a new object of the same value (rebuilt from the
    file a prefill worker or `jkv serve --selector-file` loads) gets the first one's compiled layer
    programs (decode_program.programs_for) and decodes the same tokens; its own warm-up still runs
    what is its own (its selector's select, which the lookahead calls for Oracle), so none of that
    compiles inside a step either."""
    sel, profile, workers = setup
    save_selector(sel, tmp_path / "selector.pkl")
    twin = load_selector(tmp_path / "selector.pkl")
    assert twin is not sel
    rng = np.random.default_rng(13)
    prompts = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in STATIC_LENS]  # the first test's class
    transfer = TransferConfig(mode="smartgen", kr_fraction=0.3, max_blocks=16)
    tokens = []
    for i, selector in enumerate((sel, twin)):
        counter = StepCompiles(monkeypatch) if selector is twin else None
        decode = DecodeWorker(model, selector, transfer, secret=SECRET, profile=profile)
        try:
            decode.connect(workers.addresses)
            tokens.append([o.token_ids for o in decode.generate(make_requests(prompts, max_tokens=4, tag=f"t{i}"))])
            if counter is not None:
                assert decode.programs is decode_program.programs_for(model.cfg, sel, model.kv_sharding)
                assert counter.in_step == []
        finally:
            decode.close()
            if counter is not None:
                counter.close()
    assert tokens[0] == tokens[1]


def test_upload_pieces_are_a_fixed_set_of_sizes():
    """Every landing batch splits into pieces of the log2(MAX_PIECE) + 1 sizes the warm-up compiles."""
    sizes = {1 << b for b in range(decode_pages.MAX_PIECE.bit_length())}
    for n in (1, 3, 255, 4096, 4097, 6144, 3 * 4096 + 5, 100_000):
        pieces = decode_pages.upload_pieces(n)
        assert sum(pieces) == n and set(pieces) <= sizes
        assert pieces == sorted(pieces, reverse=True)


def test_an_auto_sized_pool_grows_at_hand_in_and_its_steps_still_compile_nothing(model, setup, monkeypatch):
    """No page_config: the device pool starts small (decode_pages.FIRST_DECODE_TOKENS) and doubles
    when a request handed in does not fit, here while another request is decoding. The running
    request keeps its pages and its tokens; its steps at the grown size, and the batch the new one
    joins, were compiled at the hand-in, not inside a step."""
    sel, profile, workers = setup
    rng = np.random.default_rng(12)
    lens = (700, 600)  # 45 + 39 pages of 16 tokens: more than the first pool's 64 (set below)
    prompts = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in lens]
    fixed = DecodeWorker(model, sel, TransferConfig(mode="smartgen", kr_fraction=0.3, max_blocks=16), secret=SECRET,
                         profile=profile, page_config=decode_pages.PageConfig(num_pages=257))
    try:  # the reference: the same requests on a pool that never grows
        fixed.connect(workers.addresses)
        want = [o.token_ids for o in fixed.generate(make_requests(prompts, max_tokens=12, tag="w"))]
    finally:
        fixed.close()
    counter = StepCompiles(monkeypatch)
    monkeypatch.setattr(decode_pages, "FIRST_DECODE_TOKENS", 1024)  # 64 pages: these two requests outgrow it
    decode = DecodeWorker(model, sel, TransferConfig(mode="smartgen", kr_fraction=0.3, max_blocks=16), secret=SECRET,
                          profile=profile)
    try:
        decode.connect(workers.addresses)
        first = decode.pages.num_pages
        assert first == decode_pages.FIRST_DECODE_TOKENS // 16 + 1
        done = []
        decode.submit(make_requests(prompts[:1], max_tokens=12, tag="g")[0], on_done=done.append)
        while not decode._running or len(decode.phases.steps) < 3:  # the first request is decoding
            decode.step(wait=0.5)
        decode.submit(make_requests(prompts[1:], max_tokens=12, tag="h")[0], on_done=done.append)
        while decode.step(wait=0.5) or len(done) < 2:
            pass
        assert decode.pages.num_pages == 2 * first  # grew once, by doubling
        assert sorted(o.request_id for o in done) == ["g0", "h0"]
        assert [o.token_ids for o in sorted(done, key=lambda o: o.request_id)] == want
        assert counter.in_step == []
        assert decode.pages.cache.pages_in_use == 0 and decode.pool.live() == []
    finally:
        decode.close()
        counter.close()
