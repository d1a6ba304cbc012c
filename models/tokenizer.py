"""Tokenizer: a `tokenizers` BPE from tokenizer.json or rebuilt from GGUF metadata, plus chat templates.

The chat template is rendered with jinja2 the way Hugging Face does (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`), so `apply_chat_template` gives the same ids as transformers.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_GGUF_SPECIAL_TYPES = (2, 3, 4)
# llama.cpp's pre-tokenizer names whose regex is "split every digit, then GPT-2's regex".
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


class ChatTemplateError(ValueError):
    pass


class Tokenizer:
    """Text <-> token ids, chat templating. Thin wrapper over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: _HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, add_bos: bool = False):
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_id = tok.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._compiled_template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while the Rust tokenizer runs (encode holds it), so a huge
        # prompt tokenized on a server's worker thread does not stall its event loop.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass plain prompts instead of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]={m!r} must be a dict with 'role' and 'content'")
        if self._compiled_template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message):
                raise ChatTemplateError(message)

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself; never add another.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}: jkv needs the fast-tokenizer file")
        try:
            tok = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{tj} could not be parsed as a tokenizer ({e})") from None
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(tok, bos_token=token_str(cfg.get("bos_token")), eos_token=token_str(cfg.get("eos_token")),
                   chat_template=template, add_bos=bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """Rebuild a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata (gpt2 model only)."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported; jkv rebuilds 'gpt2' (byte-level BPE) "
                             "tokenizers — use the model's Hugging Face directory with tokenizer.json instead")
        tokens = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty in _GGUF_SPECIAL_TYPES]
        tok.add_special_tokens(specials)
        bos_id = fields.get("tokenizer.ggml.bos_token_id")
        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        return cls(tok, bos_token=tokens[bos_id] if bos_id is not None else None,
                   eos_token=tokens[eos_id] if eos_id is not None else None,
                   chat_template=fields.get("tokenizer.chat_template"),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))
