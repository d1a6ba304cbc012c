"""Public API: `LLM(...).generate(prompts, SamplingParams(...))`.

    from jkv import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(out[0].text, out[0].metrics.ttft)

Disaggregated (prefill and decode in separate processes, SmartGen selective KV transfer):

    llm = LLM("smollm2-135m-instruct", disaggregation=Disaggregation(transfer=TransferConfig(mode="smartgen"),
                                                                    prefill_workers=2))
    ...; llm.close()   # stops the prefill worker processes (also on `with LLM(...) as llm:`)

A prompt is a string, a list of token ids, or a chat conversation (a list of
{"role", "content"} dicts, rendered with the model's chat template).
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Sequence, Union

import jax
from tqdm import tqdm

from models import DEFAULT_MODEL, Model, load_model

from .disagg.config import Disaggregation
from .engine import DEFAULT_PREFILL_CHUNK, DenseEngine, Request
from .multihost import agree_on_batch
from .outputs import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger(__name__)

Message = dict
Prompt = Union[str, Sequence[int], Sequence[Message]]
_ids = itertools.count()


def _is_chat(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, dict) for m in p)


def _is_token_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, int) for t in p)


class LLM:
    """A model plus an engine. `model` is a registered name, a HF directory, a .gguf file or a `Model`.

    The colocated engine keeps KV in a paged cache (`jkv.kvcache`): kv_page_size tokens a page;
    prompts longer than prefill_chunk tokens are prefilled in chunks of that many tokens;
    enable_prefix_caching keeps full pages of earlier requests and skips the prefill of a cached
    prompt prefix (off by default: LLM is the reference the serving paths are checked against);
    with disaggregation, as in `jkv serve`, the decode process keeps finished prompts' pages (a
    later request moves only its new KV) and each local prefill worker keeps its own prefix cache
    of Disaggregation.prefill_prefix_cache_tokens (a cached prompt prefix is not recomputed).
    tensor_parallel=N shards the weights and the KV cache over N devices (docs/scale.md); a
    `Model` passed in is re-laid out at that degree (None: keep the `Model`'s own, 1 for a name).
    """

    def __init__(self, model: str | os.PathLike | Model = DEFAULT_MODEL, *, dtype: str = "float32",
                 max_batch_size: int = 16, disaggregation: Disaggregation | None = None,
                 kv_page_size: int = 16, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 enable_prefix_caching: bool = False, tensor_parallel: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"{max_batch_size=} must be >= 1")
        if tensor_parallel is not None:
            tp = tensor_parallel
        else:
            tp = model.tensor_parallel if isinstance(model, Model) else 1
        if isinstance(model, Model):
            self.model = model if tensor_parallel is None else model.with_tensor_parallel(tensor_parallel)
        else:
            self.model = load_model(model, dtype=dtype, tensor_parallel=tp)
        self.tokenizer = self.model.tokenizer
        self.max_batch_size = max_batch_size
        if disaggregation is not None and jax.process_count() > 1:
            raise ValueError(f"disaggregation is not supported in a multi-host replica ({jax.process_count()} "
                             "processes): run the colocated engine (disaggregation=None), or one process per "
                             "prefill/decode role")
        if disaggregation is not None:  # this process decodes; prefill runs in worker processes
            from .disagg.cluster import DisaggregatedEngine
            self._engine = DisaggregatedEngine(self.model, disaggregation,
                                               model_spec=None if isinstance(model, Model) else str(model),
                                               prefix_caching=enable_prefix_caching)
        else:
            self._engine = DenseEngine(self.model, page_size=kv_page_size, prefill_chunk=prefill_chunk,
                                       enable_prefix_caching=enable_prefix_caching)

    def close(self) -> None:
        """Stop worker processes (disaggregated mode); a no-op for the colocated engine."""
        if hasattr(self._engine, "close"):
            self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if _is_chat(prompt):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of chat messages")
            return self.tokenizer.apply_chat_template(prompt)
        if _is_token_ids(prompt):
            vocab = self.model.cfg.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return list(prompt)
        raise TypeError(f"prompt {prompt!r:.80} must be a string, a list of token ids or a list of "
                        "{'role', 'content'} messages")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a batch (mixed lengths allowed). Returns one output per prompt, in order."""
        if isinstance(prompts, str) or _is_chat(prompts) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one or one per prompt")
        t0 = time.perf_counter()
        requests = [Request(str(next(_ids)), p, self.encode_prompt(p), sp) for p, sp in zip(prompts, params)]
        # a multi-host replica (jkv/multihost.py): every rank steps the same batch, or none does
        agree_on_batch([(r.prompt_token_ids, r.params) for r in requests])
        outputs: list[RequestOutput] = []
        chunks = range(0, len(requests), self.max_batch_size)
        for i in tqdm(chunks, desc="generate", disable=not use_tqdm):
            outputs.extend(self._engine.generate(requests[i:i + self.max_batch_size], t0=t0))
        return outputs
