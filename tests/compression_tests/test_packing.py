"""Bit packing: jitted jnp kernels against the numpy reference, and reference properties."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jkv.compression.packing import (SUPPORTED_BITS, pack_bits, pack_bits_reference, packed_nbytes, unpack_bits,
                                     unpack_bits_reference)

FIXED_N = 203  # not a multiple of 8: exercises the padded tail; fixed so the jitted kernels compile once


@st.composite
def codes_and_bits(draw, n=None):
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    size = n if n is not None else draw(st.integers(0, 300))
    codes = draw(hnp.arrays(np.uint8, size, elements=st.integers(0, (1 << bits) - 1)))
    return codes, bits


@settings(max_examples=200, deadline=None)
@given(codes_and_bits())
def test_reference_round_trip_and_size(case):
    codes, bits = case
    packed = pack_bits_reference(codes, bits)
    assert packed.dtype == np.uint8 and packed.size == packed_nbytes(codes.size, bits)
    np.testing.assert_array_equal(unpack_bits_reference(packed, bits, codes.size), codes)


@settings(max_examples=60, deadline=None)
@given(codes_and_bits(n=FIXED_N))
def test_jnp_matches_reference(case):
    codes, bits = case
    packed = np.asarray(pack_bits(codes, bits))
    np.testing.assert_array_equal(packed, pack_bits_reference(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpack_bits(packed, bits, FIXED_N)), codes)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(SUPPORTED_BITS), st.binary(min_size=0, max_size=64))
def test_every_byte_string_of_right_length_unpacks_and_repacks(bits, raw):
    """Packing is a bijection between code streams and byte strings of a multiple of `bits` bytes."""
    raw = raw[: len(raw) // bits * bits]
    packed = np.frombuffer(raw, dtype=np.uint8)
    n = len(raw) // bits * 8
    codes = unpack_bits_reference(packed, bits, n)
    assert codes.max(initial=0) < (1 << bits)
    np.testing.assert_array_equal(pack_bits_reference(codes, bits), packed)


def test_three_bit_layout_is_little_endian():
    codes = np.arange(8, dtype=np.uint8)  # word = sum(i << 3i)
    word = sum(i << (3 * i) for i in range(8))
    expected = np.array([(word >> (8 * j)) & 0xFF for j in range(3)], dtype=np.uint8)
    np.testing.assert_array_equal(pack_bits_reference(codes, 3), expected)
    np.testing.assert_array_equal(np.asarray(pack_bits(codes, 3)), expected)


def test_reference_rejects_codes_that_do_not_fit():
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits_reference(np.array([4], dtype=np.uint8), 2)


def test_jnp_masks_codes_that_do_not_fit():
    codes = np.array([5, 1, 2, 3, 0, 1, 2, 3], dtype=np.uint8)  # 5 = 0b101 -> 0b01 at 2 bits
    np.testing.assert_array_equal(np.asarray(unpack_bits(pack_bits(codes, 2), 2, 8)), codes & 3)


@pytest.mark.parametrize("bits", [0, 5, 16])
def test_unsupported_width_is_a_clear_error(bits):
    with pytest.raises(ValueError, match="not a supported code width"):
        packed_nbytes(8, bits)


def test_wrong_packed_size_is_a_clear_error():
    with pytest.raises(ValueError, match="need 3"):
        unpack_bits_reference(np.zeros(4, np.uint8), 3, 8)
