"""Self-describing, versioned byte container for one encoded KV block.

Wire format (little endian):

    offset  size  field
    0       4     magic b"JKVC"
    4       2     version (u16) = 1
    6       2     flags (u16) = 0 (reserved)
    8       4     header_len (u32)
    12      8     payload_len (u64)
    20      4     crc32 of header bytes + payload bytes (zlib.crc32)
    24      H     header: compact UTF-8 JSON object
    24+H    P     payload: codec(concatenation of the sections in header order)

The header carries the caller's metadata plus `codec` (a codec id), `raw_nbytes` (payload size
before the codec) and `sections` ([[name, dtype, shape], ...]; sections are contiguous in that
order). Every byte of the container — prefix, header, payload — counts in the compression ratio.

`unpack_container` validates everything it reads before touching numpy and raises
`ContainerError` (a ValueError) naming the problem: truncation, trailing bytes, bad magic,
unknown version, checksum mismatch, malformed header, inconsistent sizes, codec failure.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from jkv.compression.codecs import CodecError, get_codec
from jkv.compression.spec import CodecSpec

MAGIC = b"JKVC"
VERSION = 1
PREFIX = struct.Struct("<4sHHIQI")
MAX_HEADER_BYTES = 1 << 20
MAX_RAW_BYTES = 1 << 34
SECTION_DTYPES = {"uint8": np.dtype(np.uint8), "float16": np.dtype(np.float16),
                  "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_RESERVED = ("codec", "raw_nbytes", "sections")


class ContainerError(ValueError):
    """An encoded block is malformed, truncated, corrupted or of an unknown version."""


_NAMES = {dtype: name for name, dtype in SECTION_DTYPES.items()}


def dtype_name(dtype) -> str:
    """Container name of a section dtype; raises for dtypes the container cannot carry."""
    if isinstance(dtype, np.dtype) and dtype in _NAMES:  # np.dtype.name is slow Python (~1/3 of framing a chunk)
        return _NAMES[dtype]
    name = np.dtype(dtype).name
    if name not in SECTION_DTYPES:
        raise ValueError(f"dtype {name} cannot be stored in a container; use one of {sorted(SECTION_DTYPES)}")
    return name


def pack_container(header: Mapping, sections: Sequence[tuple[str, np.ndarray]], codec: CodecSpec) -> bytes:
    """Serialize `sections` (host arrays) with `header` (JSON-able, no reserved keys) through `codec`."""
    clash = set(header) & set(_RESERVED)
    if clash:
        raise ValueError(f"header keys {sorted(clash)} are reserved by the container")
    arrays = [np.ascontiguousarray(a) for _, a in sections]
    raw = b"".join(a.tobytes() for a in arrays)
    full = {**header, "codec": codec.id, "raw_nbytes": len(raw),
            "sections": [[name, dtype_name(a.dtype), list(a.shape)] for (name, _), a in zip(sections, arrays)]}
    header_bytes = json.dumps(full, separators=(",", ":"), sort_keys=True).encode()
    payload = get_codec(codec).compress(raw)
    crc = zlib.crc32(payload, zlib.crc32(header_bytes))
    return PREFIX.pack(MAGIC, VERSION, 0, len(header_bytes), len(payload), crc) + header_bytes + payload


def read_header(data: bytes) -> dict:
    """Validate prefix + checksum and return the JSON header (payload not decoded)."""
    return _split(data)[0]


def unpack_container(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """Validate and decode a container: (header, {section name: read-only host array})."""
    header, payload = _split(data)
    layout = _section_layout(header)
    try:
        codec_spec = CodecSpec.parse(header["codec"]) if isinstance(header.get("codec"), str) else None
    except ValueError:
        codec_spec = None
    if codec_spec is None:
        raise ContainerError(f"header names an unknown codec {header.get('codec')!r}")
    raw_nbytes = header.get("raw_nbytes")
    if not _is_int(raw_nbytes) or not 0 <= raw_nbytes <= MAX_RAW_BYTES:
        raise ContainerError(f"header raw_nbytes={raw_nbytes!r} must be an int in [0, {MAX_RAW_BYTES}]")
    total = sum(n for _, _, _, n in layout)
    if total != raw_nbytes:
        raise ContainerError(f"sections add up to {total} bytes but raw_nbytes={raw_nbytes}")
    try:
        raw = get_codec(codec_spec).decompress(payload, raw_nbytes)
    except CodecError as e:
        raise ContainerError(str(e)) from None
    out, offset = {}, 0
    for name, dtype, shape, nbytes in layout:
        out[name] = np.frombuffer(raw, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).reshape(shape)
        offset += nbytes
    return header, out


def _split(data: bytes) -> tuple[dict, bytes]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ContainerError(f"an encoded block must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < PREFIX.size:
        raise ContainerError(f"truncated block: {len(data)} bytes, the prefix alone is {PREFIX.size}")
    magic, version, flags, header_len, payload_len, crc = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ContainerError(f"not a jkv compressed block: magic {magic!r} != {MAGIC!r}")
    if version != VERSION:
        raise ContainerError(f"unknown container version {version}; this jkv reads version {VERSION}")
    if flags != 0:
        raise ContainerError(f"unknown container flags {flags:#x}")
    if header_len > MAX_HEADER_BYTES:
        raise ContainerError(f"header_len={header_len} exceeds {MAX_HEADER_BYTES}")
    expected = PREFIX.size + header_len + payload_len
    if len(data) < expected:
        raise ContainerError(f"truncated block: {len(data)} bytes, prefix announces {expected}")
    if len(data) > expected:
        raise ContainerError(f"{len(data) - expected} trailing bytes after the block")
    header_bytes = data[PREFIX.size: PREFIX.size + header_len]
    payload = data[PREFIX.size + header_len:]
    if zlib.crc32(payload, zlib.crc32(header_bytes)) != crc:
        raise ContainerError("checksum mismatch: the block is corrupted")
    try:
        header = json.loads(header_bytes.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ContainerError(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise ContainerError(f"header must be a JSON object, got {type(header).__name__}")
    return header, payload


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _section_layout(header: dict) -> list[tuple[str, np.dtype, tuple[int, ...], int]]:
    sections = header.get("sections")
    if not isinstance(sections, list):
        raise ContainerError("header 'sections' must be a list of [name, dtype, shape]")
    layout, names = [], set()
    for entry in sections:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and isinstance(entry[2], list)):
            raise ContainerError(f"malformed section entry {entry!r}; expected [name, dtype, shape]")
        name, dtype, shape = entry
        if name in names:
            raise ContainerError(f"duplicate section {name!r}")
        names.add(name)
        if dtype not in SECTION_DTYPES:
            raise ContainerError(f"section {name!r} has unsupported dtype {dtype!r}")
        if len(shape) > 8 or not all(_is_int(s) and 0 <= s <= MAX_RAW_BYTES for s in shape):
            raise ContainerError(f"section {name!r} has a bad shape {shape!r}")
        nbytes = math.prod(shape) * SECTION_DTYPES[dtype].itemsize
        if nbytes > MAX_RAW_BYTES:
            raise ContainerError(f"section {name!r} of shape {shape} is too large")
        layout.append((name, SECTION_DTYPES[dtype], tuple(shape), nbytes))
    return layout
