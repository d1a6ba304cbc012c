"""Config file + flag precedence, startup log lines, and graceful shutdown draining a live stream."""
import argparse
import signal

import httpx
import pytest

from conftest import ServerProcess
from jkv.serving.config import ServeConfig, add_serve_arguments, config_from_args


def parse(argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_defaults_file_and_flag_precedence(tmp_path):
    assert parse([]) == ServeConfig()
    assert ServeConfig().host == "127.0.0.1"
    y = tmp_path / "c.yaml"
    y.write_text("max-slots: 3\nmodel: m1\nupstream: http://a:1\nrole: router\n")
    cfg = parse(["--config", str(y), "--model", "m2"])
    assert (cfg.batcher.max_slots, cfg.model, cfg.upstream, cfg.role) == (3, "m2", ("http://a:1",), "router")
    t = tmp_path / "c.toml"
    t.write_text('max_model_len = 300\nupstream = ["http://a:1", "http://b:2"]\nrole = "router"\n')
    cfg = parse(["--config", str(t), "--max-model-len", "200"])
    assert (cfg.batcher.max_model_len, cfg.upstream) == (200, ("http://a:1", "http://b:2"))


@pytest.mark.parametrize("text,match", [
    ("max_slotz: 3\n", "unknown option 'max_slotz'"),
    ("max_slots: many\n", "max_slots='many' must be a int"),
    ("max_slots: 0\n", "max_slots=0 must be >= 1"),
    ("role: router\n", "needs at least one --upstream"),
    ("upstream: [ftp://x]\nrole: router\n", "must be an http"),
    ("- 1\n", "must hold a mapping"),
    ("kv_layout: rows\n", "kv_layout='rows' must be one of"),
    ("num_pages: 1\n", "num_pages=1 must be >= 2"),
    ("prefill_chunk: 4\n", "prefill_chunk=4 must be >= 16"),
])
def test_bad_config_values_name_the_option(tmp_path, text, match):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        parse(["--config", str(f)])


def test_serve_help_explains_every_flag(capsys):
    from jkv.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--role", "--host", "--max-slots", "--max-model-len", "--upstream", "--health-interval",
                 "--graceful-timeout", "--kv-layout", "--page-size", "--num-pages", "--prefill-chunk"):
        assert flag in out


def test_config_file_server_logs_components_and_drains_on_sigterm(tmp_path, tiny_dir, cache_env):
    f = tmp_path / "serve.toml"
    # The resulting shapes (6 slots, 1024 tokens) are the shared `server`'s: the programs this server's
    # request runs come from the run's XLA cache (tests/conftest.py), where that server's warm-up put them.
    f.write_text(f'model = "{tiny_dir}"\nserved-model-name = "from-file"\nmax_slots = 2\nmax_model_len = 1024\n')
    s = ServerProcess(["--config", str(f), "--max-slots", "6", "--port", "0"], env=cache_env)
    try:
        log = "".join(s.log)
        # the default paged cache: room for 6 requests of 1024 tokens in 16-token pages, plus the null page
        assert "engine:" in log and "continuous batching of up to 6 requests" in log
        assert "paged KV cache of 385 pages x 16 tokens" in log and "prefill in chunks of 512 tokens" in log
        assert f"listening on {s.url}" in log and "127.0.0.1" in s.url
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["id"] == "from-file"
        body = {"model": "from-file", "prompt": "fox", "max_tokens": 300, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            s.proc.send_signal(signal.SIGTERM)  # mid-stream: the response must still complete
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2]
        assert s.proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health")
    finally:
        s.stop(signal.SIGKILL)
