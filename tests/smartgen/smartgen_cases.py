"""Helpers and fixtures for the SmartGen tests: a tiny model, selectors, a profile, in-process prefill
workers (real TCP endpoints on loopback) and the leak checks every test ends with."""
import threading

import numpy as np
import pytest

from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.prefill_worker import PrefillWorker
from jkv.disagg.selectors import build_selector, calibration_ids
from jkv.engine import Request
from jkv.sampling import SamplingParams
from jkv.transfer.plan import TransferConfig
from jkv.transfer.profile import build_profile
from models import tiny_model

SECRET = "smartgen-test-secret"
MODEL_SPEC = "tiny:qwen2:0"  # varied greedy tokens, so a wrong KV row changes the output
PROMPT_LENS = (70, 130, 45, 200)
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def model():
    return tiny_model("qwen2", 0)


@pytest.fixture(scope="session")
def selectors(model):
    return {name: build_selector(model, name) for name in ("infinigen", "oracle")}


@pytest.fixture(scope="session")
def prompts(model):
    rng = np.random.default_rng(7)  # evaluation prompts; calibration uses calibration_ids (seed 1234)
    return [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="session")
def profiles(model, selectors):
    calib = calibration_ids(model, 256, seed=99)
    return {name: build_profile(model, sel, name, {128: [calib]}, steps=4, max_blocks=16)
            for name, sel in selectors.items()}


def make_requests(prompts, max_tokens=MAX_TOKENS, tag="r"):
    return [Request(f"{tag}{i}", p, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]


class InProcessWorkers:
    """Prefill workers on threads of this process, each with its own TCP endpoint."""

    def __init__(self, model, selector, count, **kw):
        self.workers = [PrefillWorker(model, selector, f"prefill-{i}", secret=SECRET, **kw) for i in range(count)]
        self.addresses = [w.listen() for w in self.workers]
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in self.workers]
        for t in self.threads:
            t.start()

    def close(self):
        for w in self.workers:
            w.close()
        for t in self.threads:
            t.join(5)
            assert not t.is_alive()


def generate(model, selector, addresses, mode, prompts, profile=None, **kw):
    """One batch through a fresh decode worker; asserts the decode side leaked nothing."""
    kw.setdefault("kr_fraction", 0.3)
    kw.setdefault("max_blocks", 16)
    decode = DecodeWorker(model, selector, TransferConfig(mode=mode, **kw), secret=SECRET, profile=profile)
    try:
        decode.connect(addresses)
        outs = decode.generate(make_requests(prompts))
        assert decode.pool.live() == [] and decode.pages.cache.pages_in_use == 0 and decode.pool.bytes_in_use == 0
        assert decode.endpoint.regions.by_name(f"kv/{outs[0].request_id}") is None
        return outs
    finally:
        decode.close()
