"""`LLM(enable_prefix_caching=True)` / `DenseEngine`: a batch sharing a system prompt and a
multi-turn follow-up reuse cached pages (prefill from the first uncached token, a per-row start)
and give the tokens of the engine without prefix caching; no page leaks."""
import numpy as np

from jkv import LLM, SamplingParams
from jkv.engine import DenseEngine, Request
from models import tiny_model

PAGE = 8


def test_dense_engine_prefix_caching_equals_no_cache_and_reuses_pages():
    model = tiny_model("llama", seed=5)
    plain = LLM(model, kv_page_size=PAGE)
    engine = DenseEngine(model, page_size=PAGE, num_pages=64, prefill_chunk=32, enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(3, 301, 3 * PAGE + 2)]
    prompts = [system + [int(t) for t in rng.integers(3, 301, n)] for n in (1, 9, 45)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)

    def run(batch):
        return [o.token_ids for o in engine.generate([Request(str(i), p, p, sp) for i, p in enumerate(batch)])]

    want = [o.token_ids for o in plain.generate(prompts, sp)]
    assert run(prompts[:1]) == want[:1]  # alone: fills the cache
    assert engine.kv_cache.stats()["prefix_hit_tokens"] == 0
    assert run(prompts[1:]) == want[1:]  # both start at the system prompt's 3 cached pages
    assert engine.kv_cache.stats()["prefix_hit_tokens"] == 2 * 3 * PAGE
    turn2 = prompts[0] + want[0] + [7, 8, 9]
    hits = engine.kv_cache.stats()["prefix_hit_tokens"]
    assert run([turn2]) == [plain.generate(turn2, sp)[0].token_ids]
    # the first answer's pages are reused too: (27 prompt + 9 generated tokens written) // 8 pages
    assert engine.kv_cache.stats()["prefix_hit_tokens"] - hits == (len(prompts[0]) + 9) // PAGE * PAGE
    assert engine.kv_cache.pages_in_use == 0 and engine.kv_cache.pages_cached > 0
    engine.kv_cache.allocator.check()
    engine.kv_cache.clear_prefix_cache()
    assert engine.kv_cache.pages_free == engine.kv_cache.allocator.capacity
