"""Shared pytest fixtures and hardware-marker handling."""
import importlib.util
import os
import shutil
import tempfile

import pytest

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
# Likewise one directory of tiny-model parameters (models.model.TINY_PARAMS_CACHE_ENV): each new
# process that builds a `tiny:` model paid ~6 CPU-s for flax's eager init; from the file ~0.2 s.
_OWN_PARAMS = None
if "JKV_TINY_PARAMS_CACHE" not in os.environ:
    _OWN_PARAMS = tempfile.mkdtemp(prefix="jkv-test-tiny-params-")
    os.environ["JKV_TINY_PARAMS_CACHE"] = _OWN_PARAMS
    os.environ["JKV_TEST_PARAMS_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
if importlib.util.find_spec("filelock") is not None:  # jax refuses a size limit without it
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

# XLA:CPU's LLVM backend at optimization level 0 (XLA reads XLA_FLAGS when its backend starts, so the
# workers and every process they start get it too): the suite compiles hundreds of small programs
# once or twice each, and LLVM's optimization was much of each compile (tests/serve/test_batcher.py,
# back to back: 88.5 -> 56.9 CPU-s; a tiny-model `jkv serve`, side by side: 29.2 -> 21.6 CPU-s to
# ready, 35.3 -> 25.3 after five requests). XLA's own HLO passes (fusion, layout) still run. Results differ in the
# last bits only (optimized and unoptimized code round differently; test_suite_setup.py checks the
# size and that the tokens agree): a test comparing two jkv paths runs both under the same flag. Not where a jax plugin (CUDA)
# is installed (a GPU machine, the second CI stage's venv): GPU programs keep the default.
_XLA_OPT = "--xla_backend_optimization_level="
if _XLA_OPT not in os.environ.get("XLA_FLAGS", "") and importlib.util.find_spec("jax_plugins") is None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_XLA_OPT}0".strip()


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
    if _OWN_PARAMS is not None and os.environ.get("JKV_TEST_PARAMS_OWNER") == str(os.getpid()):
        shutil.rmtree(_OWN_PARAMS, ignore_errors=True)


# Test files that take a minute or more of wall time in CI (the --durations of `make test`), longest
# first. pytest-xdist's loadfile scheduler hands out whole files in collection order and, by
# default, reorders them by number of tests, which put these one-test files (a real model, a
# server pair) last: one worker ran them alone at the end while the other sat idle. The Makefile
# passes --no-loadscope-reorder and this hook puts them first, the rest by number of tests as
# before. A stale entry costs only balance, never correctness; tests within a file keep their order.
# test_min_budget_http.py comes third, not second: its single-process server has test_lm_eval.py's
# flags, so when the first worker reaches it that server's programs are already in the run's XLA
# cache; starting both at once would compile them twice.
# The order after the first three follows the --durations of a CI run (1806 s, 2 workers): the
# tensor-parallel, multihost, dropping, metrics-transfer and reconnect files took 45-150 s each but
# were missing here, so the one- to three-test ones among them were handed out last.
LONG_FILES = (
    "tests/serve/test_lm_eval.py",
    "tests/models/test_smollm2.py",
    "tests/serve/test_min_budget_http.py",
    "tests/compression_tests/test_dropping.py",
    "tests/compression_tests/test_splits.py",
    "tests/smartgen/test_smartgen_tensor_parallel.py",
    "tests/models/test_multihost.py",
    "tests/models/test_tensor_parallel.py",
    "tests/serve/test_disagg.py",
    "tests/serve/test_prefix_batcher.py",
    "tests/serve/test_paged_batcher.py",
    "tests/kernel_tests/test_gpu_check.py",
    "tests/serve/test_disagg_reconnect.py",
    "tests/serve/test_metrics_transfer.py",
    "tests/serve/test_router.py",
    "tests/serve/test_router_prefix.py",
    "tests/smartgen/test_smartgen_admission.py",
    "tests/selection/test_quest_int8.py",
    "tests/selection/test_min_budget.py",
    "tests/serve/test_batcher.py",
    "tests/serve/test_prefix_l3.py",
    "tests/serve/test_prefix_loading.py",
    "tests/smartgen/test_smartgen_api.py",
    "tests/smartgen/test_smartgen_compiles.py",
    "tests/smartgen/test_smartgen_layer_programs.py",
    "tests/smartgen/test_prefix_split.py",
    "tests/smartgen/test_prefill_cache.py",
    "tests/kvcache/test_prefill_prefix_cache.py",
    "tests/smartgen/test_harness.py",
    "tests/serve/test_supervision.py",
    "tests/serve/test_server_api.py",
    "tests/serve/test_config_shutdown.py",
    "tests/serve/test_multihost_serve.py",
    "tests/serve/test_schedule.py",
    "tests/smartgen/test_smartgen_staging.py",
    "tests/selection/test_fused_topk.py",
    "tests/serve/test_schedule_l3.py",
)


def pytest_collection_modifyitems(session, config, items):
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(path: str):
        return (LONG_FILES.index(path), 0) if path in LONG_FILES else (len(LONG_FILES), -len(files[path]))

    items[:] = [item for path in sorted(files, key=rank) for item in files[path]]


@pytest.fixture
def count_compiles():
    """``with count_compiles() as compiles:`` collects one entry per XLA backend compile inside the
    block (jax.monitoring), so a test can assert that a warm-up left nothing to compile."""
    import contextlib

    import jax.monitoring

    @contextlib.contextmanager
    def counting():
        compiles = []

        def listener(event, duration, **kw):
            if event == "/jax/core/compile/backend_compile_duration":
                compiles.append(event)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            yield compiles
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)

    return counting
