"""jkv/xla_options.py: the -O0 check benchmarks and `jkv serve` run on XLA_FLAGS."""
import logging

import pytest

from jkv import xla_options
from jkv.xla_options import backend_opt_level, require_optimized, unoptimized_reason, warn_if_unoptimized


@pytest.mark.parametrize("flags, level", [
    ("", 2),
    ("--xla_force_host_platform_device_count=4", 2),
    ("--xla_backend_optimization_level=0", 0),
    ("--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=1", 1),
    ("--xla_backend_optimization_level=0 --xla_backend_optimization_level=3", 3),  # the last one wins
    ("--xla_backend_optimization_level_extra=0", 2),  # another flag that only shares the prefix
])
def test_backend_opt_level(flags, level):
    assert backend_opt_level(flags) == level
    assert (unoptimized_reason(flags) is None) == (level >= 2)


def test_bad_level_names_the_flag():
    with pytest.raises(ValueError, match="xla_backend_optimization_level=fast"):
        backend_opt_level("--xla_backend_optimization_level=fast")


def test_serve_warns_and_benchmarks_refuse_at_o0(monkeypatch, caplog):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    with caplog.at_level(logging.WARNING, logger=xla_options.log.name):
        assert warn_if_unoptimized("jkv serve")
    assert "jkv serve" in caplog.text and "--xla_backend_optimization_level=2" in caplog.text
    with pytest.raises(SystemExit, match="bench: XLA_FLAGS sets --xla_backend_optimization_level=0"):
        require_optimized("bench")


def test_default_flags_pass(monkeypatch, caplog):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    with caplog.at_level(logging.WARNING, logger=xla_options.log.name):
        assert not warn_if_unoptimized("jkv serve")
    assert caplog.text == ""
    require_optimized("bench")  # no SystemExit
