"""Prefix caching through HTTP on the shared `jkv serve --role all` server (tiny checkpoint, prefix
caching on by default): a shared system prompt and a multi-turn conversation give the greedy
answers of `LLM.generate` (which has no prefix cache), the prefix-cache metrics move, and the
startup log names the cache."""
import asyncio

import openai

from conftest import metric
from jkv import SamplingParams

SYSTEM = ("You are a careful assistant for the jkv project. Answer briefly, name the files you rely on, "
          "and say when you do not know. The engine keeps KV in pages of sixteen tokens.")


def _chat(llm, messages, max_tokens):
    return llm.generate(messages, SamplingParams(max_tokens=max_tokens))[0].text


def test_shared_system_prompt_and_multi_turn_chat_equal_llm_generate_and_hit_the_cache(live, tiny_llm):
    hits = lambda: metric(live.url, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"})  # noqa: E731
    assert "prefix caching on (jkv:" in "".join(live.log)
    assert len(tiny_llm.encode_prompt([{"role": "system", "content": SYSTEM}])) >= 3 * 16
    before = hits()
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page?"}]
    r = c.chat.completions.create(model="tiny", messages=first, max_tokens=12, temperature=0)
    answer = r.choices[0].message.content
    assert answer == _chat(tiny_llm, first, 12)

    questions = ["Where is the allocator?", "How big is a page?", "Who evicts pages?", "What is L2?"]

    async def ask(ac, q):  # concurrent users behind the same system prompt
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        s = await ac.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

    async def main():
        ac = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*(ask(ac, q) for q in questions))

    got = asyncio.run(main())
    assert got == [_chat(tiny_llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], 10)
                   for q in questions]
    after_shared = hits()
    assert after_shared - before >= 4 * 3 * 16  # each shared at least the system prompt's 3 full pages

    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a token?"}]
    r2 = c.chat.completions.create(model="tiny", messages=second, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == _chat(tiny_llm, second, 12)
    assert hits() > after_shared
    assert metric(live.url, "jkv_prefix_cache_query_tokens_total") >= hits()
    assert metric(live.url, "jkv_prefix_cache_pages", {"tier": "device"}) > 0


def test_a_log_prob_request_reads_no_cached_prefix_so_its_numbers_repeat_exactly(live):
    """Log-probs must not depend on what the cache holds: such a request computes its whole prompt."""
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Log-probs, please."}]
    plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)  # caches the prompt
    hits = metric(live.url, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"})
    a, b = (c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                      top_logprobs=2) for _ in range(2))
    assert metric(live.url, "jkv_prefix_cache_hit_tokens_total", {"tier": "device"}) == hits
    assert a.choices[0].logprobs == b.choices[0].logprobs
    assert a.choices[0].message.content == plain.choices[0].message.content
