"""The transport package stays independent of the engine and the model code."""
from __future__ import annotations

import subprocess
import sys

from transport_consts import REPO  # noqa: E402  (tests/transport is on sys.path)


def test_transport_imports_neither_jax_nor_models_nor_jkv():
    code = ("import sys, transport, transport.tool, transport.netns, transport.rdma, transport.rdma_plan; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'models', 'jkv', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
