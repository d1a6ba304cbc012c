"""The `jkv demo` / experiments harness end to end on a tiny checkpoint: its control endpoint and its
decode workers pass the prefill workers' handshake (a decode side that declares no configuration is
refused), and the transfer modes generate the same tokens through it (DESIGN.md invariant)."""
import numpy as np

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


def test_harness_with_compression_keeps_the_mode_invariant_and_plans_kr_on_wire_bytes(tmp_path, monkeypatch):
    """experiments/smartgen_ttst.py's compression part on a tiny checkpoint: a fixed pipeline moves
    every path compressed and full / smartgen generate the same tokens (the prefill side's copy is
    decode(encode(KV))); "auto" picks the profile at the paced link and Eq. 2 then plans Kr on the
    compressed bytes, so more blocks go proactively than uncompressed at the same pace."""
    from jkv.compression.profiling import ProfileFile, ProfilePoint, save_profile
    from jkv.transfer.profile import build_profile

    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = write_tiny_llama(tmp_path / "tiny", layers=6)
    spec = "hadamard+kivi4g32+zstd3"
    profile_path = tmp_path / "profile.json"
    save_profile(profile_path, ProfileFile("prose", 0.9, 1 << 20, (ProfilePoint(spec, 0.98, 3.5, 1e-3, 1e9),)))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 320, 300).tolist() for _ in range(2)]
    h = Harness(str(ckpt), selector="oracle", prefill_workers=1, max_blocks=16, say=lambda *a: None)
    try:
        h.profile = build_profile(h.model, h.selector, "oracle", {300: prompts[:1]}, 2, max_blocks=16)
        h.pace_link(prompts, ratio=1.5, tp_runs=1)  # the metadata leaves part of the window at this pace
        full_c = h.run("full", prompts, 4, compression=spec)
        smart_c = h.run("smartgen", prompts, 4, compression=spec)
        for o in full_c + smart_c:
            assert o.finish_reason == "length"
            assert o.metrics.extra["compression_paths"] == dict(push=spec, on_demand="f16", metadata="zstd1")
        assert [o.token_ids for o in smart_c] == [o.token_ids for o in full_c]
        # lossy metadata (int8 rows): every mode selects from the same dequantized values
        q8 = dict(metadata="q8+zstd1")
        full_q8 = h.run("full", prompts, 4, compression=spec, compression_options=q8)
        smart_q8 = h.run("smartgen", prompts, 4, compression=spec, compression_options=q8)
        for o in full_q8 + smart_q8:
            assert o.metrics.extra["compression_paths"] == dict(push=spec, on_demand="f16", metadata="q8+zstd1")
        assert [o.token_ids for o in smart_q8] == [o.token_ids for o in full_q8]
        assert sum(o.metrics.extra["bytes"]["metadata"] for o in smart_q8) < 0.75 * sum(
            o.metrics.extra["bytes"]["metadata"] for o in smart_c)
        smart = h.run("smartgen", prompts, 4)
        auto = h.run("smartgen", prompts, 4, compression="auto",
                     compression_options=dict(profiles=[str(profile_path)], q_min=0.97, calibrate=False))  # s_p as given
        assert [o.metrics.extra["compression"] for o in auto] == [spec, spec]
        assert [o.metrics.extra["compression_paths"]["metadata"] for o in auto] == ["q8+zstd1"] * 2  # a lossy push
        assert [o.token_ids for o in auto] == [o.token_ids for o in full_q8]  # same pipeline and codecs: same values
        plain_kr = [o.metrics.extra["kr"] for o in smart]
        auto_kr = [o.metrics.extra["kr"] for o in auto]
        assert all(a > p for a, p in zip(auto_kr, plain_kr)), (plain_kr, auto_kr)
    finally:
        h.close()
