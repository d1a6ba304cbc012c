"""End-to-end pipeline: lossless exactness, CR accounting, self-describing decode, validation."""
import json
import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.compression import (Calibration, ContainerError, Pipeline, PipelineSpec, compression_ratio, decode_block,
                             enumerate_space, inspect_block, measure)
from jkv.compression.container import PREFIX
from jkv.compression.packing import packed_nbytes
from jkv.compression.spec import CodecSpec, QuantizerSpec, TransformSpec

from .conftest import kv_like
from .test_codecs_container import _reseal, _split


@pytest.mark.parametrize("sid", ["identity+none+none", "hadamard+kivi4g32+zstd3", "delta16+tok2g64+lz4",
                                 "affine+ch8g16+none", "identity+mixhq16s2r50g32+zstd1",
                                 "hadamard+mixed-84f.222-g16+none", "hadamard+ec75g128+zstdh3"])
def test_spec_id_round_trip(sid):
    spec = PipelineSpec.parse(sid)
    assert spec.id == sid == str(spec) and PipelineSpec.parse(spec.id) == spec
    assert hash(spec) == hash(PipelineSpec.parse(sid))


@pytest.mark.parametrize("bad", ["hadamard+kivi4g32", "rot+none+none", "identity+kivi4+none", "identity+none+brotli",
                                 "identity+mixed-8x-g4+none", "identity+none+zstd30",
                                 "identity+ec5g32+none", "identity+ec50+none", "identity+none+zstdh0"])
def test_spec_parse_errors(bad):
    with pytest.raises(ValueError):
        PipelineSpec.parse(bad)


def test_enumerate_space_is_the_cartesian_product():
    space = enumerate_space([TransformSpec(), TransformSpec("hadamard")],
                            [QuantizerSpec(), QuantizerSpec("kivi", 2, 32), QuantizerSpec("kivi", 4, 32)],
                            [CodecSpec(), CodecSpec("zstd", 3)])
    assert len(space) == 12 and len({s.id for s in space}) == 12
    assert sum(s.is_lossless for s in space) == 2
    with pytest.raises(ValueError, match="duplicate"):
        enumerate_space([TransformSpec(), TransformSpec()], [QuantizerSpec()], [CodecSpec()])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("codec", ["none", "zstd3", "lz4"])
def test_lossless_pipeline_is_bitwise_exact(dtype, codec):
    x = kv_like(1, dtype=dtype)
    data = Pipeline(PipelineSpec.parse(f"identity+none+{codec}")).encode_block(x, layer=0, kind="k")
    y = decode_block(data)
    assert y.dtype == jnp.dtype(dtype) and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("spec", ["hadamard+kivi4g128+zstdh3", "identity+tok4g32+zstd3", "delta16+tok4g32+zstd3",
                                  "hadamard+kivi2g32+lz4", "identity+none+none"])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_roundtrip_block_is_bitwise_what_a_receiver_decodes(spec, kind):
    """The prefill side's copy (`roundtrip_block`, decoded from the sections without parsing the
    bytes back) must equal decode_block(bytes) bit for bit: the transfer modes' token identity
    rests on both sides holding the same values."""
    x = kv_like(3, shape=(3, 200, 64))
    data, y = Pipeline(PipelineSpec.parse(spec)).roundtrip_block(x, layer=2, kind=kind)
    assert data == Pipeline(PipelineSpec.parse(spec)).encode_block(x, layer=2, kind=kind)
    ref = decode_block(data)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), np.asarray(ref).view(np.uint8))


def test_cr_counts_every_byte_of_metadata(block):
    h, n, d = block.shape
    spec = PipelineSpec.parse("delta8+tok4g32+none")
    data = Pipeline(spec).encode_block(block, layer=3, kind="v")
    header, payload = _split(data)
    codes = packed_nbytes(h * n * d, 4)
    scales_and_zeros = 2 * (h * n * (d // 32)) * 2  # float16
    anchors = h * (n // 8) * d * 2
    assert len(payload) == header["raw_nbytes"] == codes + scales_and_zeros + anchors
    assert len(data) == PREFIX.size + len(json.dumps(header, separators=(",", ":"), sort_keys=True)) + len(payload)
    assert compression_ratio([data]) == pytest.approx(block.nbytes / len(data))
    info, _ = inspect_block(data)
    assert (info.layer, info.kind, info.shape, info.raw_nbytes, info.nbytes) == (3, "v", block.shape, block.nbytes, len(data))
    # Uncompressed "compression" costs the header: CR just below 1, never reported as 1.
    raw = Pipeline(PipelineSpec()).encode_block(block, layer=0, kind="k")
    assert 0.95 < compression_ratio([raw]) < 1.0


def test_affine_parameters_travel_in_the_block_and_decode_needs_no_calibration(block):
    calib = Calibration(kv={(0, "k"): kv_like(7)})
    data = Pipeline(PipelineSpec.parse("affine+tok8g32+none"), calib).encode_block(block, layer=0, kind="k")
    _, sections = inspect_block(data)
    assert sections["affine.shift"].shape == (3, 64) and sections["affine.scale"].dtype == np.float16
    x_hat = np.asarray(decode_block(data), np.float32)
    assert np.abs(x_hat - block).max() < 0.05 * np.abs(block).max()


def test_hadamard_tames_outlier_channels_for_per_token_quantization():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 40, 64)).astype(np.float32)
    x[:, :, [3, 17]] *= 20.0  # a few massive channels, as in real keys
    block = x.astype(np.float16)
    x = block.astype(np.float32)
    errs = {}
    for t in ("identity", "hadamard"):
        # KIVI quantizes V per token (the same jitted plan as the KIVI tests below).
        y = decode_block(Pipeline(PipelineSpec.parse(f"{t}+kivi2g32+zstd3")).encode_block(block, layer=0, kind="v"))
        errs[t] = np.linalg.norm(np.asarray(y, np.float32) - x) / np.linalg.norm(x)
    assert errs["hadamard"] < 0.6 * errs["identity"]


@pytest.mark.parametrize("bits, max_rel", [(2, 0.6), (4, 0.12), (8, 0.01)])
def test_kivi_relative_error_per_bit_width(block, bits, max_rel):
    pipe = Pipeline(PipelineSpec.parse(f"identity+kivi{bits}g32+zstd3"))
    x = block.astype(np.float32)
    for kind in "kv":
        y = np.asarray(decode_block(pipe.encode_block(block, layer=0, kind=kind)), np.float32)
        assert np.linalg.norm(y - x) / np.linalg.norm(x) < max_rel


def test_mixhq_keeps_retrieval_heads_at_high_precision(block):
    calib = Calibration(head_scores=np.array([[0.1, 0.8, 0.3]]))
    pipe = Pipeline(PipelineSpec.parse("identity+mixhq16s2r34g32+none"), calib)
    assert pipe.plan(0, "k", 3).head_bits == (2, 16, 2)
    y = np.asarray(decode_block(pipe.encode_block(block, layer=0, kind="k")))
    np.testing.assert_array_equal(y[1], block[1])
    assert np.abs(y[0] - block[0]).mean() > 0.01


@pytest.mark.parametrize("make, match", [
    (lambda b: Pipeline(PipelineSpec()).encode_block(b, layer=0, kind="q"), "'k' or 'v'"),
    (lambda b: Pipeline(PipelineSpec()).encode_block(b, layer=-1, kind="k"), "layer"),
    (lambda b: Pipeline(PipelineSpec()).encode_block(b[0], layer=0, kind="k"), r"\[H_kv, Nb, D\]"),
    (lambda b: Pipeline(PipelineSpec()).encode_block(b.astype(np.int32), layer=0, kind="k"), "dtype"),
    (lambda b: Pipeline(PipelineSpec.parse("hadamard+kivi2g32+none")).encode_block(b[:, :, :48], layer=0, kind="k"),
     "power-of-two"),
    (lambda b: Pipeline(PipelineSpec.parse("affine+kivi2g32+none")), "needs Calibration"),
    (lambda b: Pipeline(PipelineSpec.parse("affine+kivi2g32+none"), Calibration(kv={(0, "k"): b})).encode_block(
        b, layer=1, kind="k"), r"layer=1"),
    (lambda b: Pipeline(PipelineSpec.parse("identity+mixhq8s2r25g32+none")), "MixHQ needs"),
])
def test_encode_errors_are_clear(block, make, match):
    with pytest.raises(ValueError, match=match):
        make(block)


@pytest.mark.parametrize("value", [np.nan, np.inf, 1e5])
def test_non_finite_or_out_of_range_values_are_rejected_when_quantizing(block, value):
    x = block.astype(np.float32)
    x[1, 2, 3] = value
    with pytest.raises(ValueError, match="finite"):
        Pipeline(PipelineSpec.parse("identity+kivi4g32+none")).encode_block(x, layer=0, kind="k")


@pytest.mark.parametrize("mutate, match", [
    (lambda h: h["plan"].update(head_bits=[4, 4, 4]), "do not match"),
    (lambda h: h.update(shape=[3, 41, 64]), "do not match"),
    (lambda h: h.update(shape=[3, 40]), "three positive ints"),
    (lambda h: h.update(transform="hadamard"), "do not match"),
    (lambda h: h.update(transform="rot"), "invalid block header"),
    (lambda h: h.update(dtype="int8"), "block dtype"),
    (lambda h: h.update(kind="x"), "kind"),
    (lambda h: h.update(layer=True), "layer"),
    (lambda h: h.pop("plan"), "invalid block header"),
    (lambda h: h["plan"].update(axis="diagonal"), "axis"),
])
def test_decode_validates_header_semantics(block, mutate, match):
    header, payload = _split(Pipeline(PipelineSpec.parse("delta8+kivi2g32+zstd3")).encode_block(block, layer=0, kind="k"))
    mutate(header)
    with pytest.raises(ContainerError, match=match):
        decode_block(_reseal(header, payload))


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from(["shape", "dtype", "transform", "plan", "kind", "layer"]),
                       st.recursive(st.none() | st.integers(-3, 70) | st.sampled_from(["k", "hadamard", "float16", "token"]),
                                    lambda c: st.lists(c, max_size=4) | st.dictionaries(
                                        st.sampled_from(["head_bits", "axis", "group"]), c, max_size=3),
                                    max_leaves=10), min_size=1))
def test_fuzzed_block_headers_raise_container_error_or_decode(overrides):
    header, payload = _split(_BLOCK_BYTES)
    header.update(overrides)
    try:
        y = decode_block(_reseal(header, payload))
    except ContainerError:
        return
    assert y.shape == (3, 16, 8)


_BLOCK_BYTES = Pipeline(PipelineSpec.parse("identity+kivi2g8+none")).encode_block(
    kv_like(3, shape=(3, 16, 8)), layer=0, kind="k")


def test_measure_reports_cr_and_throughput(block):
    pipe = Pipeline(PipelineSpec.parse("identity+kivi4g32+zstd3"))
    report = measure(pipe, [(0, "k", block), (0, "v", block)], repeats=2)
    encoded = [pipe.encode_block(block, layer=0, kind=k) for k in "kv"]
    assert report.raw_bytes == 2 * block.nbytes
    assert report.cr == pytest.approx(compression_ratio(encoded), rel=1e-6)
    assert report.cr > 2.5  # 4-bit codes + fp16 scales, per-channel groups padded 40 -> 64 tokens
    assert report.encode_Bps > 0 and report.decode_Bps > 0
    assert report.throughput_Bps == pytest.approx(1 / (1 / report.encode_Bps + 1 / report.decode_Bps))


def test_concurrent_encodes_are_deterministic(block):
    pipe = Pipeline(PipelineSpec.parse("affine+kivi2g32+lz4"), Calibration(kv={(0, "k"): block}))
    expected = pipe.encode_block(block, layer=0, kind="k")
    results = []
    threads = [threading.Thread(target=lambda: results.append(pipe.encode_block(block, layer=0, kind="k")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4
