"""Long-context, short-query workloads from local documents (CALVO §2.2 Tab. 1, §4.1).

Contexts are windows of a corpus read from this machine (the Debian license texts under
/usr/share/common-licenses, else docstrings of the Python standard library), so no dataset is
downloaded and a seed fixes everything. Each context is shared by many queries (a document QA
pattern: "long context, short query"); arrivals are Poisson at a given QPS; each request gets
an SLO factor from {2, 4, 8} (§4.2), turned into a deadline once its interference-free TTFT is
known (`with_deadlines`). `hit_ratios` sets how much of each context is in the pool (§4.3
Fig. 10 samples 25/50/75/100%).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

import numpy as np

from jkv.scheduling.policies import RequestInfo

DEFAULT_DOC_ROOTS = ("/usr/share/common-licenses",)
_WORD = re.compile(r"\w+|[^\w\s]")


def word_tokenize(text: str, vocab_size: int = 49_152) -> np.ndarray:
    """Deterministic stand-in tokenizer: words and punctuation -> blake2b ids (i32[n]).
    Benchmarks with a real model pass that model's tokenizer instead."""
    ids = [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little")
           % vocab_size for w in _WORD.findall(text)]
    return np.asarray(ids, dtype=np.int32)


def load_local_documents(roots: Sequence[str] = DEFAULT_DOC_ROOTS, min_chars: int = 1000
                         ) -> list[tuple[str, str]]:
    """(name, text) of readable text files under `roots` (sorted, symlinked duplicates dropped);
    falls back to the standard library's module docstrings when none are found."""
    docs, seen = [], set()
    for root in roots:
        base = pathlib.Path(root)
        if not base.is_dir():
            continue
        for path in sorted(p for p in base.rglob("*") if p.is_file()):
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            try:
                text = real.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) >= min_chars:
                docs.append((str(path), text))
    return docs or _stdlib_docstrings(min_chars)


_MODULE_DOCSTRING = re.compile(r'\A(?:\s*#[^\n]*\n|\s)*[rRuU]?("""|\'\'\')(.*?)\1', re.DOTALL)


def _stdlib_docstrings(min_chars: int) -> list[tuple[str, str]]:
    stdlib = pathlib.Path(sys.modules["os"].__file__).parent
    docs = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            match = _MODULE_DOCSTRING.match(path.read_text(encoding="utf-8")[:100_000])
        except (UnicodeDecodeError, OSError):
            continue
        if match and len(match.group(2)) >= min_chars:
            docs.append((str(path), match.group(2)))
    if not docs:
        raise RuntimeError("no local documents found to build a workload from")
    return docs


@dataclasses.dataclass(frozen=True, eq=False)
class WorkloadRequest:
    """One request: a shared context (i32[n_ctx], shared between requests of one context_id)
    followed by its own query (i32[n_q]). cached_tokens: leading context tokens in the pool
    (a multiple of the chunk size). slo_factor: deadline = arrival + factor * isolated TTFT."""

    request_id: int
    arrival_s: float
    context_id: int
    context: np.ndarray
    query: np.ndarray
    cached_tokens: int
    slo_factor: float

    @property
    def prompt_tokens(self) -> int:
        return len(self.context) + len(self.query)

    @property
    def compute_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def tokens(self) -> np.ndarray:
        return np.concatenate([self.context, self.query])

    def info(self, deadline_s: float = float("inf")) -> RequestInfo:
        return RequestInfo(self.request_id, self.arrival_s, self.cached_tokens,
                           self.compute_tokens, deadline_s)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """num_contexts x queries_per_context requests; context lengths log-uniform in
    [min_context_tokens, max_context_tokens]; query length uniform in [min_query, max_query]."""

    qps: float
    num_contexts: int = 8
    queries_per_context: int = 8
    min_context_tokens: int = 2048
    max_context_tokens: int = 16384
    min_query_tokens: int = 16
    max_query_tokens: int = 64
    chunk_tokens: int = 256
    hit_ratios: tuple[float, ...] = (1.0,)
    slo_factors: tuple[float, ...] = (2.0, 4.0, 8.0)
    seed: int = 0

    def __post_init__(self):
        if not self.qps > 0:
            raise ValueError(f"{self.qps=} must be > 0 requests per second")
        if self.num_contexts < 1 or self.queries_per_context < 1:
            raise ValueError(f"{self.num_contexts=} and {self.queries_per_context=} must be >= 1")
        if not 1 <= self.min_context_tokens <= self.max_context_tokens:
            raise ValueError(f"need 1 <= {self.min_context_tokens=} <= {self.max_context_tokens=}")
        if not 1 <= self.min_query_tokens <= self.max_query_tokens:
            raise ValueError(f"need 1 <= {self.min_query_tokens=} <= {self.max_query_tokens=}")
        if self.chunk_tokens < 1:
            raise ValueError(f"{self.chunk_tokens=} must be >= 1")
        if not self.hit_ratios or any(not 0 <= h <= 1 for h in self.hit_ratios):
            raise ValueError(f"{self.hit_ratios=} must be non-empty fractions in [0, 1]")
        if not self.slo_factors or any(f <= 0 for f in self.slo_factors):
            raise ValueError(f"{self.slo_factors=} must be non-empty and > 0")

    @property
    def num_requests(self) -> int:
        return self.num_contexts * self.queries_per_context


def build_workload(config: WorkloadConfig,
                   tokenize: Callable[[str], np.ndarray] = word_tokenize,
                   documents: Sequence[tuple[str, str]] | None = None) -> list[WorkloadRequest]:
    """Requests sorted by arrival. Deterministic given config.seed, documents and tokenize."""
    rng = np.random.default_rng(config.seed)
    docs = tuple(documents) if documents is not None else tuple(load_local_documents())
    corpus = _corpus(docs, tokenize)
    if corpus.size == 0:
        raise ValueError("the documents tokenize to nothing; pass non-empty documents")
    contexts = []
    for _ in range(config.num_contexts):
        length = int(np.exp(rng.uniform(np.log(config.min_context_tokens),
                                        np.log(config.max_context_tokens + 1))))
        length = min(max(length, config.min_context_tokens), config.max_context_tokens)
        start = int(rng.integers(0, corpus.size))
        contexts.append(np.take(corpus, np.arange(start, start + length), mode="wrap"))
    # Every context is asked several questions; the questions of all contexts interleave.
    context_ids = np.repeat(np.arange(config.num_contexts), config.queries_per_context)
    rng.shuffle(context_ids)
    gaps = rng.exponential(1.0 / config.qps, size=config.num_requests)  # Poisson arrivals
    arrivals = np.cumsum(gaps) - gaps[0]
    requests = []
    for rid, (cid, arrival) in enumerate(zip(context_ids, arrivals)):
        context = contexts[cid]
        query = _query(context, tokenize, rng, config)
        hit = float(rng.choice(config.hit_ratios))
        cached = int(hit * len(context)) // config.chunk_tokens * config.chunk_tokens
        requests.append(WorkloadRequest(rid, float(arrival), int(cid), context, query, cached,
                                        float(rng.choice(config.slo_factors))))
    return requests


@functools.lru_cache(maxsize=4)
def _corpus(docs: tuple[tuple[str, str], ...], tokenize) -> np.ndarray:
    """All documents' tokens, i32[n] (cached: QPS sweeps rebuild workloads from one corpus)."""
    corpus = np.concatenate([tokenize(text) for _, text in docs]).astype(np.int32)
    corpus.flags.writeable = False
    return corpus


def _query(context: np.ndarray, tokenize, rng: np.random.Generator,
           config: WorkloadConfig) -> np.ndarray:
    """A short question quoting a span of its context, length in [min_query, max_query]."""
    length = int(rng.integers(config.min_query_tokens, config.max_query_tokens + 1))
    prompt = tokenize("Question: what does the document say about")
    span = max(1, length - len(prompt))
    start = int(rng.integers(0, max(1, len(context) - span)))
    quoted = np.take(context, np.arange(start, start + span), mode="wrap")
    return np.concatenate([prompt, quoted])[:length].astype(np.int32)


def with_deadlines(requests: Sequence[WorkloadRequest],
                   isolated_ttft_s: Callable[[WorkloadRequest], float]) -> list[RequestInfo]:
    """RequestInfo with deadline = arrival + slo_factor x interference-free TTFT (§4.2)."""
    return [r.info(r.arrival_s + r.slo_factor * isolated_ttft_s(r)) for r in requests]
