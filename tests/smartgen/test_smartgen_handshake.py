"""The configuration handshake between prefill and decode (jkv/disagg/handshake.py): a mismatch in
any field refuses the connection before any KV crosses, with a message naming the field and both
values on both sides; a matching pair connects (every other SmartGen test runs one)."""
import dataclasses
import logging
import time

import pytest

from jkv.disagg.decode_worker import DecodeWorker
from jkv.disagg.handshake import DECLARED_ONLY, RoleConfig, role_config, weights_fingerprint
from jkv.disagg.prefill_worker import PrefillWorker
from jkv.disagg.selectors import build_selector
from jkv.transfer.plan import TransferConfig
from models import tiny_model
from tests.smartgen.smartgen_cases import SECRET
from transport import ConfigMismatch, Endpoint

# per field: (the prefill side's value, a word of the fix the message must give)
OTHER = {
    "protocol": (99, "same jkv release"),
    "model": ("another-model", "--model"),
    "dtype": ("bfloat16", "--dtype"),
    "kv_dtype": ("float16", "same jkv release"),
    "num_layers": (7, "--model"),
    "num_kv_heads": (5, "--model"),
    "head_dim": (48, "--model"),
    "head_order": ("shard-local", "same jkv release"),
    "max_blocks": (64, "--max-blocks"),
    "page_size": (32, "page size"),
    "selector": ("quest", "--selector"),
    "compression": ("container-v9/00000000", "same jkv release"),
    "weights": ("0123456789abcdef", "same checkpoint"),
}


@pytest.fixture(scope="module")
def selector(model):
    return build_selector(model, "streamingllm")  # no calibration: cheap to build


def test_every_compared_field_has_a_case():
    assert set(OTHER) == {f.name for f in dataclasses.fields(RoleConfig)} - set(DECLARED_ONLY)


def test_different_tensor_parallel_degrees_connect(model, selector):
    """TP is declared, not compared: the KV crosses per global KV-head slice, each side lays it out
    on its own mesh (tests/smartgen/test_smartgen_tensor_parallel.py runs such pairs end to end)."""
    decode = role_config(model, "decode", selector, max_blocks=16, tensor_parallel=1)
    prefill = role_config(model, "prefill", selector, max_blocks=16, tensor_parallel=2)
    assert decode.mismatch(prefill.as_dict()) is None and prefill.mismatch(decode.as_dict()) is None
    server = Endpoint("prefill-0", secret=SECRET, config_check=prefill.check())
    client = Endpoint("decode-0", secret=SECRET, config_check=decode.check())
    try:
        assert client.connect(server.listen()).name == "prefill-0"
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("field", list(OTHER))
def test_a_mismatch_in_each_field_is_refused_naming_both_values(model, selector, field, caplog):
    decode = dataclasses.replace(role_config(model, "decode", selector, max_blocks=16), page_size=16)
    value, fix = OTHER[field]
    prefill = dataclasses.replace(decode, role="prefill", **{field: value})
    mine = getattr(decode, field)
    assert mine != value
    server = Endpoint("prefill-0", secret=SECRET, config_check=prefill.check())
    client = Endpoint("decode-0", secret=SECRET, config_check=decode.check())
    caplog.set_level(logging.WARNING, logger="transport")
    try:
        with pytest.raises(ConfigMismatch) as err:
            client.connect(server.listen())
        text = str(err.value)
        assert f"prefill runs {field}={value} but decode runs {mine}" in text and fix in text, text
        assert client.peers == {} and server.peers == {}  # never adopted: no frame of it is read
        want = f"prefill runs {field}={value} but decode runs {mine}"
        deadline = time.monotonic() + 10  # the server's handshake thread logs after it sent the refusal
        while not any(want in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
    finally:
        client.close()
        server.close()


def test_a_prefill_worker_that_follows_the_requests_m_accepts_any_decode_m(model, selector):
    decode = role_config(model, "decode", selector, max_blocks=16)
    prefill = role_config(model, "prefill", selector, max_blocks=None)
    assert decode.mismatch(prefill.as_dict()) is None and prefill.mismatch(decode.as_dict()) is None
    assert "sent no configuration" in decode.mismatch(None)
    incomplete = {k: v for k, v in prefill.as_dict().items() if k != "weights"}
    assert "prefill sent no weights" in decode.mismatch(incomplete)


def test_the_weights_fingerprint_is_stable_per_checkpoint_and_differs_across_seeds(model):
    same = tiny_model("qwen2", 0)
    assert weights_fingerprint(same) == weights_fingerprint(model)
    assert weights_fingerprint(tiny_model("qwen2", 1)) != weights_fingerprint(model)
    assert len(weights_fingerprint(model)) == 16
    # an accelerator samples with one jitted gather, a CPU reads in place: the same digest
    assert weights_fingerprint(model, gather_on_device=True) == weights_fingerprint(model, gather_on_device=False)


def test_decode_and_prefill_workers_with_different_dtypes_never_connect(model, selector):
    """The real workers: a bfloat16 prefill worker refuses a float32 decode worker at connect."""
    half = tiny_model("qwen2", 0, dtype="bfloat16")
    worker = PrefillWorker(half, selector, "prefill-bf16", secret=SECRET)
    decode = DecodeWorker(model, selector, TransferConfig(mode="partial", kr_fraction=0.3,
                                                                        max_blocks=16), secret=SECRET)
    try:
        with pytest.raises(ConfigMismatch, match="prefill runs dtype=bfloat16 but decode runs float32: start both "
                                                 "roles with the same --dtype"):
            decode.connect([worker.listen()])
        assert decode.owners == [] and worker.endpoint.peers == {} and worker.bulk.peers == {}
        assert decode.alive_owners() == []
    finally:
        decode.close()
        worker.close()


def test_kv_head_slices_are_declared_and_any_split_of_the_heads_connects(model, selector):
    """Issue 21 item 2: each side declares the KV-head slices of its layout; a different split is
    no mismatch (every slice indexes the global head order)."""
    decode = role_config(model, "decode", selector, max_blocks=16)
    assert decode.kv_head_slices == f"0:{model.cfg.num_kv_heads}" == "0:2"  # TP 1: one slice
    prefill = dataclasses.replace(decode, role="prefill", tensor_parallel=2, kv_head_slices="0:1,1:2")
    assert decode.mismatch(prefill.as_dict()) is None and prefill.mismatch(decode.as_dict()) is None
    older = {k: v for k, v in prefill.as_dict().items() if k != "kv_head_slices"}  # a release before slices
    assert decode.mismatch(older) is None


@pytest.mark.parametrize("slices, why", [("0:1,1:3", r"\[1, 3\) is outside the model's 2 KV heads"),
                                         ("0:1", "must cover each of the 2 KV heads once"),
                                         ("0:2,1:2", "must cover each of the 2 KV heads once"),
                                         ("0-2", "not a list of start:stop")])
def test_a_prefill_whose_head_slices_do_not_split_the_heads_is_refused_before_any_kv(model, selector, slices, why):
    decode = role_config(model, "decode", selector, max_blocks=16)
    prefill = dataclasses.replace(decode, role="prefill", kv_head_slices=slices)
    server = Endpoint("prefill-0", secret=SECRET, config_check=prefill.check())
    client = Endpoint("decode-0", secret=SECRET, config_check=decode.check())
    try:
        with pytest.raises(ConfigMismatch, match=why) as err:
            client.connect(server.listen())
        assert f"prefill declares kv_head_slices={slices!r}, not a split of decode's KV heads" in str(err.value)
        assert client.peers == {}  # the decode side never adopts it, so nothing reaches its regions
        deadline = time.monotonic() + 10  # the prefill side (which found decode's slices fine) sees it close
        while server.peers:
            assert time.monotonic() < deadline, server.peers
            time.sleep(0.02)
    finally:
        client.close()
        server.close()
