"""Shared pytest fixtures and hardware-marker handling."""
import os
import shutil
import tempfile

# Tests run on CPU unless a gpu-marked test asks otherwise; keep XLA from grabbing all cores'
# memory and make results deterministic.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One persistent XLA compilation cache for the whole run, shared by both pytest-xdist workers and
# every process they start (servers, prefill workers, CLI subprocesses inherit the environment):
# dozens of `jkv serve` processes compile the same programs (same model, same shapes), and on two
# cores those compiles were most of the suite's wall time (a SmolLM2 server's warm-up: ~100 s cold,
# ~40 s from the cache). Only XLA's compile step is cached, keyed on the program and compile
# options, so every test still traces, lowers and runs its own programs. The controller process
# imports this file first and the workers inherit the variable, so all share one directory;
# `JAX_COMPILATION_CACHE_DIR` set by the caller (a cache kept across runs) is left alone.
# A size limit turns on jax's file lock around each cache read and write: without it a worker could
# read an entry the other is half-way through writing (jax would then warn and compile it anew).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="jkv-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ["JKV_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))


def pytest_configure(config):
    # jax reads its JAX_* variables when it is first imported; a plugin may have imported it before
    # this file, so set the options directly as well.
    import sys

    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
        jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                          int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
        jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


def pytest_unconfigure(config):
    # Only the process that made the directory removes it (the xdist controller, after its workers).
    if _OWN_CACHE is not None and os.environ.get("JKV_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
