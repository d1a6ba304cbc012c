"""Codec stage C (KVServe §5.1 ❸): lossless byte codecs on host bytes behind one interface.

`get_codec(spec)` returns an object with `name`, `compress(bytes) -> bytes` and
`decompress(bytes, raw_nbytes) -> bytes`. Decompression failures and size mismatches raise
`CodecError` (a ValueError) naming the codec, never a library-specific exception.
nvCOMP would slot in here on GPU; it is not available on these machines.
"""
from __future__ import annotations

import functools

import lz4.block
import zstandard

from jkv.compression.spec import CodecSpec


class CodecError(ValueError):
    """Compressed bytes could not be decoded to the announced size."""


class _NoneCodec:
    name = "none"

    def compress(self, data: bytes) -> bytes:
        return bytes(data)

    def decompress(self, data: bytes, raw_nbytes: int) -> bytes:
        if len(data) != raw_nbytes:
            raise CodecError(f"codec none: payload has {len(data)} bytes, header announces {raw_nbytes}")
        return bytes(data)


class _ZstdCodec:
    def __init__(self, level: int):
        self.name = f"zstd{level}"
        self._level = level

    def compress(self, data: bytes) -> bytes:
        # A compressor object is cheap; making one per call keeps the codec thread-safe.
        return zstandard.ZstdCompressor(level=self._level).compress(data)

    def decompress(self, data: bytes, raw_nbytes: int) -> bytes:
        try:
            # Check the frame's own size claim first so a forged frame cannot make us allocate more.
            claimed = zstandard.frame_content_size(data)
            if claimed not in (-1, raw_nbytes):
                raise CodecError(f"codec {self.name}: frame holds {claimed} bytes, header announces {raw_nbytes}")
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_nbytes)
        except zstandard.ZstdError as e:
            raise CodecError(f"codec {self.name}: corrupt payload ({e})") from None
        if len(out) != raw_nbytes:
            raise CodecError(f"codec {self.name}: decoded {len(out)} bytes, header announces {raw_nbytes}")
        return out


class _Lz4Codec:
    name = "lz4"

    def compress(self, data: bytes) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def decompress(self, data: bytes, raw_nbytes: int) -> bytes:
        if raw_nbytes == 0:
            return b""
        try:
            out = lz4.block.decompress(data, uncompressed_size=raw_nbytes)
        except lz4.block.LZ4BlockError as e:
            raise CodecError(f"codec lz4: corrupt payload ({e})") from None
        if len(out) != raw_nbytes:
            raise CodecError(f"codec lz4: decoded {len(out)} bytes, header announces {raw_nbytes}")
        return out


@functools.lru_cache(maxsize=None)
def get_codec(spec: CodecSpec):
    """The codec for `spec` (cached; codecs are stateless and thread-safe)."""
    if spec.name == "none":
        return _NoneCodec()
    if spec.name == "zstd":
        return _ZstdCodec(spec.level)
    return _Lz4Codec()
