"""Cache-aware routing policy (pure Python, no servers): prefix keys of a request's text, the
per-upstream records, affinity, the balance threshold, record eviction and unhealthy upstreams."""
import pytest

from jkv.serving.metrics import RouterMetrics
from jkv.serving.router import NoUpstreamError, Router, Upstream
from jkv.serving.routing import PrefixRecord, RoutingConfig, prefix_keys, prompt_text

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CHUNK = 16


def system(group: int) -> str:
    return f"Group {group} system prompt. " + "Answer plainly, name the files, keep it short. " * 6


def chat(group: int, question: str, history: tuple = ()) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system(group)}, *history,
                                       {"role": "user", "content": question}]}


def keys(body: dict, path: str = CHAT) -> list[bytes]:
    return prefix_keys(body, path, CHUNK)


def make(n=2, **routing):
    ups = [Upstream(f"http://h{i}:1", "all", order=i) for i in range(n)]
    cfg = RoutingConfig(**{"chunk_chars": CHUNK, **routing})
    return Router(ups, RouterMetrics(), cfg), ups


def routed(r: Router, by: str, kind: str = "all") -> float:
    return r.metrics.routed.labels(kind, by)._value.get()


# ---------------------------------------------------------------- prefix keys


def test_keys_are_chained_so_requests_share_exactly_their_common_leading_chunks():
    a, b = keys(chat(0, "What is a page?")), keys(chat(0, "Does it evict pages?"))
    common = len(prompt_text(chat(0, "x"), CHAT)) - 2  # system message + "user\x1f" before the question
    assert len(a) == len(prompt_text(chat(0, "What is a page?"), CHAT)) // CHUNK
    shared = sum(1 for x, y in zip(a, b) if x == y)
    assert shared == common // CHUNK and a[:shared] == b[:shared] and a[shared] != b[shared]
    other = keys(chat(1, "What is a page?"))
    assert not set(other) & set(a)  # another system prompt differs from its first chunk on


def test_a_follow_up_turn_extends_the_previous_requests_keys():
    first = chat(0, "What is a page?")
    follow = {"model": "m", "messages": first["messages"] + [{"role": "assistant", "content": "Sixteen tokens."},
                                                              {"role": "user", "content": "And a token?"}]}
    k1, k2 = keys(first), keys(follow)
    assert prompt_text(follow, CHAT).startswith(prompt_text(first, CHAT))
    assert k2[:len(k1)] == k1 and len(k2) > len(k1)


def test_text_parts_read_like_a_string_and_namespaces_separate_chat_completion_and_model():
    parts = chat(0, "What is a page?")
    text = system(0)
    parts["messages"][0]["content"] = [{"type": "text", "text": text[:40]}, {"type": "text", "text": text[40:]}]
    assert keys(parts) == keys(chat(0, "What is a page?"))
    text = prompt_text(chat(0, "q"), CHAT)
    as_completion = keys({"model": "m", "prompt": text}, COMPLETIONS)
    assert as_completion and not set(as_completion) & set(keys(chat(0, "q")))
    assert not set(keys({**chat(0, "q"), "model": "other"})) & set(keys(chat(0, "q")))


def test_completion_prompts_short_prompts_token_ids_and_the_chunk_cap():
    long = "the quick brown fox jumps over the lazy dog " * 4
    assert keys({"prompt": long}, COMPLETIONS) == keys({"prompt": [long, "another"]}, COMPLETIONS)
    assert keys({"prompt": "short"}, COMPLETIONS) == []  # no full chunk: nothing to route by
    assert keys({"messages": []}) == [] and keys({"prompt": None}, COMPLETIONS) == []
    ids = list(range(100, 140))
    a, b = keys({"prompt": ids}, COMPLETIONS), keys({"prompt": ids[:20] + [7] * 20}, COMPLETIONS)
    assert a and a[0] == b[0] and a[-1] != b[-1]
    assert keys({"prompt": [[1, 2, 3] * 30]}, COMPLETIONS) == keys({"prompt": [1, 2, 3] * 30}, COMPLETIONS)
    assert len(prefix_keys({"prompt": "x" * 1000}, COMPLETIONS, CHUNK, max_chunks=10)) == 10
    uni = "ünïcödé prompt " * 10  # non-ASCII: chunked by characters like ASCII text
    assert len(keys({"prompt": uni}, COMPLETIONS)) == len(uni) // CHUNK


# ---------------------------------------------------------------- the record


def test_record_is_an_lru_that_evicts_a_prompts_tail_before_its_head():
    rec = PrefixRecord(capacity=6)
    a = [b"a%d" % i for i in range(4)]
    assert rec.insert(a) == 0 and rec.match(a) == 4
    assert rec.insert([b"b0", b"b1", b"b2"]) == 1
    assert rec.match(a) == 3  # a's last chunk went first: its leading run still matches
    rec.insert([b"c0", b"c1", b"c2", b"c3"])
    assert rec.match(a) == 0 and len(rec) == 6
    assert rec.match([b"c0", b"zz", b"c2"]) == 1  # a run stops at the first chunk not held
    rec.insert([b"k%d" % i for i in range(10)])  # more keys than capacity: the leading ones are kept
    assert rec.match([b"k%d" % i for i in range(6)]) == 6 and len(rec) == 6
    rec.clear()
    assert len(rec) == 0


# ---------------------------------------------------------------- the choice


def test_requests_follow_their_prefix_and_new_prefixes_spread_over_the_records():
    r, (a, b) = make()
    groups = {g: [keys(chat(g, f"question {i}")) for i in range(3)] for g in range(4)}
    first = {g: r.pick(keys=groups[g][0]) for g in range(4)}
    assert routed(r, "cache_size") == 4 and routed(r, "prefix") == 0
    assert sorted(u.url for u in first.values()) == [a.url, a.url, b.url, b.url]  # two groups each
    for g in range(4):
        for k in groups[g][1:]:
            assert r.pick(keys=k) is first[g]
    assert routed(r, "prefix") == 8


def test_affinity_holds_under_load_until_the_balance_threshold_then_least_load():
    r, (a, b) = make(balance_abs_tokens=1000, balance_rel=1.5)
    k = keys(chat(0, "q"))
    assert r.pick(keys=k) is a
    r.acquire(a, 900)  # more loaded than the idle b, but within the threshold: affinity wins
    assert r.pick(keys=keys(chat(0, "another"))) is a
    r.acquire(a, 200)  # 1100 > 0 + 1000 and > 1.5 x 0: b gets it
    assert r.pick(keys=keys(chat(0, "third"))) is b and routed(r, "load") == 1
    assert r.record(b).match(k) > 0  # b now holds the group too: it can take its requests by load
    r.acquire(b, 300)  # a: 1100, b: 300; both hold the prefix, so the less loaded one gets it
    assert r.pick(keys=keys(chat(0, "fourth"))) is b and routed(r, "load") == 2


def test_the_balance_threshold_needs_both_the_absolute_and_the_relative_excess():
    r, (a, b) = make(balance_abs_tokens=1000, balance_rel=1.5)
    assert r.pick(keys=keys(chat(0, "q"))) is a
    r.acquire(a, 4000)
    r.acquire(b, 2900)  # 1100 over b, but only 1.38x b's load: still a
    assert r.pick(keys=keys(chat(0, "q2"))) is a
    r.release(b, 400)  # 1.6x and 1500 over: b
    assert r.pick(keys=keys(chat(0, "q3"))) is b


def test_a_follow_up_goes_to_the_instance_holding_the_longer_conversation():
    r, (a, b) = make()
    q1 = chat(0, "What is a page? " * 3)
    assert r.pick(keys=keys(q1)) is a
    assert r.pick(keys=keys(chat(0, "unrelated question"))) is a  # same system prompt: a holds it
    r.record(b).insert(keys(chat(0, "x")))  # b holds the system prompt too, not the first turn
    r.acquire(a, 100)  # a is busier, yet holds more of the conversation
    follow = chat(0, "And a token?", history=(q1["messages"][1], {"role": "assistant", "content": "16 tokens"}))
    assert r.pick(keys=keys(follow)) is a


def test_a_match_below_min_match_counts_as_a_new_prefix():
    short = {"prompt": "shared preamble of 32 characters" + "z" * 16}
    long = {"prompt": "shared preamble of 32 characters" + "y" * 200}  # 2 of its 14 chunks are short's
    for min_match, want, by in ((0.5, 1, "cache_size"), (0.1, 0, "prefix")):
        r, ups = make(min_match=min_match)
        assert r.pick(keys=keys(short, COMPLETIONS)) is ups[0]
        r.record(ups[0]).insert([b"x%d" % i for i in range(10)])  # ups[0]'s record is the larger one
        assert r.pick(keys=keys(long, COMPLETIONS)) is ups[want] and routed(r, by) == 1 + (by == "cache_size")


def test_an_evicted_prefix_is_routed_as_a_new_one():
    g0 = keys(chat(0, "q"))
    r, (a, b) = make(record_chunks=2 * len(g0))
    assert r.pick(keys=g0) is a
    for g in (1, 2):  # two other groups fill a's record: g0 is evicted
        r.record(a).insert(keys(chat(g, "q")))
    assert r.record(a).match(g0) == 0
    assert r.pick(keys=keys(chat(0, "q2"))) is b and routed(r, "cache_size") == 2  # b's record is the smaller
    assert r.metrics.record_evictions.labels(a.url, "all")._value.get() == 0  # inserted directly, not by a pick
    assert r.pick(exclude={b.url}, keys=keys(chat(3, "q"))) is a
    assert r.metrics.record_evictions.labels(a.url, "all")._value.get() > 0


def test_an_unhealthy_holder_is_skipped_and_forgotten_when_it_returns():
    r, (a, b) = make()
    k = keys(chat(0, "q"))
    assert r.pick(keys=k) is a
    r.mark(a, False, "test")
    assert r.pick(keys=keys(chat(0, "q2"))) is b
    r.mark(a, True)  # may have restarted: its record is cleared, b now holds the prefix
    assert len(r.record(a)) == 0
    assert r.pick(keys=keys(chat(0, "q3"))) is b and routed(r, "prefix") == 1
    assert r.metrics.record_chunks.labels(a.url, "all")._value.get() == 0
    r.mark(b, False, "test")
    assert r.pick(keys=keys(chat(0, "q4"))) is a
    r.mark(a, False, "test")
    with pytest.raises(NoUpstreamError):
        r.pick(keys=k)


def test_excluded_upstreams_are_skipped_like_unhealthy_ones():
    r, (a, b) = make()
    assert r.pick(keys=keys(chat(0, "q"))) is a
    assert r.pick(exclude={a.url}, keys=keys(chat(0, "q2"))) is b


def test_least_load_policy_and_requests_without_keys_go_by_load_and_keep_no_record():
    r, (a, b) = make(policy="least-load")
    k = keys(chat(0, "q"))
    picks = [r.pick(keys=k) for _ in range(4)]
    assert picks == [a, b, a, b] and len(r.record(a)) == 0 and routed(r, "load") == 4
    r2, (a2, b2) = make()
    assert [r2.pick(keys=[]) for _ in range(2)] == [a2, b2] and len(r2.record(a2)) == 0


def test_pools_of_a_disaggregated_router_keep_separate_records():
    ups = [Upstream("http://p0:1", "prefill", order=0), Upstream("http://p1:1", "prefill", order=1),
           Upstream("http://d0:1", "decode", order=0)]
    r = Router(ups, RouterMetrics(), RoutingConfig(chunk_chars=CHUNK))
    k = keys(chat(0, "q"))
    p = r.pick("prefill", keys=k)
    assert r.pick("decode", keys=k) is ups[2]
    assert r.pick("prefill", keys=keys(chat(0, "q2"))) is p and routed(r, "prefix", "prefill") == 1
    assert routed(r, "cache_size", "decode") == 1 and routed(r, "prefix", "decode") == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "round-robin"}, r"routing='round-robin' must be one of \('least-load', 'cache-aware'\)"),
    ({"chunk_chars": 0}, "routing_chunk_chars=0 must be an int >= 1"),
    ({"record_chunks": 0}, "routing_record_chunks=0 must be an int >= 1"),
    ({"min_match": 1.5}, r"routing_min_match=1.5 must be in \[0, 1\]"),
    ({"balance_abs_tokens": -1}, "balance_abs_tokens=-1 must be >= 0"),
    ({"balance_rel": 0.5}, "balance_rel=0.5 must be >= 1"),
])
def test_bad_routing_options_are_errors_naming_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kwargs)
