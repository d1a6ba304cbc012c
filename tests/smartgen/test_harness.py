"""The `jkv demo` / experiments harness end to end on a tiny checkpoint: its control endpoint and its
decode workers pass the prefill workers' handshake (a decode side that declares no configuration is
refused), and the transfer modes generate the same tokens through it (DESIGN.md invariant)."""
from jkv.disagg.harness import Harness
from tests.serve.tiny_ckpt import write_tiny_llama


def test_harness_connects_and_full_equals_partial(tmp_path, monkeypatch):
    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path / "cache"))  # the prefill processes inherit it
    ckpt = write_tiny_llama(tmp_path / "tiny")
    lines = []
    h = Harness(str(ckpt), selector="oracle", prefill_workers=1, max_blocks=16, say=lines.append)
    try:
        assert lines and "1 prefill worker processes ready" in lines[0]
        prompts = [list(range(3, 43)), list(range(7, 40))]
        full = h.run("full", prompts, 3)
        partial = h.run("partial", prompts, 3, kr_fraction=0.3, strategy="sequential")
        assert [o.finish_reason for o in full + partial] == ["length"] * 4
        assert [o.token_ids for o in full] == [o.token_ids for o in partial]
        assert h.prefill_cpu_s() > 0
    finally:
        h.close()
