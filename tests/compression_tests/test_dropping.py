"""Token-dropping profiles on the serving path (jkv/compression/dropping.py): ids, the per-chunk
wire format, the decode side's DROPPED mask, the controller's candidates, and end to end through
real prefill workers: a dense reference with the same drop, and the transfer-mode invariant."""
import functools
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.compression.controller import ControllerConfig
from jkv.compression.dropping import (DroppingCodec, apply_dropping_frame, head_groups, keep_header, pack_keep,
                                      parse_drop, servable, unpack_keep)
from jkv.compression.kv_transfer import ChunkPlan, KVCodec, RequestCodec
from jkv.compression.policy import CompressionConfig, CompressionPolicy, wire_profiles
from jkv.compression.profiling import ProfileFile, ProfilePoint, load_profile, save_profile
from jkv.compression.streaming import MaskedDecoder
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.prefill_worker import PrefillWorker
from jkv.disagg.selectors import build_selector
from jkv.engine import Request
from jkv.framing import unpack
from jkv.kvbuffers.geometry import DROPPED, LOCAL, PAD, BlockGeometry
from jkv.kvcache import sparse
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from models import tiny_model

from .conftest import random_prompts

pytestmark = pytest.mark.timeout(900)  # end to end on a loaded 2-core box: compilation dominates

SECRET = "dropping-test-secret"
PIPE = "hadamard+kivi4g32+none"
TIERS = f"tiers:hi30:{PIPE}:s4w8o8p3"  # small sinks / windows: the tiny prompts have a middle to drop
DUO = f"duo50s4w8:{PIPE}"
MAX_BLOCKS, MIN_CHUNK, MAX_TOKENS = 16, 32, 5
PROMPT_LENS = (70, 150)


# ------------------------------------------------------------------ ids
def test_ids_parse_and_the_unservable_ones_are_refused_with_the_reason():
    d = parse_drop(DUO)
    assert (d.kind, d.keep_pct, d.pipeline, d.sink, d.recent, d.id) == ("duo", 50, PIPE, 4, 8, DUO)
    t = parse_drop(TIERS)
    assert (t.kind, t.keep_pct, t.pipeline, t.window, t.pool, t.id) == ("tiers", 30, PIPE, 8, 3, TIERS)
    assert parse_drop(PIPE) is None and parse_drop(None) is None
    with pytest.raises(ValueError, match="lo tier is not servable"):
        parse_drop(f"tiers:hi20:{PIPE}+lo30:hadamard+kivi2g32+none:s16w64o32p7")
    with pytest.raises(ValueError, match="per-head-uniform"):
        parse_drop("duo50s16w64:identity+mixed-84.22-g32+none")
    assert servable(DUO) and servable(TIERS) and servable(PIPE)
    assert not servable(f"tiers:hi20:{PIPE}+lo30:{PIPE}:s16w64o32p7")
    assert CompressionConfig(DUO).mode == DUO  # a fixed choice in serving
    assert CompressionPolicy(CompressionConfig(TIERS)).choose(1 << 20).spec_id == TIERS


def test_keep_table_packs_and_rejects_a_wrong_size_or_a_flipped_bit():
    keep = np.random.default_rng(0).random((3, 2, 21)) < 0.5
    header = keep_header(keep)
    data = pack_keep(keep).tobytes()
    assert (unpack_keep(data, header["keep"], header["keep_crc"]) == keep).all()
    with pytest.raises(ValueError, match="does not hold"):
        unpack_keep(data, (3, 2, 40))
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << bit % 8
        with pytest.raises(ValueError, match="crc32"):
            unpack_keep(bytes(flipped), header["keep"], header["keep_crc"])


# ------------------------------------------------------------------ wire format
def _keep_table(L, H, n, seed=0):
    """Per head a different number of kept tokens per chunk; head 1 keeps nothing in the middle."""
    rng = np.random.default_rng(seed)
    keep = rng.random((L, H, n)) < np.linspace(0.2, 0.9, H)[None, :, None]
    keep[:, 1, 10:n - 10] = False
    keep[:, :, :2] = True
    return keep


def test_frame_carries_exactly_the_absorbed_kept_rows_and_fewer_bytes():
    L, H, n, D = 2, 3, 150, 32
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, L, H, n, D)).astype(np.float32)
    chunks = ChunkPlan.for_geometry(n, 16, 10, MIN_CHUNK)
    codec = KVCodec(min_chunk_tokens=MIN_CHUNK)
    state = codec.start(DUO, BlockGeometry(n, L, 16))
    assert isinstance(state, DroppingCodec) and state.spec_id == DUO
    keep = _keep_table(L, H, n)
    state.set_keep(keep)
    plain = RequestCodec(codec.pipeline(PIPE), chunks)
    prefill, dense_copy = kv.copy(), kv.copy()
    pool = np.full((2, L, H, n + 8, D), np.nan, np.float32)  # stale bytes: every row must be written
    mask = np.zeros((L, n + 8), np.int8)
    frame_bytes = plain_bytes = 0
    for layer in range(L):
        state.absorb(layer, prefill[:, layer])
        plain.absorb(layer, dense_copy[:, layer])
        data = state.frame("r", layer, range(chunks.num_chunks))
        header, payload = unpack(data)
        assert header["drop"] == 1
        frame_bytes += apply_dropping_frame(header, payload, pool, mask)
        plain_bytes += len(unpack(plain.frame("r", layer, range(chunks.num_chunks)))[1])
    np.testing.assert_array_equal(pool[..., :n, :], prefill)  # the prefill's own copy, bit for bit
    dropped = ~keep[None]
    assert (prefill[np.broadcast_to(dropped, prefill.shape[:4])] == 0).all()
    kept = np.broadcast_to(keep[None], prefill.shape[:4])
    assert np.abs(prefill[kept] - kv[kept]).max() < 0.5  # 4-bit codes of the kept rows, not zeros
    assert (mask[:, :n] == LOCAL).all() and (mask[:, n:] == 0).all()
    assert frame_bytes < 0.75 * plain_bytes  # the dropped rows do not cross
    assert state.cr > plain.cr


def test_a_frame_whose_bits_do_not_match_its_containers_is_rejected():
    L, H, n, D = 1, 3, 64, 32
    kv = np.random.default_rng(2).standard_normal((2, L, H, n, D)).astype(np.float32)
    state = KVCodec(min_chunk_tokens=MIN_CHUNK).start(TIERS, BlockGeometry(n, L, 16))
    keep = _keep_table(L, H, n)
    state.set_keep(keep)
    state.absorb(0, kv[:, 0])
    header, payload = unpack(state.frame("r", 0, [0]))
    pool, mask = np.zeros((2, L, H, n, D), np.float32), np.zeros((L, n), np.int8)
    bad = dict(header, chunks=[header["chunks"][0][:-2]])  # one head group's containers missing
    with pytest.raises(ValueError, match="containers for"):
        apply_dropping_frame(bad, payload, pool, mask)
    bits = bytearray(payload)
    bits[0] ^= 0x04  # one flipped keep bit
    with pytest.raises(ValueError, match="crc32"):
        apply_dropping_frame(header, bytes(bits), pool, mask)
    assert (mask == 0).all()


def test_head_groups_share_counts():
    keep = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1], [1, 1, 1, 1]], bool)
    groups = head_groups(keep)
    assert [g[0].tolist() for g in groups] == [[0, 2], [3]]
    assert groups[0][1].tolist() == [[0, 1], [1, 3]]


# ------------------------------------------------------------------ decode side
def test_drop_dropped_removes_dropped_entries_and_keeps_the_order():
    L, pages, H, P = 2, 4, 2, 4
    mask = jnp.full((L, pages, H, P), LOCAL, jnp.int8)
    table = jnp.asarray([[1, 2]], jnp.int32)  # one request: tokens 0-3 on page 1, 4-7 on page 2
    # rows: layer, page, head, slot of each entry. Layer 1: head 0 drops tokens 2 (page 1 slot 2)
    # and 7 (page 2 slot 3), head 1 drops token 4 (page 2 slot 0); the last entry is padding
    cols = np.asarray([[1, 1, 1, 0], [1, 2, 2, 0], [0, 0, 1, 0], [2, 3, 0, 0]], np.int32)
    values = np.asarray([DROPPED, DROPPED, DROPPED, PAD], np.int8)
    mask = sparse.set_entries(mask, *(jnp.asarray(c) for c in cols), jnp.asarray(values))
    index = jnp.asarray([[7, 2, 4, 1, -1], [3, 4, 0, 6, -1]], jnp.int32)
    out = np.asarray(sparse.drop_dropped(index, mask, jnp.int32(1), table))
    assert out.tolist() == [[4, 1, -1, -1, -1], [3, 0, 6, -1, -1]]
    untouched = np.asarray(sparse.drop_dropped(index, mask, jnp.int32(0), table))  # layer 0 drops nothing
    assert untouched.tolist() == np.asarray(index).tolist()
    assert int(mask[0, 0, 0, 0]) == PAD  # the null page keeps PAD


def test_selectors_spend_their_budget_on_kept_tokens():
    """scores_to_index with `dropped`: the top-k among the kept slots (not the top-k of all slots
    minus the dropped ones), even where a dropped slot is protected (a sink)."""
    from jkv.selection.base import scores_to_index

    scores = jnp.asarray([[[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0]]])  # [B=1, H_kv=1, N=8]
    dropped = jnp.asarray([[[True, True, False, True, False, False, False, False]]])
    lengths = jnp.asarray([8], jnp.int32)
    index = scores_to_index(scores, lengths, 0.5, sinks=1, dropped=dropped)  # budget 4
    assert np.asarray(index).tolist() == [[2, 4, 5, 6]]
    assert np.asarray(scores_to_index(scores, lengths, 0.5, sinks=1)).tolist() == [[0, 1, 2, 3]]
    oracle = build_selector(tiny_model("qwen2", 0), "oracle", min_budget=0)
    assert oracle.masks_dropped  # the decode worker's selection passes the DROPPED slots to it


# ------------------------------------------------------------------ controller
def test_controller_chooses_among_dropping_profiles_in_serving(tmp_path):
    """A profile file's duo / hi-only tier points are controller lines (a lo-tier point is not);
    on a slow link the highest-CR line that meets q_min wins, and it is a dropping profile."""
    lo_tier = f"tiers:hi20:{PIPE}+lo30:hadamard+kivi2g32+none:s16w64o32p7"
    points = (ProfilePoint(PIPE, 0.995, 3.5, 0.01, 1e9), ProfilePoint(DUO, 0.98, 6.0, 0.01, 1e9),
              ProfilePoint(TIERS, 0.98, 9.0, 0.01, 1e9), ProfilePoint(lo_tier, 0.99, 12.0, 0.01, 1e9))
    profile = ProfileFile("code", 0.97, 1 << 20, points)
    names = [p.name for p in wire_profiles(profile)]
    assert names == [PIPE, DUO, TIERS]
    save_profile(tmp_path / "code.json", profile)  # as `jkv serve --compression auto` reads it
    assert load_profile(tmp_path / "code.json").points == points
    policy = CompressionPolicy(CompressionConfig("auto", profiles=(str(tmp_path / "code.json"),), q_min=0.97,
                                                 controller=ControllerConfig(epsilon=0)),
                               bandwidth_bps=10e6)
    choice = policy.choose(kv_bytes=64 << 20)
    assert choice.spec_id == TIERS and parse_drop(choice.spec_id) is not None
    assert choice.on_demand == "f16"  # kept rows on demand: their float16 values (KIVI is not row-granular)
    # with a quality floor the dropping points miss (0.98 < 0.99) the controller keeps the plain pipeline
    strict = CompressionPolicy(CompressionConfig("auto", profiles=("unused",), q_min=0.99,
                                                 controller=ControllerConfig(epsilon=0)),
                               bandwidth_bps=10e6, profiles=[profile])
    assert strict.choose(kv_bytes=64 << 20).spec_id == PIPE


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", 0)


@pytest.fixture(scope="module")
def prompts(model):
    return random_prompts(model, PROMPT_LENS, seed=5)


@pytest.fixture(scope="module")
def prefill(model):
    """selector name -> addresses of an in-process prefill worker running it (started once)."""
    workers = {}

    def addresses(name):
        if name not in workers:
            worker = PrefillWorker(model, selector_for(model, name), "prefill-0", secret=SECRET, bandwidth="10gbit",
                                   codec=KVCodec(min_chunk_tokens=MIN_CHUNK))
            address = worker.listen()
            thread = threading.Thread(target=worker.run, daemon=True)
            thread.start()
            workers[name] = (worker, thread, [address])
        return workers[name][2]

    yield addresses
    for worker, thread, _ in workers.values():
        worker.close()
        thread.join(5)
        assert worker.held() == [] and worker.pool.bytes_in_use == 0


@functools.lru_cache(maxsize=None)
def selector_for(model, name):
    """One selector per (model, name), shared by the prefill worker and every decode worker of this
    module, as the SmartGen tests share theirs: the decode workers' layer programs are shared by
    selector value (decode_program.programs_for), but each selector object jits its own select,
    which the lookahead runs, and InfiniGen's would fit its skew again."""
    return build_selector(model, name, **({} if name == "dense" else dict(min_budget=0)))


def serve(model, selector_name, prefill, mode, prompts, spec):
    decode = DecodeWorker(model, selector_for(model, selector_name),
                          TransferConfig(mode=mode, kr_fraction=0.3, max_blocks=MAX_BLOCKS, strategy="random"),
                          secret=SECRET, compression=CompressionPolicy(CompressionConfig(spec)) if spec else None)
    try:
        decode.connect(prefill(selector_name))
        outs = decode.generate([Request(f"r{i}", p, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                                for i, p in enumerate(prompts)])
        assert all(o.finish_reason == "length" for o in outs), [o.metrics.extra.get("error") for o in outs]
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0
        return outs
    finally:
        decode.close()


def reference(model, prompt, spec, min_chunk=MIN_CHUNK):
    """Colocated: prefill, the same keep table and codec on the same chunks, then dense decoding
    that attends per head to the kept tokens (`streaming.MaskedDecoder`)."""
    n, L = len(prompt), model.cfg.num_layers
    logits, kv = model.prefill(np.asarray([prompt], np.int32), np.asarray([n], np.int32))
    layers = [(np.asarray(k[0, :, :n], np.float32), np.asarray(v[0, :, :n], np.float32)) for k, v in kv]
    state = KVCodec(min_chunk_tokens=min_chunk).start(spec, BlockGeometry(n, L, MAX_BLOCKS))
    keep = state.plan_keep(model, np.asarray(prompt), layers)
    plain = KVCodec(min_chunk_tokens=min_chunk).start(PIPE, BlockGeometry(n, L, MAX_BLOCKS))
    out, plain_bytes = [], 0
    for layer, (k, v) in enumerate(layers):
        both = np.stack([k, v])
        state.absorb(layer, both)
        out.append((both[0], both[1]))
        plain.absorb(layer, np.stack([k, v]))
        plain_bytes += len(plain.frame("r", layer, range(plain.chunks.num_chunks)))
    decoder = MaskedDecoder(model, out, keep, MAX_TOKENS)
    tokens = [int(np.argmax(np.asarray(logits)[0, n - 1] if np.asarray(logits).ndim == 3 else np.asarray(logits)[0]))]
    while len(tokens) < MAX_TOKENS:
        tokens.append(int(np.argmax(decoder.step(tokens[-1]))))
    return tokens, keep, plain_bytes


@pytest.mark.parametrize("spec", [TIERS, DUO])
def test_served_dropping_profile_matches_a_dense_reference_with_the_same_drop(model, prompts, prefill, spec):
    outs = serve(model, "dense", prefill, "full", prompts, spec)
    refs = [reference(model, p, spec) for p in prompts]
    assert [o.token_ids for o in outs] == [r[0] for r in refs]
    assert all(o.metrics.extra["compression"] == spec for o in outs)
    assert any(not keep.all() for _, keep, _ in refs)  # something was really dropped
    # full mode pushes every chunk: fewer bytes than the same pipeline without the drop
    assert sum(o.metrics.extra["bytes"]["proactive"] for o in outs) < sum(r[2] for r in refs)


@pytest.mark.parametrize("spec", [TIERS, DUO])
def test_transfer_modes_give_identical_tokens_for_a_dropping_profile(model, prompts, prefill, spec):
    tokens = {}
    for mode in ("full", "partial", "smartgen"):
        outs = serve(model, "oracle", prefill, mode, prompts, spec)
        tokens[mode] = [o.token_ids for o in outs]
        if mode != "full":
            assert sum(o.metrics.extra["on_demand_ratio"] for o in outs) > 0  # rows really came on demand
    assert tokens["partial"] == tokens["full"] and tokens["smartgen"] == tokens["full"]


def test_llm_with_disaggregation_serves_a_dropping_profile_like_the_dense_reference(model, prompts):
    """The public API: LLM(disaggregation=Disaggregation(compression=<dropping id>)) with a worker
    process (its default 128-token chunks) in smartgen mode gives the reference's tokens."""
    from jkv import LLM
    from jkv.api import Disaggregation

    dis = Disaggregation(TransferConfig(mode="smartgen", strategy="sequential", kr_fraction=0.3, max_blocks=MAX_BLOCKS),
                         selector="dense", transport="tcp", prefill_workers=1, model_spec="tiny:qwen2:0",
                         compression=DUO)
    with LLM(model, disaggregation=dis) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(o.metrics.extra["compression"] == DUO and o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == [reference(model, p, DUO, min_chunk=128)[0] for p in prompts]
