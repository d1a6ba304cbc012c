"""Codecs (exact round trip, corrupt input) and the block container (validation, fuzzing)."""
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jkv.compression.codecs import CodecError, get_codec
from jkv.compression.container import (MAGIC, PREFIX, VERSION, ContainerError, pack_container, read_header,
                                       unpack_container)
from jkv.compression.spec import CodecSpec

CODECS = [CodecSpec(), CodecSpec("zstd", 3), CodecSpec("zstdh", 3), CodecSpec("lz4")]


@pytest.mark.parametrize("spec", CODECS, ids=lambda s: s.id)
@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 40, np.random.default_rng(0).bytes(5000)])
def test_codec_round_trip_is_exact(spec, data):
    codec = get_codec(spec)
    assert codec.name == spec.id
    assert codec.decompress(codec.compress(data), len(data)) == data


@pytest.mark.parametrize("spec", CODECS, ids=lambda s: s.id)
def test_codec_rejects_wrong_size_and_garbage(spec):
    codec = get_codec(spec)
    data = bytes(range(256)) * 8
    with pytest.raises(CodecError, match=spec.id):
        codec.decompress(codec.compress(data), len(data) + 1)
    if spec.name != "none":
        with pytest.raises(CodecError, match=spec.id):
            codec.decompress(b"\xff" * 16, len(data))


def test_zstd_compresses_structured_bytes():
    data = np.repeat(np.arange(64, dtype=np.uint8), 64).tobytes()
    assert len(get_codec(CodecSpec("zstd", 3)).compress(data)) < len(data) / 20


def _sections():
    rng = np.random.default_rng(0)
    return [("codes", rng.integers(0, 255, 37, dtype=np.uint8)),
            ("scale", rng.standard_normal((2, 3)).astype(np.float16)),
            ("empty", np.zeros((0, 4), np.float32))]


def _container(codec=CodecSpec("zstd", 3), header=None):
    return pack_container(header or {"spec": "x", "layer": 1}, _sections(), codec)


def _reseal(header: dict, payload: bytes) -> bytes:
    """A container with a valid prefix and checksum around an arbitrary header (tests deep validation)."""
    hb = json.dumps(header).encode()
    return PREFIX.pack(MAGIC, VERSION, 0, len(hb), len(payload), zlib.crc32(payload, zlib.crc32(hb))) + hb + payload


def _split(data):
    _, _, _, hl, pl, _ = PREFIX.unpack_from(data)
    return json.loads(data[PREFIX.size: PREFIX.size + hl]), data[PREFIX.size + hl:]


@pytest.mark.parametrize("codec", CODECS, ids=lambda s: s.id)
def test_container_round_trip(codec):
    data = _container(codec)
    header, sections = unpack_container(data)
    assert header["spec"] == "x" and header["layer"] == 1 and header["codec"] == codec.id
    for name, arr in _sections():
        np.testing.assert_array_equal(sections[name], arr)
        assert sections[name].dtype == arr.dtype
    assert read_header(data) == header


def test_container_rejects_reserved_keys_and_unstorable_dtypes():
    with pytest.raises(ValueError, match="reserved"):
        pack_container({"codec": 1}, [], CodecSpec())
    with pytest.raises(ValueError, match="cannot be stored"):
        pack_container({}, [("x", np.zeros(2, np.int64))], CodecSpec())


def test_clear_errors_for_each_failure():
    data = _container()
    with pytest.raises(ContainerError, match="truncated block"):
        unpack_container(data[:10])
    with pytest.raises(ContainerError, match="truncated block"):
        unpack_container(data[:-1])
    with pytest.raises(ContainerError, match="trailing bytes"):
        unpack_container(data + b"\0")
    with pytest.raises(ContainerError, match="magic"):
        unpack_container(b"XXXX" + data[4:])
    with pytest.raises(ContainerError, match="unknown container version 2"):
        unpack_container(data[:4] + struct.pack("<H", 2) + data[6:])
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    with pytest.raises(ContainerError, match="checksum mismatch"):
        unpack_container(bytes(flipped))
    with pytest.raises(ContainerError, match="must be bytes"):
        unpack_container("text")


@pytest.mark.parametrize("mutate, match", [
    (lambda h: h.update(codec="brotli"), "unknown codec"),
    (lambda h: h.update(raw_nbytes=-1), "raw_nbytes"),
    (lambda h: h.update(raw_nbytes=h["raw_nbytes"] + 1), "add up to"),
    (lambda h: h.update(sections="nope"), "must be a list"),
    (lambda h: h["sections"].append(["codes", "uint8", [1]]), "duplicate"),
    (lambda h: h["sections"][0].__setitem__(1, "int64"), "unsupported dtype"),
    (lambda h: h["sections"][0].__setitem__(2, [-37]), "bad shape"),
    (lambda h: h["sections"][0].__setitem__(2, [1 << 40]), "bad shape"),
    (lambda h: h["sections"][1].__setitem__(2, [3, 3]), "add up to"),
    (lambda h: h["sections"].__setitem__(0, ["codes", "uint8"]), "malformed section"),
])
def test_resealed_bad_headers_are_rejected(mutate, match):
    header, payload = _split(_container())
    mutate(header)
    with pytest.raises(ContainerError, match=match):
        unpack_container(_reseal(header, payload))


def test_non_object_header_is_rejected():
    with pytest.raises(ContainerError, match="JSON object"):
        unpack_container(_reseal([1, 2], b""))
    bad = PREFIX.pack(MAGIC, VERSION, 0, 2, 0, zlib.crc32(b"\xff\xfe")) + b"\xff\xfe"
    with pytest.raises(ContainerError, match="UTF-8 JSON"):
        unpack_container(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data):
    with pytest.raises(ContainerError):
        unpack_container(MAGIC + struct.pack("<H", VERSION) + data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_containers_decode_identically_or_raise(data):
    original = _container(data.draw(st.sampled_from(CODECS)))
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[pos: pos + data.draw(st.integers(1, 8))]
        else:
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        header, sections = unpack_container(bytes(buf))
    except ContainerError:
        return
    assert bytes(buf) == original  # anything else that decodes would be undetected corruption
    assert set(sections) == {n for n, _ in _sections()}


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["codec", "raw_nbytes", "sections"]),
                       st.recursive(st.none() | st.booleans() | st.integers(-5, 1 << 20) | st.text(max_size=6),
                                    lambda c: st.lists(c, max_size=4), max_leaves=12), min_size=1))
def test_fuzzed_headers_with_valid_checksum_raise_container_error(overrides):
    header, payload = _split(_container())
    header.update(overrides)
    try:
        unpack_container(_reseal(header, payload))
    except ContainerError:
        pass
