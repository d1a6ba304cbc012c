"""XLA:CPU flags that change speed, read from XLA_FLAGS: what benchmarks record and `jkv serve` checks.

The test suite compiles with LLVM at -O0 (`--xla_backend_optimization_level=0`, tests/conftest.py)
because compiling is most of its CPU time. The flag lives in the environment, so every process a
test starts inherits it, and so does anything run from a shell that exported it: a `jkv serve` or
a benchmark at -O0 runs unoptimized machine code (XLA reads XLA_FLAGS once, when its backend
starts). `jkv serve` warns (the tests start servers at -O0 on purpose); benchmarks refuse.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
# XLA's default backend optimization level (DebugOptions); lower levels skip LLVM optimizations.
DEFAULT_OPT_LEVEL = 2


def backend_opt_level(xla_flags: str | None = None) -> int:
    """The LLVM optimization level XLA_FLAGS sets (the last one given wins, as XLA parses them),
    DEFAULT_OPT_LEVEL when none is set. xla_flags: the flag string (default: the environment's)."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    level = DEFAULT_OPT_LEVEL
    for token in flags.split():
        name, _, value = token.partition("=")
        if name == OPT_LEVEL_FLAG:
            try:
                level = int(value)
            except ValueError:
                raise ValueError(f"XLA_FLAGS has {token!r}; {OPT_LEVEL_FLAG} takes an integer, e.g. "
                                 f"{OPT_LEVEL_FLAG}={DEFAULT_OPT_LEVEL}") from None
    return level


def unoptimized_reason(xla_flags: str | None = None) -> str | None:
    """Why code compiled under these flags is slower than the default, or None when it is not."""
    level = backend_opt_level(xla_flags)
    if level >= DEFAULT_OPT_LEVEL:
        return None
    return (f"XLA_FLAGS sets {OPT_LEVEL_FLAG}={level} (the test suite's setting): XLA:CPU compiles unoptimized "
            f"code, so decode and prefill run slower than they should; unset it or pass "
            f"{OPT_LEVEL_FLAG}={DEFAULT_OPT_LEVEL}")


def warn_if_unoptimized(what: str) -> bool:
    """Log a warning naming `what` when XLA_FLAGS lowers the backend optimization level. Returns
    whether it warned."""
    reason = unoptimized_reason()
    if reason is not None:
        log.warning("%s: %s", what, reason)
    return reason is not None


def require_optimized(what: str) -> None:
    """Refuse (SystemExit naming the flag and the fix) when XLA_FLAGS lowers the backend
    optimization level: a benchmark figure measured at -O0 compares unoptimized code."""
    reason = unoptimized_reason()
    if reason is not None:
        raise SystemExit(f"{what}: {reason}")
