"""Deterministic long-context tasks built locally (RULER-style) and from local source code.

Every task turns (length, index) into a `Sample`: prompt token ids of about `length` tokens,
the expected answer, a generation budget and a scorer in [0, 1]. The same (seed, length,
index) always yields the same sample.

- passkey: one 5-digit pass key hidden in filler text (single needle).
- passkey_multi: several "special magic number for <word>" needles; the question asks for one.
- kv_retrieval: a JSON object of random hex keys -> hex values; return the value of one key.
- variable_tracking: a chain of assignments VAR A = 12345, VAR B = VAR A, ... hidden in filler;
  name every variable that holds the value (score = recall of the chain).
- code_completion: a real stdlib .py file, truncated before a non-trivial line at a random point
  past `length` tokens; score = edit similarity of the generated next line (LongBench LCC's metric).
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Callable

from jkv.corpus import stdlib_sources

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
WORDS = ["apple", "river", "stone", "violet", "copper", "falcon", "meadow", "harbor", "lantern", "glacier",
         "thistle", "orchid", "canyon", "ember", "willow", "saffron", "quartz", "tundra", "cobalt", "juniper"]


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    prompt: list[int]
    answer: str
    max_tokens: int
    score: Callable[[str], float]


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)); 1.0 for two empty strings."""
    if not a and not b:
        return 1.0
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return 1.0 - previous[-1] / max(len(a), len(b))


def _contains(answer: str) -> Callable[[str], float]:
    return lambda output: float(answer in output)


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _fit(tokenizer, build: Callable[[int], str], length: int) -> list[int]:
    """Chat-formatted tokens of build(n_filler) with n_filler chosen so the prompt is ~length."""
    per_filler = max(1, len(tokenizer.encode(FILLER * 8)) / 8)
    base = len(_chat(tokenizer, build(0)))
    n = max(0, int((length - base) / per_filler))
    for _ in range(3):  # correct the estimate: token boundaries shift a little at joins
        tokens = _chat(tokenizer, build(n))
        error = len(tokens) - length
        if abs(error) <= per_filler:
            break
        n = max(0, n - int(round(error / per_filler)))
    return tokens


def _with_needles(n_filler: int, needles: list[tuple[float, str]]) -> str:
    """Filler of n_filler sentences-groups with each needle inserted at its relative depth."""
    parts = [FILLER] * n_filler
    for depth, needle in sorted(needles, reverse=True):
        parts.insert(int(round(depth * n_filler)), needle + " ")
    return "".join(parts)


def passkey(tokenizer, length: int, index: int, seed: int = 0) -> Sample:
    rng = random.Random(f"passkey-{seed}-{length}-{index}")
    key = str(rng.randint(10000, 99999))
    depth = rng.random()
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "What is the pass key? Answer with the number only."

    def build(n):
        return ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
                + _with_needles(n, [(depth, needle)]) + "\n\n" + question)

    return Sample("passkey", _fit(tokenizer, build, length), key, 16, _contains(key))


def passkey_multi(tokenizer, length: int, index: int, seed: int = 0, num_needles: int = 4) -> Sample:
    rng = random.Random(f"multikey-{seed}-{length}-{index}")
    names = rng.sample(WORDS, num_needles)
    values = [str(rng.randint(1000000, 9999999)) for _ in names]
    needles = [(rng.random(), f"One of the special magic numbers for {n} is: {v}.") for n, v in zip(names, values)]
    target = rng.randrange(num_needles)
    question = f"What is the special magic number for {names[target]} mentioned in the text? Answer with the number only."

    def build(n):
        return ("Some special magic numbers are hidden inside the following text. Memorize them.\n\n"
                + _with_needles(n, needles) + "\n\n" + question)

    return Sample("passkey_multi", _fit(tokenizer, build, length), values[target], 20, _contains(values[target]))


def kv_retrieval(tokenizer, length: int, index: int, seed: int = 0) -> Sample:
    rng = random.Random(f"kv-{seed}-{length}-{index}")
    per_pair = max(1, len(tokenizer.encode('"a1b2c3d4": "e5f6a7b8", ')))

    def pairs(count):
        local = random.Random(f"kvpairs-{seed}-{length}-{index}")
        return [(f"{local.getrandbits(32):08x}", f"{local.getrandbits(32):08x}") for _ in range(count)]

    count = max(2, (length - 80) // per_pair)
    target = rng.random()

    def build(count):
        data = pairs(count)
        key, value = data[int(target * (len(data) - 1))]
        return ("JSON data:\n" + json.dumps(dict(data)) + f"\n\nWhat is the value of key \"{key}\" in the JSON "
                "above? Answer with the value only."), value

    for _ in range(3):
        text, value = build(count)
        tokens = _chat(tokenizer, text)
        if abs(len(tokens) - length) <= per_pair:
            break
        count = max(2, count - (len(tokens) - length) // per_pair)
    return Sample("kv_retrieval", tokens, value, 24, _contains(value))


def variable_tracking(tokenizer, length: int, index: int, seed: int = 0, hops: int = 4) -> Sample:
    rng = random.Random(f"vt-{seed}-{length}-{index}")
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in chain)
    question = (f"Question: Find all variables that are assigned the value {value} in the text above. "
                "Answer: According to the chain(s) of variable assignment in the text above, the variables are:")

    def build(n):
        # Needles keep their chain order: insert by increasing depth.
        parts = [FILLER] * n
        for offset, (depth, needle) in enumerate(zip(depths, chain)):
            parts.insert(int(round(depth * n)) + offset, needle + " ")
        return "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" + \
            "".join(parts) + "\n\n" + question

    def score(output: str) -> float:
        found = set(re.findall(r"\b[A-Z]{5}\b", output))
        return sum(n in found for n in names) / len(names)

    return Sample("variable_tracking", _fit(tokenizer, build, length), " ".join(names), 30, score)


def code_completion(tokenizer, length: int, index: int, seed: int = 0, sources: list[str] | None = None) -> Sample:
    """Raw (no chat template) source prefix of ~length tokens; the target is the next line.
    sources: the .py files to draw from (default every `stdlib_sources()` file; a split's half:
    `jkv.corpus.code_files`)."""
    sources = list(sources if sources is not None else stdlib_sources())
    random.Random(f"code-{seed}").shuffle(sources)  # sample i reads file i (then i+1, ... if too short)
    rng = random.Random(f"code-{seed}-{length}-{index}")
    for attempt in range(50):
        with open(sources[(index + attempt) % len(sources)], encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        candidates = [i for i in range(len(lines)) if len(lines[i].strip()) >= 12
                      and not lines[i].lstrip().startswith(("#", '"', "'"))]
        prefix_tokens = [len(tokenizer.encode(line)) for line in lines]
        # Each sample its own file while there are files, cut at a random point past the first
        # `length` tokens (the prompt is the last `length` tokens before it). Drawing files at
        # random and cutting each at one fixed point made 96 samples hold only ~66 distinct ones.
        spare = sum(prefix_tokens) - length
        threshold = length + (rng.randrange(spare) if spare > 0 else 0)
        total, cut = 0, None
        for i, n in enumerate(prefix_tokens):
            total += n
            if total >= threshold and i + 1 in candidates:
                cut = i + 1
                break
        if cut is None:
            continue
        prompt = tokenizer.encode("".join(lines[:cut]))
        target = lines[cut].strip()

        def score(output: str, target=target) -> float:
            first = next((line.strip() for line in output.splitlines() if line.strip()), "")
            return edit_similarity(first, target)

        return Sample("code_completion", prompt[-length:] if len(prompt) > length else prompt, target, 24, score)
    raise RuntimeError(f"no stdlib source file long enough for a {length}-token code-completion prompt")


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "passkey_multi": passkey_multi,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
    "code_completion": code_completion,
}
