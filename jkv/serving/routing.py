"""Cache-aware routing for `jkv serve --role router`: what the router remembers each upstream has
cached, and the options of the choice (`RoutingConfig`, `--routing` and friends).

The router has no model and no tokenizer, so it cannot compute the instances' page keys
(`jkv/kvcache/prefix.py`: chained hashes of token pages in a namespace holding the weights'
fingerprint). It hashes the request's *text* instead, in chunks of `chunk_chars` characters,
chained the same way (`prefix_keys`): key i names the whole text up to the end of chunk i, so two
requests share key i iff their first (i + 1) x chunk_chars characters are equal. The text is a
canonical, prefix-preserving rendering of the request: a completion's prompt string (token ids
written as decimal text), or a chat's messages as role + content in order. Chat templates render
messages in order too, so a request whose messages extend another's (a follow-up turn, the same
system prompt) shares a text prefix exactly where it shares a token prefix up to the last common
message, whatever the tokenizer; the chunk boundaries need not line up with the instance's pages,
because the router only needs to rank instances by how much of a prompt each holds, not to find
the pages. 64 characters is about one 16-token page of English at ~4 characters per token.

Per upstream a `PrefixRecord` is a bounded LRU set of the keys of the requests sent to it; it is an
approximation of the instance's cache (the instance evicts on its own, under page pressure), which
costs at worst a wasted preference, never a wrong answer: the instance recomputes what it lacks.

The choice (`choose`, policy "cache-aware"), after SGLang's cache-aware load balancer:
1. a request with no full chunk (a prompt shorter than `chunk_chars`) goes by load;
2. the healthy upstreams holding the longest leading run of the request's keys, if that run is at
   least `min_match` of its keys, are the candidates (the least loaded of them wins): "prefix" when
   that narrowed the choice, "load" when every upstream holds the same run;
3. otherwise (a new prefix) the upstream whose record is smallest wins ("cache_size"): new prefixes
   spread over the instances' caches instead of piling onto whichever was idle when each arrived;
4. either way, if the winner's in-flight tokens exceed the least loaded upstream's by more than
   `balance_abs_tokens` *and* by more than `balance_rel` times, the least loaded one gets it
   ("load"): affinity never lets one instance queue far behind an idle one.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from collections.abc import Sequence

ROUTING_POLICIES = ("least-load", "cache-aware")
DIGEST_BYTES = 16
# Chunks hashed per request at most: a 4 MiB body would otherwise cost ~65K digests and a lookup per
# chunk per upstream on the router's event loop; 4,096 x 64 characters (~64K tokens) is past any
# prefix worth routing by.
MAX_CHUNKS = 4096


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """How the router picks an upstream (module docstring).

    policy: "cache-aware" or "least-load" (fewest in-flight tokens, ties by in-flight requests, then
    rotation: the router before cache-aware routing);
    chunk_chars: characters per hashed chunk of the request's text (~ one KV page);
    record_chunks: chunk keys remembered per upstream (LRU); about the instance's prefix-cache
    capacity in tokens x 4 / chunk_chars;
    min_match: fraction of a request's chunks the best upstream must hold for the prefix to decide;
    balance_abs_tokens, balance_rel: the prefix's (or new prefix's) upstream is skipped for the least
    loaded one when its in-flight tokens exceed that one's by more than balance_abs_tokens and are
    more than balance_rel times them."""

    policy: str = "cache-aware"
    chunk_chars: int = 64
    record_chunks: int = 16384
    min_match: float = 0.3
    balance_abs_tokens: int = 2048
    balance_rel: float = 1.5

    def __post_init__(self):
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing={self.policy!r} must be one of {ROUTING_POLICIES}")
        if not isinstance(self.chunk_chars, int) or self.chunk_chars < 1:
            raise ValueError(f"routing_chunk_chars={self.chunk_chars!r} must be an int >= 1 (characters per "
                             "hashed chunk of a prompt; 64 is about one 16-token page)")
        if not isinstance(self.record_chunks, int) or self.record_chunks < 1:
            raise ValueError(f"routing_record_chunks={self.record_chunks!r} must be an int >= 1 (prefix chunks "
                             "remembered per upstream)")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"routing_min_match={self.min_match!r} must be in [0, 1] (the fraction of a prompt's "
                             "chunks an upstream must hold for the prefix to pick it)")
        if self.balance_abs_tokens < 0:
            raise ValueError(f"balance_abs_tokens={self.balance_abs_tokens!r} must be >= 0 tokens")
        if self.balance_rel < 1.0:
            raise ValueError(f"balance_rel={self.balance_rel!r} must be >= 1 (a ratio of in-flight tokens)")


def _content_text(content) -> str:
    """A chat message's content as the server reads it: a string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return json.dumps(content, sort_keys=True, separators=(",", ":"))  # the server rejects it; still stable


def prompt_text(body: dict, path: str) -> str | None:
    """The request's canonical text for prefix hashing (None: nothing to hash).

    Chat: each message as role, \\x1f, content, \\x1e, in order (a request whose messages extend
    another's has that one's text as a prefix), after any `tools` (templates render them first).
    Completions: the prompt string; token ids as comma-separated decimals; of a batch of prompts
    the first (they all go to one upstream). Chat and completion texts live in different namespaces
    (`prefix_keys`), since the same words reach the model templated in one and raw in the other."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        parts = []
        if body.get("tools"):
            parts.append(json.dumps(body["tools"], sort_keys=True, separators=(",", ":")) + "\x1d")
        for m in messages:
            if not isinstance(m, dict):
                return None
            parts.append(f"{m.get('role')}\x1f{_content_text(m.get('content'))}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: list[str] or list[list[int]]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt)) + ","  # each id ends in a separator, so "1,2," never prefixes "1,23,"
    return None


def prefix_keys(body: dict, path: str, chunk_chars: int, max_chunks: int = MAX_CHUNKS) -> list[bytes]:
    """Chained keys of the request text's full chunks, `[min(len(text) // chunk_chars, max_chunks)]`:
    key i = blake2b(namespace || text[: (i + 1) x chunk_chars]). The namespace is the endpoint kind
    and the model name, so a chat and a completion, or two models, never share a key."""
    text = prompt_text(body, path)
    if not text:
        return []
    data = text.encode("utf-8", errors="surrogatepass")
    n = min(len(text) // chunk_chars, max_chunks)
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"jkv-route")
    kind = "chat" if path.endswith("/chat/completions") else "completion"
    for field in (kind, str(body.get("model", "")), str(chunk_chars)):
        raw = field.encode("utf-8", errors="surrogatepass")
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    keys = []
    if len(data) == len(text):  # ASCII: characters are bytes, slice the bytes directly
        for i in range(n):
            h.update(data[i * chunk_chars:(i + 1) * chunk_chars])
            keys.append(h.copy().digest())
    else:
        for i in range(n):
            h.update(text[i * chunk_chars:(i + 1) * chunk_chars].encode("utf-8", errors="surrogatepass"))
            keys.append(h.copy().digest())
    return keys


class PrefixRecord:
    """The chunk keys of requests sent to one upstream: a set bounded to `capacity`, least recently
    used evicted first. `insert` touches a request's keys last to first, so a prompt's leading
    chunks (the ones other requests share) are the most recent and are evicted after its tail."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 chunk")
        self.capacity = capacity
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` are held, counted from the first until the first one that is not
        (chained keys: key i held means the text through chunk i was sent here)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[bytes]) -> int:
        """Add (or refresh) `keys`; returns how many older keys were evicted to make room."""
        for k in reversed(keys[:self.capacity]):
            if k in self._keys:
                self._keys.move_to_end(k)
            else:
                self._keys[k] = None
        evicted = 0
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
            evicted += 1
        return evicted

    def clear(self):
        self._keys.clear()
