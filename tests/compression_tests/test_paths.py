"""Compression on every path (jkv.compression.paths): row-granular on-demand replies decode to
exactly the values the request's chunks decode to, metadata round-trips losslessly, the per-path
choice follows the envelope, and a corrupted part is rejected before it is decoded."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.compression import pipeline as pipeline_module
from jkv.compression.container import ContainerError
from jkv.compression.kv_transfer import ChunkPlan, KVCodec, RequestCodec
from jkv.compression.paths import (F16, METADATA_CODEC, PathCosts, choose_paths, decode_rows, encode_rows,
                                   exact_row_option, pack_framed_reply, pack_metadata, padded_rows, row_granular,
                                   unpack_metadata, METADATA_Q8, q8_metadata_values)
from jkv.compression.policy import CompressionConfig, CompressionPolicy
from jkv.compression.spec import PipelineSpec
from jkv.framing import unpack
from jkv.kvbuffers.fetch import FetchCall, read_reply

H, N, D = 3, 300, 64


@pytest.mark.parametrize("spec, row", [
    ("identity+tok4g32+zstd3", True), ("identity+tok8g64+none", True), ("identity+none+zstd3", True),
    ("hadamard+tok4g32+zstd3", False), ("identity+kivi4g32+none", False), ("delta16+tok4g32+zstd3", False),
    ("identity+ch4g32+none", False), ("identity+mixed-44f-g32+zstd3", False),
])
def test_which_specs_are_row_granular(spec, row):
    assert row_granular(PipelineSpec.parse(spec)) is row


def test_exact_row_option_keeps_the_quantizer_and_drops_the_entropy_coder():
    assert exact_row_option("identity+tok4g32+zstdh3") == "identity+tok4g32+none"
    assert exact_row_option("hadamard+kivi2g32+zstd3") == F16  # decoded values are float16 numbers
    assert exact_row_option("identity+none+zstd3") == F16
    assert exact_row_option("identity+none+none") is None and exact_row_option(None) is None


def absorbed(spec: str, seed: int):
    """(original float16 rows, this worker's copy after absorb) of one layer f32[2, H, N, D]."""
    kv = (np.random.default_rng(seed).normal(size=(2, H, N, D)) * 3).astype(np.float32)
    kv[:, :, 7] *= 40  # an outlier token: its groups get a wide scale, the others must not
    codec = KVCodec(min_chunk_tokens=64)
    state = RequestCodec(codec.pipeline(spec), ChunkPlan.for_geometry(N, N, 1, 64))
    copy = kv.copy()
    state.absorb(2, copy)
    return kv.astype(np.float16), copy, codec


@pytest.mark.parametrize("spec", ["identity+tok4g32+zstd3", "identity+tok2g16+lz4", "identity+tok8g64+none",
                                  "hadamard+kivi4g32+zstd3", "identity+none+zstd3"])
def test_row_replies_decode_to_the_chunk_values(spec):
    """Any subset of rows, in any order and count, decodes bit for bit to what its chunks decoded to
    (the prefill side's copy): the transfer-mode invariant cannot depend on which path brought a row."""
    original, copy, codec = absorbed(spec, 0)
    option = exact_row_option(spec)
    pipeline = None if option == F16 else codec.pipeline(option)
    rng = np.random.default_rng(1)
    for n in (1, 7, 16, 17, 100, 299):
        h = int(rng.integers(0, H))
        pos = rng.choice(N, n, replace=False)
        source = copy if option == F16 else original
        part = encode_rows(pipeline, option, source[0, h, pos], source[1, h, pos], 2)
        got = decode_rows(part, n, D)
        np.testing.assert_array_equal(got[0], copy[0, h, pos])
        np.testing.assert_array_equal(got[1], copy[1, h, pos])
        assert len(part) < 2 * n * D * 4 * 0.6 or n < 16  # fewer bytes than the float32 rows


def test_uncompressed_rows_travel_exactly():
    k, v = (np.random.default_rng(2).normal(size=(2, 5, D)).astype(np.float32))
    got = decode_rows(encode_rows(None, None, k, v, 0), 5, D)
    np.testing.assert_array_equal(got, np.stack([k, v]))


def test_padded_rows_stay_within_one_and_a_half():
    sizes = {padded_rows(n) for n in range(1, 5000)}
    assert all(padded_rows(n) >= n and (padded_rows(n) <= 1.5 * n or n <= 16) for n in range(1, 5000))
    assert len(sizes) <= 2 * math.ceil(math.log2(5000 / 16)) + 1  # two jit shapes per octave


def test_metadata_round_trips_losslessly_and_smaller():
    rng = np.random.default_rng(3)
    smooth = np.cumsum(rng.normal(size=(1, 3, 200, 16)), axis=2).astype(np.float32)  # like partial keys
    leaves = [smooth, rng.integers(0, 2**32, (1, 3, 4), dtype=np.uint64).astype(np.uint32), np.array([[True, False]])]
    payload = pack_metadata(dict(rid="r", layer=4), leaves, METADATA_CODEC)
    header, body = unpack(payload)
    assert header["rid"] == "r" and header["layer"] == 4 and header["cmeta"] == 1
    out = unpack_metadata(body)
    for a, b in zip(leaves, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert len(payload) < sum(a.nbytes for a in leaves)


def test_q8_metadata_is_within_half_a_step_per_row_and_smaller():
    """Lossy metadata: every float row (last axis) comes back as int8 codes times its float16
    absmax scale — within half a step of the original — and exactly what `q8_metadata_values`
    computes (what every transfer mode of the request selects from); integer and bool leaves and
    rows of zeros travel exactly; fewer bytes than the lossless codec."""
    rng = np.random.default_rng(4)
    keys = np.cumsum(rng.normal(size=(1, 3, 300, 16)), axis=2).astype(np.float16)  # like partial keys
    keys[0, 1, 7] = 0  # a row of zeros: scale 1, codes 0
    leaves = [keys, rng.integers(0, 2**31, (1, 3, 4)).astype(np.int32), np.array([[True, False]])]
    payload = pack_metadata(dict(rid="r", layer=4), leaves, METADATA_Q8)
    header, body = unpack(payload)
    assert header["cmeta"] == 1
    out = unpack_metadata(body)
    assert [(a.shape, a.dtype) for a in out] == [(a.shape, a.dtype) for a in leaves]
    step = np.abs(keys.astype(np.float32)).max(-1, keepdims=True) / 127
    err = np.abs(out[0].astype(np.float32) - keys.astype(np.float32))
    assert (err <= 0.51 * step + np.abs(keys.astype(np.float32)) * 2.0**-10).all(), float((err / step).max())
    assert not out[0][0, 1, 7].any()
    assert not np.array_equal(out[0], keys)  # it is lossy
    for a, b in zip(q8_metadata_values(leaves), out):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(out[1], leaves[1])
    np.testing.assert_array_equal(out[2], leaves[2])
    lossless = pack_metadata(dict(rid="r", layer=4), leaves, METADATA_CODEC)
    assert len(payload) < 0.75 * len(lossless)
    with pytest.raises(ValueError, match="metadata codec"):
        pack_metadata({}, leaves, "q4+zstd1")


def test_a_flipped_bit_in_any_part_is_rejected_not_decoded(monkeypatch):
    """Every byte of a row part and of a metadata container is covered by its checksum: the
    rejection comes before any decode program runs."""
    original, copy, codec = absorbed("identity+tok4g32+zstd3", 4)
    decodes = []
    factory = pipeline_module._decode_fn
    monkeypatch.setattr(pipeline_module, "_decode_fn",
                        lambda *key: (lambda sections: (decodes.append(key), factory(*key)(sections))[1]))
    pos = np.arange(20)
    parts = [encode_rows(codec.pipeline("identity+tok4g32+none"), "identity+tok4g32+none", original[0, 0, pos],
                         original[1, 0, pos], 2),
             encode_rows(None, F16, copy[0, 0, pos], copy[1, 0, pos], 2),
             unpack(pack_metadata(dict(rid="r", layer=1), [copy[0, 0]], METADATA_CODEC))[1].tobytes(),
             unpack(pack_metadata(dict(rid="r", layer=1), [copy[0, 0]], METADATA_Q8))[1].tobytes()]
    rng = np.random.default_rng(5)
    for i, part in enumerate(parts):
        for at in list(range(0, 64)) + list(rng.integers(0, len(part), 64)):
            bad = bytearray(part)
            bad[at] ^= 1 << int(rng.integers(0, 8))
            with pytest.raises(ContainerError):
                decode_rows(bytes(bad), 20, D) if i < 2 else unpack_metadata(bytes(bad))
    assert decodes == []
    decode_rows(parts[0], 20, D)  # the spy sees a good part decode
    assert len(decodes) == 1


def test_read_reply_fails_only_the_corrupted_item():
    original, copy, codec = absorbed("hadamard+kivi4g32+zstd3", 6)
    call = FetchCall(2)
    call.add("a", [((0, 0), np.arange(5)), ((0, 1), np.arange(0))], framed=True)
    call.add("b", [((1, 0), np.arange(3)), ((1, 1), np.arange(4, 6))])
    assert call.framed and call.segment_items == [0, 1, 1]
    good_a = encode_rows(None, F16, copy[0, 0, :5], copy[1, 0, :5], 2)
    rows_b = np.concatenate([copy[:, 0, :3], copy[:, 1, 4:6]], axis=1)
    bad_b = bytearray(encode_rows(None, None, rows_b[0], rows_b[1], 2))
    bad_b[-3] ^= 0x10
    reply, failed = read_reply(pack_framed_reply([good_a, bytes(bad_b)]), call, D, "test", decode_rows)
    assert list(failed) == [1] and "checksum" in failed[1]
    np.testing.assert_array_equal(reply[:, :5], copy[:, 0, :5])
    assert not reply[:, 5:].any()  # the rejected item's rows were never decoded
    with pytest.raises(RuntimeError, match="parts"):
        read_reply(pack_framed_reply([good_a]), call, D, "test", decode_rows)


def test_choose_paths_follows_the_envelope_per_path():
    costs = PathCosts(head_dim=D)
    fixed = choose_paths("identity+tok4g32+zstd3", None, costs, fixed=True)
    assert (fixed.on_demand, fixed.metadata) == ("identity+tok4g32+none", METADATA_CODEC)
    slow = choose_paths("hadamard+kivi2g32+zstd3", 1e6, costs)  # 8 Mbit/s: every byte counts
    assert (slow.on_demand, slow.metadata) == (F16, METADATA_Q8)  # a lossy push: lossy metadata offered
    fast = choose_paths("identity+tok4g32+zstd3", 100e9, costs)  # beyond every B*_p (Theorem 6.1)
    assert (fast.on_demand, fast.metadata) == (None, None)
    plain = choose_paths("identity+none+none", 1e6, costs)  # float32 values: no exact smaller rows
    assert plain.push is None and plain.on_demand is None and plain.labels()["push"] == "none"
    assert plain.metadata == METADATA_CODEC  # an exact push keeps exact metadata, however slow the link
    # a forced metadata codec, whatever the push and the link
    assert choose_paths("identity+none+none", 1e6, costs, metadata=METADATA_Q8).metadata == METADATA_Q8
    assert choose_paths("hadamard+kivi2g32+zstd3", 1e6, costs, metadata="zstd1").metadata == METADATA_CODEC
    assert choose_paths("identity+tok4g32+zstd3", None, costs, fixed=True, metadata=METADATA_Q8).metadata == METADATA_Q8
    assert choose_paths("hadamard+kivi2g32+zstd3", 1e6, costs, metadata="none").metadata is None
    with pytest.raises(ValueError, match="metadata codec 'q4'"):
        choose_paths("hadamard+kivi2g32+zstd3", 1e6, costs, metadata="q4")
    with pytest.raises(ValueError, match="metadata codec"):
        CompressionConfig("hadamard+kivi2g32+zstd3", metadata="lossy")
    # q8 wins over zstd1 where its (cr, s) line is lower: B < (1/cr_z - 1/cr_q) / (1/s_q - 1/s_z) ... here s
    # are equal, so at every finite rate where compressing pays at all
    mid = choose_paths("hadamard+kivi2g32+zstd3", 50e6, costs)
    assert mid.metadata == METADATA_Q8
    # at the break-even of the row pipeline's line against the uncompressed one (B*_p = (1 - 1/cr) s)
    cr, s = costs.on_demand_line("identity+tok4g32+none")
    b_star = (1 - 1 / cr) * s
    assert choose_paths("identity+tok4g32+zstd3", 0.9 * b_star, costs).on_demand == "identity+tok4g32+none"
    assert choose_paths("identity+tok4g32+zstd3", 1.1 * b_star, costs).on_demand is None


def test_a_fixed_pipeline_compresses_every_path():
    choice = CompressionPolicy(CompressionConfig("identity+tok4g32+zstd3")).choose(10**6)
    assert choice.spec_id == "identity+tok4g32+zstd3" and choice.on_demand == "identity+tok4g32+none"
    assert choice.metadata == METADATA_CODEC and choice.paths.labels()["on_demand"] == "identity+tok4g32+none"


def test_eq2_counts_the_bytes_that_cross_so_a_compressed_push_gets_more_proactive_blocks():
    """A push compressed cr_wire times fits cr_wire times the blocks in the prefill window (SmartGen
    Eq. 2 on the wire bytes); "off", an uncompressed choice and a fixed pipeline (no measured cr) plan
    as uncompressed."""
    from jkv.compression.profiling import ProfileFile, ProfilePoint
    from jkv.transfer.plan import BlockGeometry, TransferConfig

    cr_fp16 = 3.85
    prof = ProfileFile("w", 0.9, 1 << 20, (ProfilePoint("hadamard+kivi4g128+zstdh3", 0.98, cr_fp16, 0.01, 1e8),))
    kv, meta = 94e6, 7e6  # one 2K-token SmolLM2 request (float32 KV, InfiniGen metadata)
    auto = CompressionPolicy(CompressionConfig("auto", profiles=("unused",), q_min=0.97), bandwidth_bps=20e6,
                             profiles=[prof])
    choice = auto.choose(int(kv), t_model_s=6.0)
    assert choice.spec_id == "hadamard+kivi4g128+zstdh3" and choice.metadata == METADATA_Q8
    kv_wire, meta_wire = auto.wire_bytes(choice, kv, meta)
    assert kv_wire == pytest.approx(kv / (2 * cr_fp16))  # profile CR is against fp16; the pool is float32
    assert meta_wire == pytest.approx(meta / PathCosts().metadata_q8_cr)
    lossless = CompressionPolicy(CompressionConfig("auto", profiles=("unused",), q_min=0.97, metadata="zstd1"),
                                 bandwidth_bps=20e6, profiles=[prof])
    assert lossless.wire_bytes(lossless.choose(int(kv), t_model_s=6.0), kv, meta)[1] == pytest.approx(
        meta / PathCosts().metadata_cr)
    fixed = CompressionPolicy(CompressionConfig("hadamard+kivi4g128+zstdh3"))
    assert fixed.wire_bytes(fixed.choose(int(kv)), kv, meta)[0] == kv
    assert auto.wire_bytes(None, kv, meta) == (kv, meta)
    geometry = BlockGeometry(2048, 30, 64)
    cfg = TransferConfig(mode="smartgen", bandwidth_bps=20e6)
    plain, compressed = cfg.kr(geometry, 6.0, kv, meta), cfg.kr(geometry, 6.0, kv_wire, meta_wire)
    assert plain < compressed <= geometry.num_blocks
    assert compressed >= 5 * plain  # ~7.7x the KV and 2.06x the metadata through the same window


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=2, max_size=2), st.booleans()), min_size=1,
                max_size=4),
       st.data())
def test_framed_replies_round_trip_and_reject_exactly_the_corrupted_items(items, data):
    """Property: any items (per-head row counts, float32 or exact float16), any one byte of any part
    corrupted -> that item alone is reported and left zero, every other row arrives bit for bit."""
    rng = np.random.default_rng(len(items))
    call, parts, expected = FetchCall(1), [], []
    for i, (counts, f16) in enumerate(items):
        call.add(f"r{i}", [((i, h), np.arange(c)) for h, c in enumerate(counts)], framed=True)
        rows = rng.normal(size=(2, sum(counts), D)).astype(np.float16 if f16 else np.float32).astype(np.float32)
        parts.append(encode_rows(None, F16 if f16 else None, rows[0], rows[1], 1))
        expected.append(rows)
    victim = data.draw(st.integers(0, len(parts) - 1))
    at = data.draw(st.integers(0, len(parts[victim]) - 1))
    bad = bytearray(parts[victim])
    bad[at] ^= data.draw(st.integers(1, 255))
    parts[victim] = bytes(bad)
    reply, failed = read_reply(pack_framed_reply(parts), call, D, "prop", decode_rows)
    assert list(failed) == [victim]
    row = 0
    for i, rows in enumerate(expected):
        n = rows.shape[1]
        np.testing.assert_array_equal(reply[:, row:row + n], 0 if i == victim else rows)
        row += n
