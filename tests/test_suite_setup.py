"""The test run's own set-up (tests/conftest.py, `make test`): what keeps the suite within CI's time."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_conftest():
    """tests/conftest.py itself (`import conftest` may name tests/serve/conftest.py, depending on
    which tests this process ran first). Re-running its top level is harmless: the cache variables
    are already set, so it leaves them alone."""
    spec = importlib.util.spec_from_file_location("tests_root_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_xla_compilations_go_to_the_shared_cache_and_child_processes_inherit_it():
    import jax
    import jax.numpy as jnp

    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert cache.is_dir() and jax.config.jax_compilation_cache_dir == str(cache)
    before = set(os.listdir(cache))
    # A shape no other test compiles, so the entry is new whichever worker ran what before.
    jax.jit(lambda x: jnp.cumsum(x * 3.0 + 1.0))(jnp.ones((7, 11, 13), jnp.float32)).block_until_ready()
    assert set(os.listdir(cache)) - before, f"no new entry under {cache}"
    # servers and workers are started with os.environ: they compile into (and read from) the same place
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.config.jax_compilation_cache_dir)"],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(cache), out.stderr[-2000:]


def test_long_files_exist_and_are_scheduled_first():
    conftest = _load_conftest()
    for path in conftest.LONG_FILES:
        assert (ROOT / path).is_file(), f"{path} in tests/conftest.py LONG_FILES no longer exists; update the list"

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item(n) for n in ("tests/a.py::t1", "tests/b.py::t1", "tests/b.py::t2", conftest.LONG_FILES[1] + "::x",
                               conftest.LONG_FILES[0] + "::y", conftest.LONG_FILES[0] + "::z")]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [conftest.LONG_FILES[0] + "::y", conftest.LONG_FILES[0] + "::z",
                                         conftest.LONG_FILES[1] + "::x", "tests/b.py::t1", "tests/b.py::t2",
                                         "tests/a.py::t1"]


def test_make_test_keeps_the_collection_order_of_files():
    # xdist's loadfile scheduler otherwise re-sorts files by number of tests, and the long one-test
    # files run last again, alone on one worker.
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "--dist loadfile --no-loadscope-reorder" in recipe
