"""JKV_WARMUP (jkv/serving/launch.py warmup_enabled): the colocated server compiles every decode
program at start unless the environment sets 0 (the test servers' setting, tests/serve/conftest.py);
any other value is refused naming the fix."""
import argparse

import pytest

from jkv.serving import launch
from jkv.serving.config import add_serve_arguments, config_from_args
from jkv.serving.paged_batcher import PagedBatcher


def config(*argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("value, calls", [(None, 1), ("1", 1), ("0", 0)])
def test_build_all_warms_up_unless_jkv_warmup_is_0(tiny_dir, monkeypatch, value, calls):
    if value is None:
        monkeypatch.delenv("JKV_WARMUP", raising=False)
    else:
        monkeypatch.setenv("JKV_WARMUP", value)
    seen = []
    monkeypatch.setattr(PagedBatcher, "warmup", lambda self: seen.append(self))
    _app, engine = launch.build_all(config("--model", str(tiny_dir), "--max-slots", "2", "--max-model-len", "64"))
    try:
        assert len(seen) == calls and (not seen or seen[0] is engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("value", ["no", "false", ""])
def test_any_other_value_is_refused_naming_the_fix(monkeypatch, value):
    monkeypatch.setenv("JKV_WARMUP", value)
    with pytest.raises(ValueError, match=r"JKV_WARMUP=.*use 1 .* or 0"):
        launch.warmup_enabled()
