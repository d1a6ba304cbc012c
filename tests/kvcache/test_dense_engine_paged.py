"""DenseEngine on the paged KV cache: the same greedy tokens as the dense-cache path it replaced
(`Model.prefill` + `Model.decode_step`), whole or chunked prefill; pages are freed as requests
finish and none leak; the table width follows the live lengths, not prompt + max_tokens."""
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.engine import DenseEngine, Request
from jkv.kvcache import OutOfPages
from jkv.sampling import SamplingParams
from models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3)


def _prompts(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, model.cfg.vocab_size, n)] for n in lengths]


def dense_greedy(model, ids, max_tokens, stop_ids=()):
    """Greedy tokens of the pre-paging engine path: whole prefill, dense cache, decode_step."""
    logits, kv = model.prefill(np.array([ids], np.int32), np.array([len(ids)], np.int32))
    cache = model.cache_from_prefill(kv, len(ids) + max_tokens)
    out = [int(jnp.argmax(logits[0]))]
    while len(out) < max_tokens and out[-1] not in stop_ids:
        logits, cache = model.decode_step(cache, np.array([out[-1]]), np.array([len(ids) + len(out) - 1]))
        out.append(int(jnp.argmax(logits[0])))
    return out[:-1] if out[-1] in stop_ids else out


@pytest.mark.parametrize("prefill_chunk", [4096, 8])
def test_greedy_tokens_equal_the_dense_cache_path(model, prefill_chunk):
    """Mixed lengths (1 to 37 tokens: one page to three, chunked into up to 5 chunks of 8), one row
    stopping early on a stop token, so rows finish at different steps."""
    prompts = _prompts(model, [1, 37, 12, 16])
    free_run = dense_greedy(model, prompts[2], 10)
    stop = free_run[3]
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * 4
    params[2] = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop])
    engine = DenseEngine(model, page_size=4, prefill_chunk=prefill_chunk)
    outs = engine.generate([Request(str(i), None, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    for b, (out, ids) in enumerate(zip(outs, prompts)):
        assert out.token_ids == dense_greedy(model, ids, 10, (stop,) if b == 2 else ()), f"row {b}"
    assert outs[2].finish_reason == "stop" and len(outs[2].token_ids) < 10
    assert engine.kv_cache.pages_in_use == 0, "pages leaked"


def test_pages_follow_live_requests_and_the_table_follows_live_lengths(model, monkeypatch):
    engine = DenseEngine(model, page_size=4)
    seen = []
    step = model.paged_decode_step

    def spy(kv_pages, table, tokens, positions):
        seen.append((engine.kv_cache.pages_in_use, table.shape[1], (table[0] == 0).all()))
        return step(kv_pages, table, tokens, positions)

    monkeypatch.setattr(model, "paged_decode_step", spy)
    prompts = _prompts(model, [3, 5])
    params = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)]
    engine.generate([Request(str(i), None, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    in_use = [s[0] for s in seen]
    assert in_use[0] == 1 + 2  # pages_for(3 + 1) + pages_for(5 + 1) at P=4: room for the token being written
    assert seen[1][2] and in_use[1] == 2, "the finished row's pages were not freed (or its row not idle)"
    assert in_use[-1] == 11  # row 1 at 44 tokens: pages grow with the live length
    widths = [s[1] for s in seen]
    assert widths[0] == 4 and widths[-1] == 16 and widths == sorted(widths)
    assert engine.kv_cache.pages_in_use == 0


def test_a_fixed_pool_too_small_for_the_batch_fails_before_prefill(model):
    engine = DenseEngine(model, page_size=4, num_pages=4)
    req = Request("r", None, _prompts(model, [10])[0], SamplingParams(max_tokens=8))
    with pytest.raises(OutOfPages, match="needs 5 free pages but only 3"):
        engine.generate([req])
    assert engine.kv_cache.pages_in_use == 0
    small = Request("s", None, _prompts(model, [3])[0], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.generate([small])[0].token_ids == dense_greedy(model, small.prompt_token_ids, 4)


def test_prefill_chunk_must_be_positive(model):
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        DenseEngine(model, prefill_chunk=0)


def test_llm_passes_page_size_and_prefill_chunk_to_the_engine(model):
    from jkv import LLM

    prompt = _prompts(model, [19], seed=2)[0]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    llm = LLM(model, kv_page_size=8, prefill_chunk=8)
    assert (llm._engine.page_size, llm._engine.prefill_chunk) == (8, 8)
    assert llm.generate(prompt, sp)[0].token_ids == dense_greedy(model, prompt, 5)
