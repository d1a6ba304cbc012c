"""Calibration / evaluation splits for the profile search and Table 1 (issue 22: "Table 1 honestly").

The profile search (KVServe Alg. 1) picks pipelines by their accuracy on some samples; scoring
the chosen profile on the same samples reports the search's selection bias as quality. Here every
workload draws its samples from one of two disjoint sources, and one domain exists only for
evaluation:

- ``continuation``: windows of the documentation corpus' own split (`jkv.corpus.long_text`: the
  pydoc topics alternate by name between 'calibration' and 'eval'), non-overlapping within a split;
- ``code``: `jkv.eval.tasks.code_completion` over the split's half of the stdlib files
  (`jkv.corpus.code_files`: the first half of the sorted list calibrates, the second evaluates);
- ``qa``: the passkey / key-value needles drawn from another seed (`QA_SEEDS`; eval keeps seed 0,
  the samples Table 1 always had);
- ``heldout``: windows of the licence texts (`jkv.corpus.licence_text`), a prose domain in no
  calibration set; only the 'eval' split exists.

`split_samples(tokenizer, workload, split, ...)` builds one split's samples; `assert_disjoint`
raises if a window (the scored positions and the context before them) appears in both, and
`split_pair` builds both and checks them. `relative_interval` reads an evaluation split's relative
score (compressed / uncompressed mean over the same samples) with its paired bootstrap interval:
how far a few samples flipping could move it. Shapes: token ids are Python ints; a sample's
continuation is i32[S]. No threads.
"""
from __future__ import annotations

import functools

import numpy as np

from jkv.compression.workloads import WORKLOADS, WorkloadSample, prose_sample, qa_task, task_sample

SPLITS = ("calibration", "eval")
HELDOUT = "heldout"  # licence prose: evaluation only, absent from every calibration set
DOMAINS = WORKLOADS + (HELDOUT,)
QA_SEEDS = {"calibration": 1, "eval": 0}
CONTEXT_TOKENS = 64  # prompt tokens before the scored positions that make a window's identity


@functools.lru_cache(maxsize=8)
def _text_ids(tokenizer, source: str) -> tuple[int, ...]:
    from jkv.corpus import licence_text, long_text

    return tuple(tokenizer.encode(licence_text() if source == HELDOUT else long_text(source)))


def spread_windows(ids, length: int, continuation: int, count: int) -> list[tuple[list[int], np.ndarray]]:
    """`count` non-overlapping windows of length + continuation tokens spread evenly over ids:
    [(prompt ids, i32[continuation] next ids)]. Raises ValueError when ids are too short."""
    span = length + continuation
    step = len(ids) // max(count, 1)
    if count < 1 or step < span:
        raise ValueError(f"{len(ids)} tokens hold fewer than {count=} disjoint windows of {span} tokens")
    return [(list(ids[i * step:i * step + length]), np.asarray(ids[i * step + length:i * step + span], np.int32))
            for i in range(count)]


def split_samples(tokenizer, workload: str, split: str, count: int, length: int,
                  continuation: int = 16) -> list[WorkloadSample]:
    """`count` samples of ~`length` prompt tokens of `workload` (one of `DOMAINS`) from `split`."""
    from jkv.corpus import code_files
    from jkv.eval import tasks

    if workload not in DOMAINS:
        raise ValueError(f"workload {workload!r} unknown; use one of {DOMAINS}")
    if split not in SPLITS:
        raise ValueError(f"{split=} must be one of {SPLITS}")
    if workload == HELDOUT and split != "eval":
        raise ValueError(f"{HELDOUT!r} is the domain absent from calibration: it has only split='eval'")
    if count < 1 or length < 32 or continuation < 2:
        raise ValueError(f"need {count=} >= 1, {length=} >= 32 and {continuation=} >= 2")
    if workload in ("continuation", HELDOUT):
        source = HELDOUT if workload == HELDOUT else split
        return [prose_sample(tokenizer, workload, prompt, target)
                for prompt, target in spread_windows(_text_ids(tokenizer, source), length, continuation, count)]
    if workload == "code":
        files = code_files(split)
        made = [tasks.code_completion(tokenizer, length, i, sources=files) for i in range(count)]
    else:
        made = [qa_task(tokenizer, length, i, QA_SEEDS[split]) for i in range(count)]
    return [task_sample(tokenizer, workload, s, continuation) for s in made]


def window_key(sample: WorkloadSample) -> tuple[int, ...]:
    """A window's identity: the last `CONTEXT_TOKENS` prompt ids and the scored continuation."""
    return tuple(sample.prompt[-CONTEXT_TOKENS:]) + tuple(int(t) for t in sample.continuation)


def assert_disjoint(calibration: list[WorkloadSample], evaluation: list[WorkloadSample]) -> None:
    """Raise ValueError naming the first evaluation window that also appears among the calibration
    windows (same scored tokens after the same context), or a repeated one within evaluation."""
    seen = {window_key(s): i for i, s in enumerate(calibration)}
    own: set = set()
    for j, s in enumerate(evaluation):
        key = window_key(s)
        if key in seen:
            raise ValueError(f"evaluation sample {j} ({s.workload}) is calibration sample {seen[key]}'s window: "
                             "the splits must not share a window (build them with split_samples)")
        if key in own:
            raise ValueError(f"evaluation sample {j} ({s.workload}) repeats an earlier evaluation window")
        own.add(key)


def split_pair(tokenizer, workload: str, calibration_count: int, eval_count: int, length: int,
               continuation: int = 16) -> tuple[list[WorkloadSample], list[WorkloadSample]]:
    """(calibration samples, evaluation samples) of one workload, checked by `assert_disjoint`."""
    from jkv.corpus import code_files

    if workload == "code" and not set(code_files("calibration")).isdisjoint(code_files("eval")):
        raise AssertionError("the stdlib file halves overlap")  # an internal invariant of jkv.corpus
    calibration = split_samples(tokenizer, workload, "calibration", calibration_count, length, continuation)
    evaluation = split_samples(tokenizer, workload, "eval", eval_count, length, continuation)
    assert_disjoint(calibration, evaluation)
    return calibration, evaluation


def relative_interval(scores, base, level: float = 0.95, draws: int = 4000,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean(scores) / mean(base), lower, upper): the relative score of paired per-sample scores
    f64[S] (a pipeline's and the uncompressed cache's on the same samples) and its percentile
    bootstrap interval at `level` (samples resampled in pairs, `draws` times, fixed seed). Draws
    whose base mean is 0 carry no ratio and are left out; NaN throughout when every one is."""
    scores, base = np.asarray(scores, np.float64), np.asarray(base, np.float64)
    if scores.shape != base.shape or scores.ndim != 1 or len(scores) < 1:
        raise ValueError(f"need two equal 1-d score arrays, got {scores.shape} and {base.shape}")
    if not 0 < level < 1:
        raise ValueError(f"{level=} must lie in (0, 1), e.g. 0.95")
    if base.mean() <= 0:
        return float("nan"), float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(base), (draws, len(base)))
    num, den = scores[idx].mean(1), base[idx].mean(1)
    ratios = num[den > 0] / den[den > 0]
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(scores.mean() / base.mean()), float(lo), float(hi)
