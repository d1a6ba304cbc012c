"""Chained prefix hashing: keys name whole prefixes, never alias, are process-independent."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kvpool.hashing import ChunkNamespace, chunk_keys

NS = ChunkNamespace("smollm2-135m", "float16", 4)


def test_only_full_chunks_get_keys_and_keys_are_deterministic():
    tokens = list(range(10))
    keys = chunk_keys(tokens, NS)
    assert [k.index for k in keys] == [0, 1]
    assert keys == chunk_keys(np.array(tokens, dtype=np.int64), NS)
    assert chunk_keys(tokens, NS, max_chunks=1) == keys[:1]
    assert keys[0].name.startswith("jkv:smollm2-135m:float16:c4:")


def test_key_names_the_prefix_not_the_chunk():
    # Same second chunk after a different first chunk must get a different key.
    a = chunk_keys([1, 2, 3, 4, 9, 9, 9, 9], NS)
    b = chunk_keys([1, 2, 3, 5, 9, 9, 9, 9], NS)
    assert a[0] != b[0] and a[1].digest != b[1].digest


@pytest.mark.parametrize("other", [ChunkNamespace("smollm2-360m", "float16", 4),
                                   ChunkNamespace("smollm2-135m", "bfloat16", 4),
                                   ChunkNamespace("smollm2-135m", "float16", 2)])
def test_namespace_separates_models_dtypes_and_chunk_sizes(other):
    tokens = list(range(8))
    assert {k.digest for k in chunk_keys(tokens, NS)}.isdisjoint(
        {k.digest for k in chunk_keys(tokens, other)})


def test_namespace_fields_are_length_prefixed():
    # Plain concatenation would make both "abfloat1614".
    assert ChunkNamespace("ab", "float16", 14).root_digest() != ChunkNamespace(
        "ab", "float161", 4).root_digest()


token_lists = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=24)


@settings(max_examples=300, deadline=None)
@given(token_lists, token_lists)
def test_chained_hashes_alias_iff_prefixes_equal(t1, t2):
    k1, k2 = chunk_keys(t1, NS), chunk_keys(t2, NS)
    for i in range(min(len(k1), len(k2))):
        same_prefix = t1[:(i + 1) * 4] == t2[:(i + 1) * 4]
        assert (k1[i].digest == k2[i].digest) == same_prefix


@settings(max_examples=100, deadline=None)
@given(token_lists, st.integers(0, 23), st.integers(0, 2**32 - 1))
def test_single_token_change_changes_every_later_key(tokens, pos, new):
    if pos >= len(tokens) or tokens[pos] == new:
        return
    changed = list(tokens)
    changed[pos] = new
    k1, k2 = chunk_keys(tokens, NS), chunk_keys(changed, NS)
    for i, (a, b) in enumerate(zip(k1, k2)):
        assert (a.digest == b.digest) == (i < pos // 4)


def test_keys_do_not_depend_on_python_hash_seed():
    code = ("from jkv.kvpool.hashing import ChunkNamespace, chunk_keys;"
            "print(chunk_keys(list(range(12)), ChunkNamespace('m', 'float16', 4))[-1].name)")
    env = dict(os.environ, PYTHONHASHSEED="12345",
               PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[2]))
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == chunk_keys(list(range(12)), ChunkNamespace("m", "float16", 4))[-1].name


@pytest.mark.parametrize("tokens, match", [([-1, 2, 3, 4], "token ids"), ([2**32, 0, 0, 0], "token ids"),
                                           ([[1, 2]], "1-D"), ([0.5, 1.0], "integers")])
def test_bad_tokens_raise(tokens, match):
    with pytest.raises(ValueError, match=match):
        chunk_keys(tokens, NS)


@pytest.mark.parametrize("kwargs", [dict(model_id="", dtype="float16", chunk_tokens=4),
                                    dict(model_id="m", dtype="", chunk_tokens=4),
                                    dict(model_id="m", dtype="float16", chunk_tokens=0)])
def test_bad_namespace_raises(kwargs):
    with pytest.raises(ValueError):
        ChunkNamespace(**kwargs)
