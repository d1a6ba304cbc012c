"""Shared pytest fixtures and hardware-marker handling."""
import importlib.util
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
if importlib.util.find_spec("filelock") is not None:  # jax refuses a size limit without it
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
        if "JAX_COMPILATION_CACHE_MAX_SIZE" in os.environ:
            jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))


def pytest_unconfigure(config):
    # Only the process that made the directory removes it (the xdist controller, after its workers).
    if _OWN_CACHE is not None and os.environ.get("JKV_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Test files that take a minute or more of wall time in CI (the --durations of `make test`), longest
# first. pytest-xdist's loadfile scheduler hands out whole files in collection order and, by
# default, reorders them by number of tests, which put these one-test files (a real model, a
# server pair) last: one worker ran them alone at the end while the other sat idle. The Makefile
# passes --no-loadscope-reorder and this hook puts them first, the rest by number of tests as
# before. A stale entry costs only balance, never correctness; tests within a file keep their order.
# test_min_budget_http.py comes third, not second: its single-process server has test_lm_eval.py's
# flags, so when the first worker reaches it that server's programs are already in the run's XLA
# cache; starting both at once would compile them twice.
LONG_FILES = (
    "tests/serve/test_lm_eval.py",
    "tests/models/test_smollm2.py",
    "tests/serve/test_min_budget_http.py",
    "tests/serve/test_disagg.py",
    "tests/serve/test_router.py",
    "tests/kernels/test_gpu_check.py",
    "tests/serve/test_batcher.py",
    "tests/serve/test_paged_batcher.py",
    "tests/serve/test_prefix_l3.py",
    "tests/smartgen/test_smartgen_api.py",
    "tests/smartgen/test_smartgen_compiles.py",
    "tests/smartgen/test_harness.py",
    "tests/serve/test_supervision.py",
    "tests/serve/test_server_api.py",
    "tests/serve/test_config_shutdown.py",
)


def pytest_collection_modifyitems(session, config, items):
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(path: str):
        return (LONG_FILES.index(path), 0) if path in LONG_FILES else (len(LONG_FILES), -len(files[path]))

    items[:] = [item for path in sorted(files, key=rank) for item in files[path]]
