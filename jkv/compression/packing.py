"""Bit packing of quantization codes: jitted jnp kernels and a numpy reference.

Layout (identical in both implementations): the flat code stream is zero-padded to a multiple of
8 values; each run of 8 codes `v[0..7]` (each `< 2**bits`) forms the little-endian integer
`word = sum(v[i] << (bits * i))`, written as `bits` little-endian bytes. So 8 codes take exactly
`bits` bytes for every supported width, including 3 bits (no code straddles a run of 8).

    codes:  u8[n]                       values in [0, 2**bits)
    packed: u8[ceil(n / 8) * bits]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits=} is not a supported code width; use one of {SUPPORTED_BITS}")


def packed_nbytes(n_values: int, bits: int) -> int:
    """Bytes that `n_values` codes of `bits` bits occupy after packing."""
    _check_bits(bits)
    if n_values < 0:
        raise ValueError(f"{n_values=} must be >= 0")
    return -(-n_values // 8) * bits


@functools.partial(jax.jit, static_argnames=("bits",))
def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Pack codes `u8[...]` (flattened) into `u8[ceil(n/8) * bits]`.

    Bits above `bits` in each code are masked off (a jitted kernel cannot raise); the numpy
    reference rejects such codes instead.
    """
    _check_bits(bits)
    flat = codes.reshape(-1).astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    flat = jnp.pad(flat, (0, (-flat.shape[0]) % 8))
    runs = flat.reshape(-1, 8)  # [n/8, 8]
    if bits == 8:
        return runs.reshape(-1).astype(jnp.uint8)
    # Codes occupy disjoint bit ranges, so the sum equals the bitwise OR (at most 32 bits).
    word = jnp.sum(runs << (jnp.arange(8, dtype=jnp.uint32) * bits), axis=1)  # [n/8]
    out = (word[:, None] >> (jnp.arange(bits, dtype=jnp.uint32) * 8)) & jnp.uint32(0xFF)
    return out.reshape(-1).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits", "n_values"))
def unpack_bits(packed: jax.Array, bits: int, n_values: int) -> jax.Array:
    """Inverse of `pack_bits`: `u8[ceil(n/8) * bits]` -> codes `u8[n_values]`."""
    _check_bits(bits)
    expected = packed_nbytes(n_values, bits)
    if packed.size != expected:
        raise ValueError(f"packed has {packed.size} bytes; {n_values} codes of {bits} bits need {expected}")
    runs = packed.reshape(-1, bits).astype(jnp.uint32)  # [n/8, bits]
    if bits == 8:
        return runs.reshape(-1)[:n_values].astype(jnp.uint8)
    word = jnp.sum(runs << (jnp.arange(bits, dtype=jnp.uint32) * 8), axis=1)  # [n/8]
    codes = (word[:, None] >> (jnp.arange(8, dtype=jnp.uint32) * bits)) & jnp.uint32((1 << bits) - 1)
    return codes.reshape(-1)[:n_values].astype(jnp.uint8)


def pack_bits_reference(codes: np.ndarray, bits: int) -> np.ndarray:
    """numpy reference of `pack_bits`; raises on codes that do not fit in `bits`."""
    _check_bits(bits)
    flat = np.asarray(codes).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits=}; got [{flat.min()}, {flat.max()}]")
    flat = np.pad(flat.astype(np.uint64), (0, (-flat.size) % 8))
    runs = flat.reshape(-1, 8)
    word = np.zeros(runs.shape[0], dtype=np.uint64)
    for i in range(8):
        word |= runs[:, i] << np.uint64(bits * i)
    out = np.empty((runs.shape[0], bits), dtype=np.uint8)
    for j in range(bits):
        out[:, j] = (word >> np.uint64(8 * j)) & np.uint64(0xFF)
    return out.reshape(-1)


def unpack_bits_reference(packed: np.ndarray, bits: int, n_values: int) -> np.ndarray:
    """numpy reference of `unpack_bits`."""
    expected = packed_nbytes(n_values, bits)
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if packed.size != expected:
        raise ValueError(f"packed has {packed.size} bytes; {n_values} codes of {bits} bits need {expected}")
    runs = packed.reshape(-1, bits).astype(np.uint64)
    word = np.zeros(runs.shape[0], dtype=np.uint64)
    for j in range(bits):
        word |= runs[:, j] << np.uint64(8 * j)
    codes = np.empty((runs.shape[0], 8), dtype=np.uint8)
    for i in range(8):
        codes[:, i] = (word >> np.uint64(bits * i)) & np.uint64((1 << bits) - 1)
    return codes.reshape(-1)[:n_values]
