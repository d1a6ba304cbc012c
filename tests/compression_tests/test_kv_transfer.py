"""Compressed KV on the SmartGen block path: chunking, frame round trip, and end to end through
real prefill workers (loopback TCP, paced links) in full / partial / smartgen modes."""
import dataclasses
import threading
import time

import numpy as np
import pytest

from jkv.compression import Profile, measure
from jkv.compression.controller import BASELINE, ControllerConfig
from jkv.compression.kv_transfer import ChunkPlan, KVCodec, apply_frame
from jkv.compression.pipeline import Pipeline
from jkv.compression.policy import CompressionConfig, CompressionPolicy
from jkv.compression.profiling import ProfileFile, ProfilePoint
from jkv.compression.spec import PipelineSpec
from jkv.disagg import protocol as proto
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.prefill_worker import PrefillWorker
from jkv.disagg.selectors import build_selector
from jkv.engine import Request
from jkv.kvbuffers.geometry import LOCAL, REMOTE, BlockGeometry
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from models import tiny_model

pytestmark = pytest.mark.timeout(240)  # a hung transfer fails the test (with every thread's stack)

SECRET = "kvserve-test-secret"
SPEC = "hadamard+kivi2g32+zstd3"  # lossy enough to change a tiny model's greedy tokens
PROMPT_LENS = (70, 200, 45)
MAX_TOKENS = 5
S_P = 50e6  # B/s, the test profile's (de)compression throughput


def test_chunks_cover_whole_blocks_and_all_tokens():
    for n, m, min_tokens in [(1000, 1024, 128), (45, 16, 128), (200, 16, 64), (300, 7, 1)]:
        g = BlockGeometry(n, 2, m)
        plan = ChunkPlan.for_geometry(n, g.blocks_per_layer, g.block_tokens, min_tokens)
        spans = [plan.tokens(c) for c in range(plan.num_chunks)]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
        assert all(stop - start >= min(min_tokens, n - start) for start, stop in spans if stop > start)
        for c in range(plan.num_chunks):  # a chunk is exactly the tokens of its blocks
            blocks = [g.token_range(b) for b in plan.blocks(c) if not g.is_empty(b)]
            if blocks:
                assert (blocks[0][0], blocks[-1][1]) == plan.tokens(c)


def test_frame_round_trip_is_exactly_the_absorbed_values():
    rng = np.random.default_rng(0)
    L, H, N, D, cap = 2, 2, 150, 16, 256
    g = BlockGeometry(N, L, 16)
    codec = KVCodec(min_chunk_tokens=64)
    state = codec.start(SPEC, g)
    assert codec.start("off" if False else BASELINE, g) is None  # the uncompressed id: plain writes
    prefill_kv = rng.standard_normal((2, L, H, N, D)).astype(np.float32)
    original = prefill_kv.copy()
    for layer in range(L):
        state.absorb(layer, prefill_kv[:, layer])
    assert not np.array_equal(prefill_kv, original)  # lossy: the prefill copy was replaced
    assert np.abs(prefill_kv - original).max() < 2.0
    kv = np.zeros((2, L, H, cap, D), np.float32)
    mask = np.full((L, cap), REMOTE, np.int8)
    chunks, covered = state.cover([0, 1])  # blocks 0, 1 of layer 1 -> the first chunk (all its blocks)
    assert chunks == [0] and covered == list(state.chunks.blocks(0))
    header, payload = proto.unpack(state.frame("r", 1, chunks))
    assert apply_frame(header, payload, kv, mask) == len(payload)
    start, stop = state.chunks.tokens(0)
    assert stop - start >= 64
    np.testing.assert_array_equal(kv[:, 1, :, start:stop], prefill_kv[:, 1, :, start:stop])
    assert (mask[1, start:stop] == LOCAL).all() and (mask[1, stop:] == REMOTE).all() and (mask[0] == REMOTE).all()
    with pytest.raises(ValueError, match="does not fit"):
        apply_frame(dict(header, chunks=[[start, cap + 1, *header["chunks"][0][2:]]]), payload, kv, mask)
    with pytest.raises(ValueError, match="layer"):
        apply_frame(dict(header, layer=L), payload, kv, mask)


def test_warm_receive_compiles_every_chunk_batch_a_frame_can_decode_in(count_compiles):
    """After the decode worker's warm-up (`CompressionPolicy.warm_receive`), decoding a frame of
    any number of full-size chunks up to the warmed length compiles nothing: a first-met batch
    size used to compile on the notify thread while every other frame waited behind it."""
    from jkv.compression.pipeline import decode_blocks

    class Cfg:
        num_layers, num_kv_heads, head_dim = 3, 2, 16

    policy = CompressionPolicy(CompressionConfig("hadamard+kivi2g16+zstd3"))
    assert policy.warm_receive(Cfg, max_tokens=5 * 128) == 2 * 3  # K and V layouts x batches 1, 2, 4
    pipeline = KVCodec().pipeline("hadamard+kivi2g16+zstd3")
    x = np.random.default_rng(1).standard_normal((2, 128, 16)).astype(np.float16)
    blocks = [pipeline.encode_block(x, layer=layer, kind=kind) for layer in range(3) for kind in ("k", "v")]
    with count_compiles() as compiles:
        for count in range(1, 6):  # 3 = 2 + 1, 5 = 4 + 1: power-of-two batches, all warmed
            decode_blocks(blocks[:2] * count)
    assert compiles == []
    assert CompressionPolicy(CompressionConfig("off")).warm_receive(Cfg) == 0


def test_warm_absorb_leaves_nothing_to_compile_in_a_requests_prefill(count_compiles):
    """`KVCodec.warm_absorb` (what a prefill worker runs on a decode worker's "warm_codec"
    notification) compiles every batch a layer of whole chunks is absorbed in, up to max_tokens."""
    codec = KVCodec(min_chunk_tokens=64)
    assert codec.warm_absorb("identity+kivi2g16+zstd3", 2, 2, 16, max_tokens=7 * 64) == 3 * 2  # 1, 2, 4 chunks; K, V
    with count_compiles() as compiles:
        for chunks in (3, 7):
            n = chunks * 64
            state = codec.start("identity+kivi2g16+zstd3", BlockGeometry(n, 2, n // 16))  # 16-token blocks
            assert state.chunks.chunk_tokens == 64
            layer = np.random.default_rng(chunks).standard_normal((2, 2, n, 16)).astype(np.float32)
            state.absorb(1, layer)
    assert compiles == []


def test_config_validates_the_choice():
    with pytest.raises(ValueError, match="pipeline id"):
        CompressionConfig("zip")
    with pytest.raises(ValueError, match="profile files"):
        CompressionConfig("auto")
    with pytest.raises(ValueError, match="unknown compression options"):
        CompressionConfig.from_options(SPEC, {"bits": 2})
    from jkv.disagg.config import Disaggregation

    with pytest.raises(ValueError, match="profile files"):
        Disaggregation(TransferConfig(mode="full"), compression="auto")
    assert Disaggregation(TransferConfig(mode="full")).compression_policy() is None  # the default is off
    policy = Disaggregation(TransferConfig(mode="full"), compression=SPEC, bandwidth="1gbit").compression_policy()
    assert policy.choose(10**6).spec_id == SPEC and policy.estimator.estimate() == 1e9 / 8
    assert CompressionPolicy(CompressionConfig("off")).choose(10**6) is None
    assert CompressionPolicy(CompressionConfig(SPEC)).choose(10**6).spec_id == SPEC


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", 0)


@pytest.fixture(scope="module")
def selector(model):
    return build_selector(model, "oracle")


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(11)
    return [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in PROMPT_LENS]


def raw_bytes(model, prompts) -> int:
    cfg = model.cfg
    return sum(2 * cfg.num_layers * cfg.num_kv_heads * len(p) * cfg.head_dim * 4 for p in prompts)


class Workers:
    """One in-process prefill worker (real TCP endpoints) on a paced link."""

    def __init__(self, model, selector, bandwidth):
        self.worker = PrefillWorker(model, selector, "prefill-0", secret=SECRET, bandwidth=bandwidth,
                                    codec=KVCodec(min_chunk_tokens=64))
        self.addresses = [self.worker.listen()]
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def close(self):
        self.worker.close()
        self.thread.join(5)
        assert self.worker.held() == [] and self.worker.pool.bytes_in_use == 0


def run(model, selector, addresses, mode, prompts, policy):
    decode = DecodeWorker(model, selector, TransferConfig(mode=mode, kr_fraction=0.3, max_blocks=16, strategy="random"), secret=SECRET,
                          compression=policy)
    try:
        decode.connect(addresses)
        outs = decode.generate([Request(f"r{i}", p, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                                for i, p in enumerate(prompts)])
        assert all(o.finish_reason == "length" for o in outs), [o.metrics.extra.get("error") for o in outs]
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0 and decode.pool.bytes_in_use == 0
        return outs
    finally:
        decode.close()


def proactive_bytes(outs) -> int:
    return sum(o.metrics.extra["bytes"]["proactive"] for o in outs)


@pytest.fixture(scope="module")
def fast_link(model, selector):
    w = Workers(model, selector, "10gbit")
    yield w
    w.close()


def test_fixed_profile_keeps_the_mode_invariant(model, selector, prompts, fast_link):
    """Same pipeline in full / partial / smartgen -> identical tokens; the loss reaches the output
    (the tokens differ from uncompressed), and "off" is the plain path."""
    addresses = fast_link.addresses
    off = run(model, selector, addresses, "full", prompts, None)
    assert proactive_bytes(off) == raw_bytes(model, prompts) and "compression" not in off[0].metrics.extra
    policy = CompressionPolicy(CompressionConfig(SPEC))
    tokens = {}
    for mode in ("full", "partial", "smartgen"):
        outs = run(model, selector, addresses, mode, prompts, policy)
        assert all(o.metrics.extra["compression"] == SPEC for o in outs)
        # codec seconds for serving's histograms: encode on the prefill side, decode of every frame here
        assert all(o.metrics.extra["compression_reason"] == "fixed" and o.metrics.extra["encode_s"] > 0
                   and o.metrics.extra["decode_s"] > 0 for o in outs), mode
        tokens[mode] = [o.token_ids for o in outs]
        if mode == "full":
            full_bytes = proactive_bytes(outs)
        else:
            assert sum(o.metrics.extra["on_demand_ratio"] for o in outs) > 0  # rows really came on demand
    assert tokens["partial"] == tokens["full"] and tokens["smartgen"] == tokens["full"]
    assert tokens["full"] != [o.token_ids for o in off]
    # the decode worker told the prefill worker its pipeline on connecting: warmed before any request
    assert fast_link.worker._warmed_codecs == {PipelineSpec.parse(SPEC).id}
    assert full_bytes < raw_bytes(model, prompts) / 4  # 2-bit codes vs float32 rows


def tiny_profile(model, prompts) -> tuple[ProfileFile, float]:
    """A one-point Pareto set measured on this model's KV (fp16), cut into the chunks the transfer
    sends (CR is measured at the granularity it is used at: every container header counts)."""
    blocks = []
    for p in prompts:
        n = len(p)
        _, kv = model.prefill(np.asarray([p], np.int32), np.asarray([n], np.int32))
        g = BlockGeometry(n, model.cfg.num_layers, 16)
        plan = ChunkPlan.for_geometry(n, g.blocks_per_layer, g.block_tokens, 64)
        for c in range(plan.num_chunks):
            start, stop = plan.tokens(c)
            blocks += [(layer, kind, np.asarray(x[0, :, start:stop], np.float16)) for layer, (k, v) in enumerate(kv)
                       for kind, x in (("k", k), ("v", v)) if stop > start]
    report = measure(Pipeline(PipelineSpec.parse(SPEC)), blocks, repeats=1)
    # s_p fixed (a measured one is noisy on a loaded machine): B*_p = (1 - 1/cr_wire) * 100 MB/s of f32
    point = ProfilePoint(SPEC, 0.99, report.cr, report.raw_bytes / S_P, S_P)
    return ProfileFile("test", 0.97, report.raw_bytes, (point,)), report.cr


def test_controller_skips_compression_on_a_fast_link(model, selector, prompts, fast_link):
    profile, _ = tiny_profile(model, prompts)
    policy = CompressionPolicy(CompressionConfig("auto", profiles=("unused",), controller=ControllerConfig(epsilon=0)),
                               bandwidth_bps=10e9,
                               profiles=[profile])
    wire = Profile(SPEC, profile.points[0].cr * 2, profile.points[0].throughput_Bps * 2, 0.99)
    assert wire.threshold_Bps < 10e9 / 8  # Theorem 6.1: this profile cannot pay off at 10 Gbit/s
    waits = fast_link.worker.link_sample_waits
    outs = run(model, selector, fast_link.addresses, "full", prompts, policy)
    assert all(o.metrics.extra["compression"] == BASELINE for o in outs)
    # per path (jkv.compression.paths): at 10 Gbit/s neither the replies nor the metadata pay off
    assert all(o.metrics.extra["compression_paths"] == dict(push="none", on_demand="none", metadata="none")
               for o in outs)
    assert proactive_bytes(outs) == raw_bytes(model, prompts)  # plain float32 rows, nothing else
    # No compression chosen: no hand-off waited for push acknowledgements; the link samples come
    # in "link" notifications once the pushes are acknowledged (possibly after generate returns).
    assert fast_link.worker.link_sample_waits == waits
    deadline = time.monotonic() + 10
    while policy.estimator.samples < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert policy.estimator.samples == len(prompts)  # the pushes fed the live estimate ...
    assert policy.estimator.estimate() != 10e9 / 8  # ... with measured busy-time goodput


def test_controller_compresses_on_a_slow_link_and_bytes_drop_by_cr(model, selector, prompts):
    profile, cr = tiny_profile(model, prompts)
    # The file claims a codec slower than the link (1 kB/s): charged as is, compression would never pay.
    # The decode worker measures the real transfer path at start (CompressionConfig.calibrate), so it does.
    profile = dataclasses.replace(profile, points=tuple(dataclasses.replace(p, throughput_Bps=1e3, latency_s=1e3)
                                                        for p in profile.points))
    # The selector metadata travels compressed too (jkv.compression.paths), so a smartgen batch of
    # these short prompts moves ~126 KiB: below the default 128 KiB floor of a link sample.
    policy = CompressionPolicy(CompressionConfig("auto", profiles=("unused",), controller=ControllerConfig(epsilon=0),
                                                 min_sample_bytes=64 << 10),
                               bandwidth_bps=5e6,
                               profiles=[profile])
    slow = Workers(model, selector, "5mbit")
    try:
        tokens = {}
        for mode in ("full", "smartgen"):
            outs = run(model, selector, slow.addresses, mode, prompts, policy)
            assert all(o.metrics.extra["compression"] == SPEC for o in outs), mode
            assert policy.path_Bps[SPEC] > 1e5, policy.path_Bps  # measured by the worker, not the file's 1 kB/s
            assert all(o.metrics.extra["compression_reason"] == "greedy" for o in outs), mode  # epsilon=0
            # at 5 Mbit/s the other paths compress too: exact float16 rows (KIVI is not row-granular)
            # and, the push being lossy, the int8 metadata codec
            assert all(o.metrics.extra["compression_paths"] == dict(push=SPEC, on_demand="f16", metadata="q8+zstd1")
                       for o in outs), mode
            tokens[mode] = [o.token_ids for o in outs]
            if mode == "full":
                wire_cr = raw_bytes(model, prompts) / proactive_bytes(outs)
        assert tokens["smartgen"] == tokens["full"]
        # float32 rows -> fp16 containers: the wire ratio is 2 x the profile's CR (frame headers
        # cost a little)
        assert 0.9 * 2 * cr <= wire_cr <= 2 * cr, (wire_cr, cr)
        # every full-mode hand-off carried a link sample; a smartgen one moves only its proactive
        # blocks and the int8 metadata before it, which can stay under min_sample_bytes (no sample)
        assert len(prompts) <= policy.estimator.samples <= 2 * len(prompts)
        assert slow.worker.link_sample_waits >= 2  # compressed batches wait for their pushes' acks
    finally:
        slow.close()


@pytest.mark.parametrize("spec, n, blocks", [("hadamard+kivi4g128+zstdh3", 512, 64), ("hadamard+kivi4g128+zstdh3", 2048, 64),
                                             ("hadamard+kivi4g128+zstdh3", 300, 64), ("identity+kivi2g32+none", 512, 64),
                                             ("hadamard+ec40g128+zstdh3", 512, 64)])
def test_served_kv_is_the_profile_evaluations_round_trip(spec, n, blocks):
    """What the decode side's pool holds after a compressed transfer (prefill `absorb` -> `frame` ->
    receiver `apply_frame`) is bit-identical to what the profile evaluation scores
    (`workloads.chunked_roundtrip` of the fp16 KV at the same chunk size): Table 1's figures
    describe the served KV. The smartgen geometries (512 and 2048 tokens, 64 blocks a layer) chunk at
    128 tokens, the profiles' chunk; a geometry whose blocks do not divide 128 chunks at a whole
    number of blocks (300 tokens: 5-token blocks, 130-token chunks)."""
    from jkv.compression.workloads import chunked_roundtrip

    rng = np.random.default_rng(n)
    L, H, D = 2, 3, 64
    scale = np.linspace(0.2, 5.0, D)[rng.permutation(D)]  # channel outliers, as real keys have
    prefill_kv = (rng.standard_normal((2, L, H, n, D)) * scale).astype(np.float32)
    kv16 = [(prefill_kv[0, layer].astype(np.float16), prefill_kv[1, layer].astype(np.float16)) for layer in range(L)]
    g = BlockGeometry(n, L, blocks)
    codec = KVCodec(min_chunk_tokens=128)
    state = codec.start(spec, g)
    pool = np.zeros((2, L, H, n, D), np.float32)
    mask = np.full((L, n), REMOTE, np.int8)
    for layer in range(L):
        state.absorb(layer, prefill_kv[:, layer])  # in place: the prefill copy becomes decode(encode(.))
        header, payload = proto.unpack(state.frame("r", layer, range(state.chunks.num_chunks)))
        apply_frame(header, payload, pool, mask)
    assert (mask == LOCAL).all()
    np.testing.assert_array_equal(pool, prefill_kv)  # the prefill side keeps exactly what it sent
    chunk = state.chunks.chunk_blocks * state.chunks.block_tokens
    assert chunk == (128 if n in (512, 2048) else 130)
    profiled, _, _, _ = chunked_roundtrip(Pipeline(PipelineSpec.parse(spec)), kv16, chunk)
    for layer, (k, v) in enumerate(profiled):
        np.testing.assert_array_equal(pool[0, layer], k)
        np.testing.assert_array_equal(pool[1, layer], v)


def test_calibrate_for_measures_the_profiles_the_quality_floor_allows_and_can_be_turned_off():
    import types

    cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=64)
    low = "identity+kivi2g32+none"
    profile = ProfileFile("test", 0.0, 1 << 20, (ProfilePoint(SPEC, 0.99, 3.0, 1e3, 1e3),
                                                 ProfilePoint(low, 0.5, 6.0, 1e3, 1e3)))
    policy = CompressionPolicy(CompressionConfig.from_options("auto", dict(profiles=["unused"], q_min=0.97)),
                               bandwidth_bps=5e6, profiles=[profile])
    measured = policy.calibrate_for(cfg)
    assert set(measured) == {SPEC} and measured[SPEC] > 1e5  # the 0.5-quality point is never chosen: not measured
    assert policy.choose(kv_bytes=8 << 20).spec_id == SPEC  # charged its measured path, it pays at 5 Mbit/s
    off = CompressionPolicy(CompressionConfig.from_options("auto", dict(profiles=["unused"], calibrate=False)),
                            bandwidth_bps=5e6, profiles=[profile])
    assert off.calibrate_for(cfg) == {} and off.path_Bps == {}
    assert off.choose(kv_bytes=8 << 20).spec_id == BASELINE  # the file's 1 kB/s codec never pays
