"""Enumerable pipeline configurations: `PipelineSpec = transform + quantizer + codec` (KVServe §5.1).

Every stage spec is a frozen dataclass with a name and parameters, validated on construction, with
a stable string id; `PipelineSpec.id` joins them with '+', e.g. "hadamard+kivi4g32+zstd3", and
`PipelineSpec.parse(id)` inverts it. `features()` exposes categorical and numeric parameters for
the Bayesian profiler's one-hot + min-max encoding (§5.2.1, Alg. 1 line 1).

Id grammar (per stage):
    transform: identity | hadamard | affine | delta<G>                 (G tokens per anchor)
    quantizer: none | tok<b>g<G> | ch<b>g<G> | kivi<b>g<G>
               | ec<S>g<G>                                             (entropy-coded uniform step
                                                                       S % of the group's std)
               | mixhq<hi>s<lo>r<pct>g<G>                              (pct % retrieval heads)
               | mixed-<layer0 heads>.<layer1 heads>...-g<G>           (one char per head:
                                                                       1 2 3 4 8, 'f' = 16 raw)
    codec:     none | lz4 | zstd<level> | zstdh<level>                 (zstdh: min match 7, so short
                                                                       LZ matches do not displace
                                                                       Huffman-coded literals)
"""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

QUANT_BITS = (1, 2, 3, 4, 8)
HEAD_BITS = QUANT_BITS + (16,)  # 16 = keep the head unquantized (stored in the block dtype)
TRANSFORMS = ("identity", "delta", "hadamard", "affine")
QUANTIZERS = ("none", "tok", "ch", "kivi", "ec", "mixhq", "mixed")
EC_STEP_RANGE = (10, 400)  # ec step in % of the group std
CODECS = ("none", "zstd", "zstdh", "lz4")
_BITS_CHAR = {1: "1", 2: "2", 3: "3", 4: "4", 8: "8", 16: "f"}
_CHAR_BITS = {c: b for b, c in _BITS_CHAR.items()}


@dataclass(frozen=True)
class TransformSpec:
    name: str = "identity"
    group: int = 0  # delta: tokens per anchor

    def __post_init__(self):
        if self.name not in TRANSFORMS:
            raise ValueError(f"transform {self.name=} unknown; use one of {TRANSFORMS}")
        if self.name == "delta" and self.group < 2:
            raise ValueError(f"delta transform needs {self.group=} >= 2 tokens per anchor")
        if self.name != "delta" and self.group != 0:
            raise ValueError(f"{self.group=} only applies to the delta transform, not {self.name!r}")

    @property
    def id(self) -> str:
        return f"delta{self.group}" if self.name == "delta" else self.name

    @classmethod
    def parse(cls, text: str) -> "TransformSpec":
        if m := re.fullmatch(r"delta(\d+)", text):
            return cls("delta", int(m[1]))
        return cls(text)

    def features(self) -> dict:
        return {"transform": self.name, "delta_group": float(self.group)}


@dataclass(frozen=True)
class QuantizerSpec:
    """method: none | tok (per-token) | ch (per-channel) | kivi (K per-channel, V per-token)
    | ec (KIVI axes; uniform step `step` % of each group's std, codes clipped to +-7 in 4 bits and
      left to the codec's entropy coder) | mixhq (retrieval heads `bits`, streaming heads
    `low_bits`) | mixed (explicit `table`)."""

    method: str = "none"
    bits: int = 16
    group: int = 0
    low_bits: int = 0
    retrieval_pct: int = 0
    table: tuple[tuple[int, ...], ...] = field(default=())  # mixed: bits [L][H_kv]
    step: int = 0  # ec: quantization step in % of the group's standard deviation

    def __post_init__(self):
        m = self.method
        if m not in QUANTIZERS:
            raise ValueError(f"quantizer {m=} unknown; use one of {QUANTIZERS}")
        if m == "none":
            if (self.bits, self.group, self.low_bits, self.retrieval_pct, self.table, self.step) != (16, 0, 0, 0, (), 0):
                raise ValueError("quantizer 'none' takes no parameters")
            return
        if self.group < 1:
            raise ValueError(f"{self.group=} must be >= 1 for quantizer {m!r}")
        if m == "ec":
            lo, hi = EC_STEP_RANGE
            if not lo <= self.step <= hi:
                raise ValueError(f"ec {self.step=} (% of the group std) must be in [{lo}, {hi}]")
            if self.bits != 4 or self.low_bits or self.retrieval_pct or self.table:
                raise ValueError(f"ec codes are 4-bit nibbles: bits must be 4 (got {self.bits}) and "
                                 "low_bits/retrieval_pct/table unset")
            return
        if self.step:
            raise ValueError(f"{self.step=} only applies to the ec quantizer, not {m!r}")
        if m == "mixed":
            if not self.table or any(not row for row in self.table):
                raise ValueError("mixed quantizer needs a non-empty bits table [L][H_kv]")
            bad = {b for row in self.table for b in row} - set(HEAD_BITS)
            if bad:
                raise ValueError(f"mixed table has bit widths {sorted(bad)}; use {HEAD_BITS}")
            return
        if self.bits not in (HEAD_BITS if m == "mixhq" else QUANT_BITS):
            raise ValueError(f"{self.bits=} not supported by {m!r}; use one of {QUANT_BITS}")
        if m == "mixhq":
            if self.low_bits not in QUANT_BITS or self.low_bits > self.bits:
                raise ValueError(f"mixhq {self.low_bits=} must be in {QUANT_BITS} and <= {self.bits=}")
            if not 0 <= self.retrieval_pct <= 100:
                raise ValueError(f"{self.retrieval_pct=} must be a percentage in [0, 100]")
        elif self.low_bits or self.retrieval_pct or self.table:
            raise ValueError(f"low_bits/retrieval_pct/table only apply to mixhq/mixed, not {m!r}")

    @property
    def id(self) -> str:
        m = self.method
        if m == "none":
            return "none"
        if m == "mixhq":
            return f"mixhq{self.bits}s{self.low_bits}r{self.retrieval_pct}g{self.group}"
        if m == "mixed":
            rows = ".".join("".join(_BITS_CHAR[b] for b in row) for row in self.table)
            return f"mixed-{rows}-g{self.group}"
        if m == "ec":
            return f"ec{self.step}g{self.group}"
        return f"{m}{self.bits}g{self.group}"

    @classmethod
    def parse(cls, text: str) -> "QuantizerSpec":
        if text == "none":
            return cls()
        if m := re.fullmatch(r"(tok|ch|kivi)(\d+)g(\d+)", text):
            return cls(m[1], int(m[2]), int(m[3]))
        if m := re.fullmatch(r"ec(\d+)g(\d+)", text):
            return cls("ec", 4, int(m[2]), step=int(m[1]))
        if m := re.fullmatch(r"mixhq(\d+)s(\d+)r(\d+)g(\d+)", text):
            return cls("mixhq", int(m[1]), int(m[4]), int(m[2]), int(m[3]))
        if m := re.fullmatch(r"mixed-([0-9f.]+)-g(\d+)", text):
            try:
                table = tuple(tuple(_CHAR_BITS[c] for c in row) for row in m[1].split("."))
            except KeyError as e:
                raise ValueError(f"quantizer id {text!r}: bad head bit char {e}") from None
            return cls("mixed", 16, int(m[2]), table=table)
        raise ValueError(f"quantizer id {text!r} not understood; see jkv.compression.spec docstring")

    def mean_bits(self) -> float:
        """Average code bits per value (metadata excluded): the profiler's numeric feature."""
        if self.method == "none":
            return 16.0
        if self.method == "mixed":
            flat = [b for row in self.table for b in row]
            return sum(flat) / len(flat)
        if self.method == "mixhq":
            f = self.retrieval_pct / 100
            return f * self.bits + (1 - f) * self.low_bits
        if self.method == "ec":
            return ec_bits_estimate(self.step)
        return float(self.bits)

    def features(self) -> dict:
        return {"quantizer": self.method, "bits": float(self.bits if self.method != "mixed" else 16),
                "mean_bits": self.mean_bits(), "group": float(self.group),
                "low_bits": float(self.low_bits), "retrieval_pct": float(self.retrieval_pct),
                "ec_step": float(self.step)}


def ec_bits_estimate(step_pct: float) -> float:
    """Entropy (bits/value) of a Gaussian quantized with step = step_pct % of its std, capped at the
    4-bit container: h(X) - log2(step) = 2.05 - log2(step / 100) (high-rate approximation)."""
    return float(min(4.0, max(0.5, 0.5 * math.log2(2 * math.pi * math.e) - math.log2(step_pct / 100))))


@dataclass(frozen=True)
class CodecSpec:
    name: str = "none"
    level: int = 0  # zstd level

    def __post_init__(self):
        if self.name not in CODECS:
            raise ValueError(f"codec {self.name=} unknown; use one of {CODECS}")
        if self.name in ("zstd", "zstdh") and not 1 <= self.level <= 22:
            raise ValueError(f"{self.name} {self.level=} must be in [1, 22]")
        if self.name not in ("zstd", "zstdh") and self.level != 0:
            raise ValueError(f"{self.level=} only applies to zstd/zstdh, not {self.name!r}")

    @property
    def id(self) -> str:
        return f"{self.name}{self.level}" if self.name in ("zstd", "zstdh") else self.name

    @classmethod
    def parse(cls, text: str) -> "CodecSpec":
        if m := re.fullmatch(r"(zstdh?)(\d+)", text):
            return cls(m[1], int(m[2]))
        return cls(text)

    def features(self) -> dict:
        return {"codec": self.name, "codec_level": float(self.level)}


@dataclass(frozen=True)
class PipelineSpec:
    """One point of the strategy space: BS = C(Q(T(X))) (KVServe §5.1)."""

    transform: TransformSpec = TransformSpec()
    quantizer: QuantizerSpec = QuantizerSpec()
    codec: CodecSpec = CodecSpec()

    def __post_init__(self):
        for name, value, kind in (("transform", self.transform, TransformSpec),
                                  ("quantizer", self.quantizer, QuantizerSpec), ("codec", self.codec, CodecSpec)):
            if not isinstance(value, kind):
                raise TypeError(f"PipelineSpec.{name} must be a {kind.__name__}, got {type(value).__name__}")

    @property
    def id(self) -> str:
        return f"{self.transform.id}+{self.quantizer.id}+{self.codec.id}"

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str) -> "PipelineSpec":
        parts = text.split("+")
        if len(parts) != 3:
            raise ValueError(f"pipeline id {text!r} must be 'transform+quantizer+codec', e.g. 'hadamard+kivi4g32+zstd3'")
        return cls(TransformSpec.parse(parts[0]), QuantizerSpec.parse(parts[1]), CodecSpec.parse(parts[2]))

    @property
    def is_lossless(self) -> bool:
        return self.transform.name == "identity" and self.quantizer.method == "none"

    def features(self) -> dict:
        return {**self.transform.features(), **self.quantizer.features(), **self.codec.features()}


UNCOMPRESSED = PipelineSpec()


def enumerate_space(transforms: Iterable[TransformSpec], quantizers: Iterable[QuantizerSpec],
                    codecs: Iterable[CodecSpec]) -> list[PipelineSpec]:
    """Cartesian product of stage options (the enumerable strategy space of §5.1), ids unique."""
    space = [PipelineSpec(t, q, c) for t, q, c in itertools.product(transforms, quantizers, codecs)]
    ids = [s.id for s in space]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate stage options in the strategy space")
    return space
