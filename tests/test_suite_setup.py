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


_LOGITS = """
import sys
import numpy as np
from models import tiny_model
m = tiny_model("llama", seed=3)
ids = np.random.default_rng(0).integers(3, 300, (4, 57)).astype(np.int32)
logits, _ = m.prefill(ids, np.asarray([57, 40, 21, 9], np.int32))
sys.stdout.buffer.write(np.asarray(logits, np.float32).tobytes())
"""


def test_xla_cpu_backend_optimization_is_off_and_moves_logits_by_rounding_only():
    import importlib.util

    import numpy as np

    if importlib.util.find_spec("jax_plugins") is not None:
        assert "--xla_backend_optimization_level=0" not in os.environ.get("XLA_FLAGS", "")
        return  # a GPU machine keeps XLA's default optimization (tests/conftest.py)
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    # The same tiny model's prefill logits with LLVM at level 0 and at XLA's default: they differ in the
    # last bits only (the two round differently), the order of any change of kernel, and pick the same
    # tokens.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR")  # each compiles its own programs
    outs = []
    for flags in (os.environ["XLA_FLAGS"], os.environ["XLA_FLAGS"].replace("--xla_backend_optimization_level=0", "")):
        out = subprocess.run([sys.executable, "-c", _LOGITS], env=dict(env, XLA_FLAGS=flags), capture_output=True,
                             timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        outs.append(np.frombuffer(out.stdout, np.float32).reshape(-1, 301))
    o0, default = outs
    assert o0.shape == (4, 301) and (o0.argmax(-1) == default.argmax(-1)).all()
    np.testing.assert_allclose(o0, default, rtol=1e-5, atol=1e-5)


# Top-level packages newer Pythons add to the standard library (sys.stdlib_module_names lists only
# the running interpreter's): Python 3.14's `compression` (compression.zstd, which its zipfile,
# tarfile and shutil import) would have been shadowed by tests/compression.
NEWER_STDLIB_PACKAGES = {"compression", "annotationlib"}


def test_no_test_package_shadows_an_installed_distribution():
    """pytest puts tests/ first on sys.path (rootdir-relative imports), so a test directory with an
    __init__.py is a top-level package named like the directory: `tests/kernels` hid Hugging Face's
    `kernels` (a dependency of transformers >= 5.25), and every test that imported transformers'
    hub-kernel integration failed with "cannot import name 'CUDAProperties' from 'kernels'". The
    standard library's names count too, this interpreter's and those of newer Pythons."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions())  # top-level import names of distributions
    taken = installed | set(sys.stdlib_module_names) | NEWER_STDLIB_PACKAGES
    packages = [p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")]
    assert packages, "no test package found: the check would pass vacuously"
    clashes = sorted(name for name in packages if name in taken)
    assert not clashes, (f"tests/{clashes[0]} is importable as the top-level package {clashes[0]!r}, which "
                         f"{'an installed distribution' if clashes[0] in installed else 'the standard library'} "
                         f"also provides; rename the test directory")
