"""The prefill role's own prefix cache (jkv/disagg/prefill_cache.py; issue 19 item 3).

Multi-turn conversations through real prefill workers (TCP on loopback) with and without their
prefix cache: the greedy tokens are equal in every transfer mode, with the decode side's prefix
cache on, off, or emptied between turns (then every row the decode side lacks is pushed from the
prefill side's cache), with 1 and 2 prefill workers, and with compressed KV; the follow-up's
prefill computes only the new tokens (the worker's counters); a tiny budget, requests sharing
pages in one batch and a cancelled request leak no page and never give wrong KV."""
import threading

import numpy as np
import pytest

from jkv.compression.policy import CompressionConfig, CompressionPolicy
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.prefill_cache import PrefillPrefixCache
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET, InProcessWorkers, make_requests

P = 16
TURN1_LENS = (130, 75)  # not page multiples: the partial last page is recomputed
NEW_TOKENS = 24
BUDGET = 4096


@pytest.fixture(scope="module", params=[1, 2], ids=["1prefill", "2prefill"])
def clusters(request, model, selectors):
    """(cached, plain): prefill workers with and without their prefix cache."""
    cached = InProcessWorkers(model, selectors["infinigen"], request.param, prefix_cache_tokens=BUDGET)
    plain = InProcessWorkers(model, selectors["infinigen"], request.param)
    yield cached, plain
    for w in (cached, plain):
        w.close()
        assert all(x.held() == [] and x.pool.bytes_in_use == 0 for x in w.workers)
    for x in cached.workers:
        check_cache(x.prefix_cache)


class OneWorker(InProcessWorkers):
    """InProcessWorkers around one worker built here (a serving wrapper)."""

    def __init__(self, worker):
        self.workers, self.addresses = [worker], [worker.listen()]
        self.threads = [threading.Thread(target=worker.run, daemon=True)]
        self.threads[0].start()


def check_cache(cache: PrefillPrefixCache):
    """No plan holds a page after its prefill: every page is free or evictable."""
    cache.allocator.check()
    assert cache.allocator.num_used == 0


def decode(model, selectors, profiles, workers, mode, prefix_caching, name, **kw):
    d = DecodeWorker(model, selectors["infinigen"], TransferConfig(mode=mode, kr_fraction=0.3, max_blocks=16),
                     secret=SECRET, profile=profiles["infinigen"], prefix_caching=prefix_caching, name=name, **kw)
    d.connect(workers.addresses)
    return d


def turns(model, seed=19):
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in TURN1_LENS]
    return first, [rng.integers(3, model.cfg.vocab_size, NEW_TOKENS).tolist() for _ in TURN1_LENS]


def counters(workers) -> dict:
    """The prefill caches' counters, summed over the workers."""
    out = {}
    for w in workers.workers:
        for k, v in w.prefix_cache.stats().items():
            out[k] = out.get(k, 0) + v
    return out


def conversation(model, selectors, profiles, workers, mode, decode_prefix, evict, tag, **kw):
    """Two turns through one decode worker; returns (turn-1 outputs, turn-2 outputs, turn-2 prompts).
    evict: the decode side drops its prefix cache between the turns."""
    d = decode(model, selectors, profiles, workers, mode, decode_prefix, f"decode-{tag}", **kw)
    try:
        first, new = turns(model)
        one = d.generate(make_requests(first, tag=f"{tag}1-"))
        if evict:
            d.pages.cache.clear_prefix_cache()
        second = [p + o.token_ids + m for p, o, m in zip(first, one, new)]
        two = d.generate(make_requests(second, tag=f"{tag}2-"))
        assert all(o.finish_reason == "length" for o in one + two), [o.metrics.extra.get("error") for o in one + two]
        assert d.pool.live() == [] and d.pages.cache.pages_in_use == 0
        return one, two, second
    finally:
        d.close()


def empty_caches(workers):
    """Each test starts from empty prefill caches (the module's workers outlive a test; no prefill
    runs between tests)."""
    for w in workers.workers:
        w.prefix_cache.allocator.clear_cache()


@pytest.mark.parametrize("mode,decode_side", [("full", "decode-cache"), ("full", "no-decode-cache"),
                                              ("partial", "decode-evicts"), ("smartgen", "decode-cache"),
                                              ("smartgen", "no-decode-cache")])
def test_follow_up_tokens_identical_and_only_new_tokens_computed(model, selectors, profiles, clusters, mode,
                                                                  decode_side):
    cached, plain = clusters
    empty_caches(cached)
    decode_prefix, evict = decode_side != "no-decode-cache", decode_side == "decode-evicts"
    before = counters(cached)
    one, two, second = conversation(model, selectors, profiles, cached, mode, decode_prefix, evict, "c")
    after = counters(cached)
    ref_one, ref_two, _ = conversation(model, selectors, profiles, plain, mode, decode_prefix, evict, "p")
    assert [o.token_ids for o in one] == [o.token_ids for o in ref_one]
    assert [o.token_ids for o in two] == [o.token_ids for o in ref_two]
    first_lens = [len(o.prompt_token_ids) for o in one]
    computed = after["prefill_computed_tokens"] - before["prefill_computed_tokens"]
    hits = after["prefill_prefix_hit_tokens"] - before["prefill_prefix_hit_tokens"]
    if len(cached.workers) == 1:  # one worker prefilled both turns: the follow-up hit every full page of turn 1
        assert hits == sum(n // P * P for n in first_lens)
        assert computed == sum(first_lens) + sum(len(s) - n // P * P for s, n in zip(second, first_lens))
    else:  # the second turn may land on the other worker; nothing computed twice on one worker
        assert computed + hits == sum(first_lens) + sum(len(s) for s in second)
    if not decode_prefix or evict:  # the decode side lacked the prefix: its rows crossed from the cache
        row = 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4
        moved = [sum(o.metrics.extra["bytes"][k] for k in ("proactive", "speculative", "on_demand")) for o in two]
        assert all(m > n // P * P * row * (0.99 if mode == "full" else 0.0) for m, n in zip(moved, first_lens))
    for w in cached.workers:
        check_cache(w.prefix_cache)


def test_compressed_follow_up_uses_the_cache_and_matches(model, selectors, profiles, clusters):
    """KVServe: the prefill cache holds exact KV (stored before the codec overwrites the host copy),
    so a compressed request uses and feeds it and its tokens equal the run without it."""
    cached, plain = clusters
    empty_caches(cached)
    spec = "hadamard+kivi2g32+zstd3"
    before = counters(cached)
    outs = {}
    for name, workers in (("c", cached), ("p", plain)):
        policy = CompressionPolicy(CompressionConfig(spec))
        one, two, _ = conversation(model, selectors, profiles, workers, "smartgen", False, False, f"z{name}",
                                   compression=policy)
        assert all(o.metrics.extra["compression"] == spec for o in one + two)
        outs[name] = [o.token_ids for o in one + two]
    assert outs["c"] == outs["p"]
    if len(cached.workers) == 1:
        assert counters(cached)["prefill_prefix_hit_tokens"] - before["prefill_prefix_hit_tokens"] == \
            sum(n // P * P for n in TURN1_LENS)


def test_tiny_budget_shared_batch_cancel_and_metrics(model, selectors, profiles):
    """A 4-page prefill cache (evicting all the time) serving requests that share pages in one
    batch and a request cancelled before its hand-off: tokens equal workers without the cache, no
    page stays referenced, and /metrics of the serving wrapper shows tier="prefill" hits and the
    computed tokens."""
    from jkv.serving.disagg_prefill import ServingPrefillWorker
    from jkv.serving.metrics import PrefillMetrics
    from tests.smartgen.test_smartgen_admission import Recorder, run_until

    metrics = PrefillMetrics()
    worker = ServingPrefillWorker(model, selectors["infinigen"], "prefill-tiny", secret=SECRET, metrics=metrics,
                                  prefix_cache_tokens=4 * P)
    cached = OneWorker(worker)
    plain = InProcessWorkers(model, selectors["infinigen"], 1)
    d = decode(model, selectors, profiles, cached, "smartgen", False, "decode-tiny")
    ref = decode(model, selectors, profiles, plain, "smartgen", False, "decode-tiny-ref")
    try:
        rng = np.random.default_rng(5)
        stem = rng.integers(3, model.cfg.vocab_size, 3 * P + 3).tolist()
        tails = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (5, 30, 17)]
        rounds = [[stem + tails[0], stem + tails[1]], [stem + tails[1] + tails[2], stem[:P + 4] + tails[2]],
                  [stem + tails[0] + tails[1], stem + tails[2]]]
        for i, prompts in enumerate(rounds):  # each batch shares the stem's pages
            rec = Recorder()
            reqs = make_requests(prompts + [stem + tails[2] + tails[0]], tag=f"b{i}-")
            for r in reqs:
                d.submit(r, on_token=rec.on_token, on_done=rec.on_done)
            assert d.cancel(reqs[-1].request_id)  # before its hand-off: its prefill may be running
            run_until(d, lambda: len(rec.outputs) == len(reqs))
            want = ref.generate(make_requests(prompts, tag=f"b{i}-"))
            assert [rec.outputs[r.request_id].token_ids for r in reqs[:-1]] == [o.token_ids for o in want]
            assert rec.outputs[reqs[-1].request_id].finish_reason == "error"
        run_until(d, lambda: worker.held() == [])
        check_cache(worker.prefix_cache)
        s = worker.prefix_cache.stats()
        assert s["prefill_prefix_hit_tokens"] > 0 and s["prefill_prefix_evictions"] > 0
        text = metrics.render().decode()
        assert f'jkv_prefix_cache_hit_tokens_total{{tier="prefill"}} {float(s["prefill_prefix_hit_tokens"])}' in text
        assert f'jkv_prefill_computed_tokens_total {float(s["prefill_computed_tokens"])}' in text
    finally:
        d.close()
        ref.close()
        cached.close()
        plain.close()
