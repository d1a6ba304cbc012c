"""Bit flips in compressed frames on every path (proactive push, speculative push, on-demand reply,
selector metadata) are rejected by the frames' checksums: the request fails with an error naming
the path and the reason, its KV is freed on both sides, and the corrupted bytes are never decoded.

The prefill worker below corrupts one container of the chosen path after it was encoded (what a
bad NIC, a bad DIMM or a buggy encoder would deliver past the transport's own crc32c), at a
random bit of the container (prefix, JSON header or payload)."""
import threading
import time

import numpy as np
import pytest

import jkv.disagg.prefill_worker as prefill_module
from jkv.compression.kv_transfer import KVCodec
from jkv.compression.policy import CompressionConfig, CompressionPolicy
from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.prefill_worker import PrefillWorker
from jkv.disagg.selectors import build_selector
from jkv.engine import Request
from jkv.framing import unpack
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from models import tiny_model

pytestmark = pytest.mark.timeout(300)

SECRET = "frame-fuzz-secret"
SPEC = "identity+tok4g32+zstd3"  # row-granular: the on-demand replies carry quantized rows too
PATHS = ("proactive", "speculative", "on_demand", "metadata")


def flip(data: bytes, start: int, rng) -> bytes:
    """One random bit flipped in data[start:]."""
    bad = bytearray(data)
    at = int(rng.integers(start, len(bad)))
    bad[at] ^= 1 << int(rng.integers(0, 8))
    return bytes(bad)


class CorruptingWorker(PrefillWorker):
    """Flips one bit in the first compressed container of `path` (per request), and counts it."""

    def __init__(self, *args, path: str, seed: int, **kw):
        super().__init__(*args, **kw)
        self.path, self.rng = path, np.random.default_rng(seed)
        self.corrupted: set[str] = set()
        self._corrupt_lock = threading.Lock()

    def _take(self, rid: str) -> bool:
        with self._corrupt_lock:
            if rid in self.corrupted:
                return False
            self.corrupted.add(rid)
            return True

    def _push_compressed(self, peer, h, layer, blocks, path):
        if path != self.path or not self._take(h.rid):
            return super()._push_compressed(peer, h, layer, blocks, path)
        frame = h.codec.frame

        def corrupt_frame(rid, layer_, chunks):
            data = frame(rid, layer_, chunks)
            header, _ = unpack(data)
            return flip(data, len(data) - sum(k + v for _, _, k, v in header["chunks"]), self.rng)

        h.codec.frame = corrupt_frame
        try:
            return super()._push_compressed(peer, h, layer, blocks, path)
        finally:
            h.codec.frame = frame

    def _encode_rows(self, h, layer, ks, vs):
        part = super()._encode_rows(h, layer, ks, vs)
        return flip(part, 0, self.rng) if self.path == "on_demand" and self._take(h.rid) else part


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", 0)


@pytest.fixture(scope="module")
def selector(model):
    return build_selector(model, "infinigen")  # ships metadata (partial keys) on every layer >= 2


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(5)
    return [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (300, 260)]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("path", PATHS)
def test_a_flipped_bit_on_any_path_fails_the_request_and_frees_its_kv(model, selector, prompts, path, seed,
                                                                       monkeypatch):
    rng = np.random.default_rng(100 + seed)
    if path == "metadata":
        pack_metadata = prefill_module.pack_metadata
        hit = set()

        def corrupt_metadata(header, leaves, codec):
            data = pack_metadata(header, leaves, codec)
            if header["rid"] in hit:
                return data
            hit.add(header["rid"])
            n = int.from_bytes(data[:4], "little")
            return flip(data, 4 + n, rng)  # inside the container, after the framing header

        monkeypatch.setattr(prefill_module, "pack_metadata", corrupt_metadata)
    worker = CorruptingWorker(model, selector, "prefill-0", secret=SECRET, bandwidth="20mbit",
                              codec=KVCodec(min_chunk_tokens=32), path=path, seed=seed)
    address = worker.listen()
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    transfer = TransferConfig(mode="full" if path == "proactive" else "smartgen", strategy="random",
                              kr_fraction=0.2, max_blocks=16, spec_ratio=0.2)
    decode = DecodeWorker(model, selector, transfer, secret=SECRET,
                          compression=CompressionPolicy(CompressionConfig(SPEC)))
    try:
        decode.connect([address])
        outs = decode.generate([Request(f"r{i}", p, p, SamplingParams(max_tokens=12, ignore_eos=True))
                                for i, p in enumerate(prompts)])
        if path == "metadata":
            corrupted = hit
        else:
            corrupted = worker.corrupted
        assert corrupted, f"no {path} frame was sent"
        by_rid = {o.request_id: o for o in outs}
        for o in outs:
            # each request had a frame of this path corrupted (decode-side rids are "<request id>.<...>")
            assert any(r.startswith(o.request_id + ".") for r in corrupted), (path, o.request_id, corrupted)
            assert o.finish_reason == "error", (path, o.finish_reason)
            error = o.metrics.extra["error"]  # the container's reason: checksum, magic, lengths, ...
            assert {"proactive": "compressed KV", "speculative": "compressed KV", "on_demand": "on-demand rows",
                    "metadata": "compressed metadata"}[path] in error, error
        assert set(by_rid) == {"r0", "r1"}
        # freed on the decode side (generate returned) and on the prefill side (after "free")
        assert decode.pool.live() == [] and decode.pool.bytes_in_use == 0
        deadline = time.monotonic() + 10
        while worker.held() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.held() == [] and worker.pool.bytes_in_use == 0
    finally:
        decode.close()
        worker.close()
        runner.join(5)
