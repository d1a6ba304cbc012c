"""The batched prefill-side codec (`RequestCodec.absorb` -> `Pipeline.roundtrip_chunks`) and the
receiver's batched decode (`apply_frame` -> `decode_blocks`) against the per-chunk path they
replaced (`absorb_reference`: `roundtrip_block` per chunk; `decode_block` per container): the same
container bytes and bit-identical float32 KV, for every pipeline of the committed serving profile
and the other stage families, at chunk counts that split into several power-of-two batches and
with a shorter last chunk."""
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jkv.compression.kv_transfer import KVCodec, absorb_reference, apply_frame
from jkv.compression.dropping import is_dropping_id
from jkv.compression.pipeline import Calibration, Pipeline, _power_of_two_batches, decode_block, decode_blocks
from jkv.compression.spec import PipelineSpec
from jkv.framing import unpack
from jkv.kvbuffers.geometry import LOCAL, REMOTE, BlockGeometry

from .conftest import kv_like

PROFILE = Path(__file__).resolve().parents[2] / "experiments" / "results" / "kvserve_profile_table1_split.json"
# The profile's chunk-codec pipelines: its token-dropping entries (SnapKV tiers, Duo streaming heads)
# are absorbed per request by DroppingCodec (tests/compression_tests/test_dropping.py), not per chunk.
PROFILED = [p["spec_id"] for p in json.loads(PROFILE.read_text())["points"] if not is_dropping_id(p["spec_id"])]
# Stage families the profile lacks: entropy-coded (a mean/std per group), delta anchors, per-head
# mixed bits (several head sets, reordered), per-channel / per-token on both kinds, lz4.
OTHERS = ["hadamard+ec40g128+zstdh3", "delta16+tok2g64+lz4", "identity+mixed-4f8.428.8f4.244.f44.284-g32+zstd1", "identity+ch3g128+zstd3"]
H_KV, D = 3, 64  # SmolLM2-135M's KV geometry


def bits(x: np.ndarray) -> np.ndarray:
    """Bit pattern of a float32 array (so -0.0 != 0.0 and NaN payloads count)."""
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def layer_kv(n: int, seed: int) -> np.ndarray:
    """f32[2, H_kv, N, D]: one layer's K and V with channel outliers and a token trend."""
    return np.stack([kv_like(seed, (H_KV, n, D), np.float32), kv_like(seed + 1, (H_KV, n, D), np.float32)])


def absorb_both(spec: str, n: int, blocks: int, layers=(0, 5), seed: int = 0, calibration=None):
    """The same KV through `absorb` and `absorb_reference`: ((new state, new KV), (old state, old KV))."""
    codec = KVCodec(calibration, min_chunk_tokens=128)
    geometry = BlockGeometry(n, max(layers) + 1, blocks)
    out = []
    for absorb in (lambda s, layer, kv: s.absorb(layer, kv), absorb_reference):
        state = codec.start(spec, geometry)
        kv = np.stack([layer_kv(n, seed + 2 * layer) for layer in layers], axis=1)  # f32[2, layers, H_kv, N, D]
        for j, layer in enumerate(layers):
            absorb(state, layer, kv[:, j])
        out.append((state, kv))
    return out


# 2048 tokens: 16 chunks of 128; 300 tokens: 2 chunks of 130 + one of 40 (the other families: only
# the latter, which has both a batch and a shorter last chunk, to keep the compiles few)
@pytest.mark.parametrize("spec, n, blocks", [(spec, n, 64) for spec in PROFILED for n in (2048, 300)]
                         + [(spec, 300, 64) for spec in OTHERS])
def test_absorb_writes_the_per_chunk_paths_containers_and_values(spec, n, blocks):
    (new, kv_new), (old, kv_old) = absorb_both(spec, n, blocks)
    assert list(new._containers) == list(old._containers)
    for key, (kb, vb) in old._containers.items():
        assert new._containers[key][0] == kb and new._containers[key][1] == vb, key
    np.testing.assert_array_equal(bits(kv_new), bits(kv_old))
    assert (new.raw_bytes, new.encoded_bytes) == (old.raw_bytes, old.encoded_bytes)


def test_absorb_batches_every_full_chunk(monkeypatch):
    """Only a shorter last chunk takes the per-call path; 901 tokens = 7 chunks of 128 (batches of
    4, 2 and 1) + 5 tokens, and a layer of affine-transformed blocks (calibration inputs shared by
    the batch)."""
    calls = []
    single = Pipeline.roundtrip_block
    monkeypatch.setattr(Pipeline, "roundtrip_block", lambda self, x, **kw: calls.append(x.shape) or single(self, x, **kw))
    codec = KVCodec(min_chunk_tokens=128)
    state = codec.start("identity+kivi4g32+zstdh3", BlockGeometry(2048, 1, 64))
    state.absorb(0, layer_kv(2048, 0))
    assert calls == []
    calib = Calibration(kv={(0, kind): kv_like(9, (H_KV, 256, D)) for kind in "kv"})
    (new, kv_new), (old, kv_old) = absorb_both("affine+kivi4g32+zstd3", 901, 901, layers=(0,), calibration=calib)
    assert calls.count((H_KV, 5, D)) == 4  # K and V tails, new and reference; reference: 7 more per kind
    assert len(calls) == 4 + 2 * 7
    assert new._containers == old._containers
    np.testing.assert_array_equal(bits(kv_new), bits(kv_old))


def test_power_of_two_batches():
    assert _power_of_two_batches(0) == [] and _power_of_two_batches(1) == [1]
    assert _power_of_two_batches(16) == [16] and _power_of_two_batches(23) == [16, 4, 2, 1]
    assert all(sum(_power_of_two_batches(c)) == c for c in range(200))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_decode_blocks_is_decode_block_of_each(dtype):
    """Mixed layouts in one call (K and V plans, a shorter block, another pipeline) come back in
    order, each bit for bit `decode_block`'s."""
    hada, ident = Pipeline(PipelineSpec.parse("hadamard+kivi4g32+zstdh3")), Pipeline(PipelineSpec.parse("identity+none+zstd3"))
    blocks = [pipe.encode_block(kv_like(seed, (H_KV, n, D), dtype), layer=1, kind=kind)
              for seed, (pipe, n, kind) in enumerate([(hada, 128, "k"), (hada, 128, "v"), (hada, 128, "k"),
                                                      (hada, 40, "k"), (ident, 128, "v"), (hada, 128, "k"),
                                                      (hada, 128, "v")])]
    got = decode_blocks(blocks)
    assert len(got) == len(blocks)
    for data, x in zip(blocks, got):
        ref = np.asarray(decode_block(data))
        assert x.dtype == ref.dtype and x.shape == ref.shape
        assert x.tobytes() == ref.tobytes()


def test_apply_frame_checks_every_chunk_before_writing_any():
    (state, kv), _ = absorb_both("identity+kivi4g32+zstdh3", 300, 64, layers=(0,))
    header, payload = unpack(state.frame("r", 0, range(state.chunks.num_chunks)))
    pool = np.zeros((2, 1, H_KV, 300, D), np.float32)
    mask = np.full((1, 300), REMOTE, np.int8)
    bad = bytearray(payload)
    bad[-1] ^= 1  # the last chunk's V container: its checksum fails
    with pytest.raises(ValueError, match="checksum"):
        apply_frame(header, bytes(bad), pool, mask)
    assert (mask == REMOTE).all() and not pool.any()
    assert apply_frame(header, payload, pool, mask) == len(payload)
    assert (mask == LOCAL).all()
    np.testing.assert_array_equal(bits(pool[:, 0]), bits(kv[:, 0]))


def test_roundtrip_chunks_validates_its_arguments():
    pipe = Pipeline(PipelineSpec.parse("identity+kivi4g32+zstdh3"))
    x = kv_like(0, (H_KV, 256, D))
    with pytest.raises(ValueError, match="chunk_tokens"):
        pipe.roundtrip_chunks(x, 0, layer=0, kind="k")
    with pytest.raises(ValueError, match="out"):
        pipe.roundtrip_chunks(x, 128, layer=0, kind="k", out=np.zeros((H_KV, 255, D), np.float32))
    with pytest.raises(ValueError, match="H_kv, N, D"):
        pipe.roundtrip_chunks(x[0], 128, layer=0, kind="k")
