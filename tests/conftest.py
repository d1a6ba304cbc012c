"""Shared pytest fixtures and hardware-marker handling."""
import os

# Tests run on CPU unless a gpu-marked test asks otherwise; keep XLA from grabbing all cores'
# memory and make results deterministic.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
