"""Constants shared by the transport tests.

A uniquely named module (not `conftest`) so that `from transport_consts import ...` cannot pick
up another test directory's conftest when several directories are collected in one run.
"""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRET = "test-secret-0123"
