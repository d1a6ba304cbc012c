"""Cross-framework comparison: the same weights in jkv and in Hugging Face transformers (torch, CPU).

Reports, over every prefill position of every prompt: max |Δlogit|, mean KL(hf || jkv) and top-1
agreement; then greedy continuations from both and how many match exactly. `check()` turns the
report into pass/fail against tolerances. transformers/torch are imported only here (the
`compare` extra); the core runtime never needs them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from models import Model, resolve_model_path

log = logging.getLogger(__name__)

DEFAULT_PROMPTS: list = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
]


@dataclasses.dataclass(frozen=True)
class Tolerances:
    max_abs_logit_diff: float = 1e-2
    max_mean_kl: float = 1e-5
    min_top1_agreement: float = 0.99
    min_greedy_match: float = 1.0  # fraction of prompts whose greedy continuation is identical

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name}={getattr(self, f.name)} must be >= 0")


@dataclasses.dataclass
class CompareReport:
    prompts: int
    positions: int
    max_abs_logit_diff: float
    logit_scale: float
    mean_kl: float
    top1_agreement: float
    greedy_match: float
    greedy_tokens: int
    mismatches: list[str]

    def check(self, tol: Tolerances) -> list[str]:
        failures = []
        if self.max_abs_logit_diff > tol.max_abs_logit_diff:
            failures.append(f"max |Δlogit| {self.max_abs_logit_diff:.3g} > {tol.max_abs_logit_diff:g}")
        if self.mean_kl > tol.max_mean_kl:
            failures.append(f"mean KL {self.mean_kl:.3g} > {tol.max_mean_kl:g}")
        if self.top1_agreement < tol.min_top1_agreement:
            failures.append(f"top-1 agreement {self.top1_agreement:.4f} < {tol.min_top1_agreement:g}")
        if self.greedy_match < tol.min_greedy_match:
            failures.append(f"greedy match {self.greedy_match:.2f} < {tol.min_greedy_match:g}")
        return failures

    def format(self) -> str:
        return "\n".join([
            f"prompts {self.prompts}, prefill positions {self.positions}",
            f"max |Δlogit|      {self.max_abs_logit_diff:.3e}  (logit scale {self.logit_scale:.1f})",
            f"mean KL(hf||jkv)  {self.mean_kl:.3e}",
            f"top-1 agreement   {self.top1_agreement:.4f}",
            f"greedy match      {self.greedy_match:.2f} over {self.greedy_tokens}-token continuations",
            *[f"  mismatch: {m}" for m in self.mismatches],
        ])


def load_hf_reference(name_or_path: str):
    """The same weights in transformers: a HF directory as is, a GGUF via `gguf_file=`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise RuntimeError(f"`jkv compare` needs the compare extra ({e}); run `pip install 'jkv[compare]'`") from None
    torch.set_grad_enabled(False)
    src = resolve_model_path(name_or_path)
    if src.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    return hf.eval()


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def hf_step(hf, tokens, cache=None):
    """One transformers forward with its KV cache: returns (logits, cache).

    transformers 5.x renamed `past_key_values` to `cache` (the old name is removed in 5.40);
    use whichever this version's forward takes.
    """
    import inspect

    if "cache" in inspect.signature(hf.forward).parameters:
        out = hf(tokens, cache=cache, use_cache=True)
        return out.logits, out.cache
    out = hf(tokens, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


def hf_greedy(hf, ids: list[int], n: int, eos_ids: Sequence[int]) -> list[int]:
    """Greedy continuation with an explicit loop (no generation-config surprises)."""
    import torch

    logits, cache = hf_step(hf, torch.tensor([ids]))
    toks = []
    for _ in range(n):
        t = int(logits[0, -1].argmax())
        toks.append(t)
        if t in eos_ids:
            break
        logits, cache = hf_step(hf, torch.tensor([[t]]), cache)
    return toks


def compare(model: Model, hf, prompt_ids: Sequence[list[int]], greedy_tokens: int = 32) -> CompareReport:
    import torch

    from .engine import DenseEngine, Request, bucket_prompt_len
    from .sampling import SamplingParams

    # One padded batch per comparison: a single compiled prefill/decode serves every prompt.
    lengths = np.array([len(ids) for ids in prompt_ids], np.int32)
    T = bucket_prompt_len(int(lengths.max()))
    tokens = np.zeros((len(prompt_ids), T), np.int32)
    for b, ids in enumerate(prompt_ids):
        tokens[b, :len(ids)] = ids
    all_ours, _ = model.prefill(tokens, lengths, all_logits=True)
    all_ours = np.asarray(all_ours, np.float64)
    max_diff = scale = kl_sum = 0.0
    agree = positions = 0
    for b, ids in enumerate(prompt_ids):
        ref = hf(torch.tensor([ids])).logits[0].float().numpy().astype(np.float64)
        ours = all_ours[b, :len(ids)]
        max_diff = max(max_diff, float(np.abs(ours - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
        lp, lq = _log_softmax(ref), _log_softmax(ours)
        kl_sum += float((np.exp(lp) * (lp - lq)).sum(-1).sum())
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        positions += len(ids)
    sp = SamplingParams(max_tokens=greedy_tokens, ignore_eos=False)
    eos = model.cfg.eos_token_ids
    batch = DenseEngine(model).generate([Request(str(i), None, list(ids), sp) for i, ids in enumerate(prompt_ids)])
    mismatches, matched = [], 0
    for i, ids in enumerate(prompt_ids):
        ours = batch[i].token_ids
        theirs = hf_greedy(hf, list(ids), greedy_tokens, eos)
        theirs = theirs[:-1] if theirs and theirs[-1] in eos else theirs
        if ours == theirs:
            matched += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            mismatches.append(f"prompt {i}: first difference at generated token {first}")
    return CompareReport(prompts=len(prompt_ids), positions=positions, max_abs_logit_diff=max_diff, logit_scale=scale,
                         mean_kl=kl_sum / max(positions, 1), top1_agreement=agree / max(positions, 1),
                         greedy_match=matched / max(len(prompt_ids), 1), greedy_tokens=greedy_tokens,
                         mismatches=mismatches)


def read_prompts_file(path: str | Path) -> list:
    """One prompt per line; a line that parses as a JSON list is a chat conversation."""
    import json

    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("["):
            try:
                prompts.append(json.loads(line))
                continue
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: looks like a JSON chat but does not parse ({e})") from None
        prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts
