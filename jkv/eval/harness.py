"""The accuracy harness: every task × length × sample × selector, prefilled once per sample.

Samples of one (task, length) run in batches of `EvalConfig.batch` requests: each batch is
prefilled once into a host pool (`prefill_to_host`, per-request lengths); the dense decode
(every token, same host path) and each selector's sparse decode then run from that pool, so
all selectors see identical KV and each dense reference is computed once for all of them.
Requests of a batch are independent (selectors and attention honour each request's length);
a batch decodes the longest `max_tokens` of its samples and each sample keeps its own prefix,
which greedy decoding makes identical to decoding it alone. Per row: the task score, the
relative KV size actually used (selected / cached entries over all layers, SmartGen Fig. 17's
x-axis; for a batch, over its requests), the selector's metadata bytes per token per sparse
layer (what the prefill side ships), and selection overhead (time in `select` / step time,
per batched step). `summarize` averages per (task, length, selector, ratio) and divides by the
dense score.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jkv.eval.csvfile import write_csv  # noqa: F401  (re-exported: jkv eval --csv, tests)
from jkv.eval.fidelity import fidelity_metrics, fidelity_sample
from jkv.eval.tasks import TASKS
from jkv.selection import get_selector
from jkv.selection.calibration import calibration_windows
from jkv.selection.simple import Dense
from jkv.selection.sparse_decode import decode, pool_capacity, prefill_to_host

log = logging.getLogger(__name__)

ALL_TASKS = tuple(TASKS) + ("fidelity",)
FITTED = ("infinigen", "hata")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = ("passkey", "fidelity")
    lengths: tuple[int, ...] = (1024,)
    selectors: tuple[str, ...] = ("oracle", "infinigen", "quest", "hata", "streamingllm")
    ratios: tuple[float, ...] = (0.2,)
    limit: int = 5  # samples per (task, length)
    first: int = 0  # index of the first sample (samples first .. first + limit - 1)
    batch: int = 1  # samples of one (task, length) decoded together (one prefill, one pool)
    fidelity_tokens: int = 32  # teacher-forced continuation length
    seed: int = 0
    hata_weights: str | None = None  # trained weights dir; None trains on the calibration data
    hata_train_steps: int = 200  # per calibration window
    hata_windows: int = 4  # HATA trains on this many calibration windows in turn (InfiniGen: the first)
    calibration_prompt: int = 1024
    calibration_steps: int = 192

    def __post_init__(self):
        from jkv.selection.registry import SELECTORS

        unknown = [t for t in self.tasks if t not in ALL_TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; valid: {', '.join(ALL_TASKS)}")
        bad = [s for s in self.selectors if s not in SELECTORS]
        if bad:
            raise ValueError(f"unknown selector(s) {bad}; valid names: {', '.join(sorted(SELECTORS))}")
        if any(not 0 < r <= 1 for r in self.ratios):
            raise ValueError(f"ratios={self.ratios} must each be in (0, 1]")
        if any(n < 64 for n in self.lengths):
            raise ValueError(f"lengths={self.lengths} must each be >= 64 tokens")
        if self.limit < 1 or self.fidelity_tokens < 2:
            raise ValueError(f"limit={self.limit} must be >= 1 and fidelity_tokens={self.fidelity_tokens} >= 2")
        if not (isinstance(self.batch, int) and self.batch >= 1):
            raise ValueError(f"batch={self.batch!r} must be an int >= 1 (samples decoded together)")
        if not (isinstance(self.hata_windows, int) and self.hata_windows >= 1):
            raise ValueError(f"hata_windows={self.hata_windows!r} must be an int >= 1 (calibration windows)")
        if self.first < 0:
            raise ValueError(f"first={self.first} must be >= 0 (index of the first sample)")


def build_selectors(model, config: EvalConfig) -> dict[tuple[str, float], object]:
    """One selector per (name, ratio); InfiniGen and HATA are fitted on the calibration split."""
    calibration = projection = None
    train_hata = "hata" in config.selectors and config.hata_weights is None
    if any(name in FITTED for name in config.selectors):
        start = time.perf_counter()
        windows = calibration_windows(model, config.hata_windows if train_hata else 1, config.calibration_prompt,
                                      config.calibration_steps)
        calibration = windows[0]  # InfiniGen's skew: the first window
        log.info("calibration: %d windows of %d queries per layer in %.1fs", len(windows),
                 len(calibration.query_positions), time.perf_counter() - start)
    if train_hata:
        from jkv.selection.hata_train import HATATrainConfig, train_projection_windows

        start = time.perf_counter()
        projection, losses = train_projection_windows(windows, HATATrainConfig(train_steps=config.hata_train_steps))
        log.info("HATA trained in %.1fs: loss %.4f -> %.4f", time.perf_counter() - start, losses[0], losses[-1])
    selectors = {}
    for name in config.selectors:
        for ratio in config.ratios:
            extra = {}
            if name == "infinigen":
                extra = {"calibration": calibration}
            elif name == "hata":
                extra = {"projection": projection} if projection is not None else {"weights_path": config.hata_weights}
            selectors[(name, ratio)] = get_selector(name, max_ratio=ratio, **extra)
    return selectors


def _text(tokenizer, ids: np.ndarray, eos: int | None) -> str:
    ids = [int(t) for t in ids]
    if eos is not None and eos in ids:
        ids = ids[:ids.index(eos)]
    return tokenizer.decode(ids)


def metadata_bytes_per_token(selector, cfg, num_tokens: int = 1024) -> float:
    """Bytes of `selector`'s metadata per token per sparse layer (all KV heads) for a
    `num_tokens` prompt (`Selector.metadata_nbytes`: what the prefill side ships, as the
    decode worker counts it). Oracle's metadata is K itself; length-only selectors ship nothing."""
    return selector.metadata_nbytes(selector.config.dense_layers, cfg.num_kv_heads, cfg.head_dim,
                                    num_tokens) / num_tokens


def _row(task, length, prompt_tokens, index, name, ratio, score, result, meta_bytes, batch, **extra) -> dict:
    return {"task": task, "length": length, "prompt_tokens": prompt_tokens, "index": index, "selector": name,
            "max_ratio": ratio, "score": score, "kv_fraction": result.mean("kv_fraction"),
            "sparse_kv_fraction": result.mean("sparse_kv_fraction"), "metadata_bytes_per_token": meta_bytes,
            "select_ms": 1e3 * result.mean("select_s"), "step_ms": 1e3 * result.mean("total_s"), "batch": batch,
            **extra}


def evaluate(model, config: EvalConfig, selectors=None, progress: bool = True) -> list[dict]:
    """Runs every (task, length, sample) with the dense path and every selector -> one row each
    (samples of a (task, length) in batches of `config.batch`, see the module docstring)."""
    from tqdm import tqdm

    selectors = selectors if selectors is not None else build_selectors(model, config)
    tokenizer = model.tokenizer
    eos = getattr(tokenizer, "eos_id", None)
    runs = [("dense", 1.0, Dense())] + [(n, r, s) for (n, r), s in selectors.items()]
    meta_bytes = {id(s): metadata_bytes_per_token(s, model.cfg) for _, _, s in runs}
    rows = []
    samples = list(range(config.first, config.first + config.limit))
    chunks = [samples[i:i + config.batch] for i in range(0, len(samples), config.batch)]
    jobs = [(task, length, chunk) for task in config.tasks for length in config.lengths for chunk in chunks]
    bar = tqdm(total=len(config.tasks) * len(config.lengths) * len(samples), desc="eval", disable=not progress)
    for task, length, chunk in jobs:
        if task == "fidelity":
            pairs = [fidelity_sample(tokenizer, length, config.fidelity_tokens, i) for i in chunk]
            prompts = [p for p, _ in pairs]
            targets = np.stack([t for _, t in pairs])  # i32[b, fidelity_tokens]
            max_tokens, forced = targets.shape[1], targets
        else:
            tasks = [TASKS[task](tokenizer, length, i, seed=config.seed) for i in chunk]
            prompts = [t.prompt for t in tasks]
            max_tokens, forced = max(t.max_tokens for t in tasks), None
        host = prefill_to_host(model, prompts, pool_capacity(prompts, max_tokens))
        dense_logits = None
        for name, ratio, selector in runs:
            if chunk[0] == config.first:  # compile this shape outside the timed run
                decode(model, host, selector, 2, forced_tokens=forced)
            result = decode(model, host, selector, max_tokens, forced_tokens=forced, keep_logits=forced is not None)
            common = dict(result=result, meta_bytes=meta_bytes[id(selector)], batch=len(chunk))
            for b, index in enumerate(chunk):
                if task == "fidelity":
                    if name == "dense":  # runs[0]: the reference of every selector below
                        dense_logits = result.logits
                    # Position 0 is the shared prefill's prediction: compare the decoded ones only.
                    metrics = fidelity_metrics(dense_logits[b, 1:], result.logits[b, 1:], targets[b, 1:])
                    rows.append(_row(task, length, len(prompts[b]), index, name, ratio, metrics["top1"], **common,
                                     kl=metrics["kl"], ppl_ratio=metrics["ppl_ratio"],
                                     agree=metrics["agree"]))
                else:
                    sample = tasks[b]
                    output = _text(tokenizer, result.tokens[b, :sample.max_tokens], eos)
                    rows.append(_row(task, length, len(prompts[b]), index, name, ratio, sample.score(output), **common,
                                     output=output.strip()[:80], answer=sample.answer))
        bar.update(len(chunk))
    bar.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean per (task, length, selector, max_ratio), with relative_score = score / dense score,
    the dense mean taken over the same samples as the group (groups may cover different ones)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["length"], row["selector"], row["max_ratio"]), []).append(row)
    dense = {(r["task"], r["length"], r["index"]): r["score"] for r in rows if r["selector"] == "dense"}
    summary = []
    for (task, length, name, ratio), group in groups.items():
        mean = {k: float(np.mean([r[k] for r in group])) for k in
                ("score", "kv_fraction", "sparse_kv_fraction", "metadata_bytes_per_token", "select_ms", "step_ms",
                 "kl", "ppl_ratio") if k in group[0]}
        paired = [dense[(task, length, r["index"])] for r in group if (task, length, r["index"]) in dense]
        reference = float(np.mean(paired)) if len(paired) == len(group) else None
        mean["relative_score"] = mean["score"] / reference if reference else float("nan")
        summary.append({"task": task, "length": length, "selector": name, "max_ratio": ratio,
                        "samples": len(group), "dense_score": reference, **mean})
    return summary


def format_table(summary: list[dict]) -> str:
    header = f"{'task':<18}{'len':>6} {'selector':<13}{'ratio':>6}{'n':>5}{'score':>8}{'rel':>8}{'kv':>7}" \
             f"{'meta B/tok':>11}{'KL':>8}{'ppl×':>7}{'sel ms':>8}{'step ms':>8}"
    lines = [header, "-" * len(header)]
    for s in summary:
        lines.append(f"{s['task']:<18}{s['length']:>6} {s['selector']:<13}{s['max_ratio']:>6.2f}{s['samples']:>5}"
                     f"{s['score']:>8.3f}{s['relative_score']:>8.3f}{s['kv_fraction']:>7.3f}"
                     f"{s.get('metadata_bytes_per_token', float('nan')):>11.1f}{s.get('kl', float('nan')):>8.4f}"
                     f"{s.get('ppl_ratio', float('nan')):>7.3f}{s['select_ms']:>8.1f}{s['step_ms']:>8.1f}")
    return "\n".join(lines)
