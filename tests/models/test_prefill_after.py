"""`Model.prefill_after` (prefill from each row's cached prefix, layer by layer) against the
whole-prompt `Model.prefill`: the same logits and the same per-layer KV for every valid position,
for rows with different cached prefixes in one batch (one with none)."""
import numpy as np
import pytest

from models.model import tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_after_matches_whole_prefill(family):
    m = tiny_model(family)
    rng = np.random.default_rng(3)
    lengths = np.asarray([70, 41, 9], np.int32)
    start = np.asarray([48, 16, 0], np.int32)  # page multiples; the last row has no cached prefix
    T = 128
    tokens = np.zeros((3, T), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(3, m.cfg.vocab_size, n)
    seen = {}
    ref_logits, ref_kv = m.prefill(tokens, lengths, on_layer=lambda l, K, V: seen.setdefault(("ref", l), (K, V)))
    C = 64
    new = np.zeros((3, C), np.int32)
    for b in range(3):
        new[b, :lengths[b] - start[b]] = tokens[b, start[b]:lengths[b]]

    def context(layer):  # the cached rows only; later positions hold garbage that must not be read (not NaN:
        # a masked score still multiplies its value row by 0)
        K, V = (np.asarray(x).copy() for x in ref_kv[layer])
        for b in range(3):
            K[b, :, start[b]:] = 7.0
            V[b, :, start[b]:] = 7.0
        return K, V

    logits = m.prefill_after(new, start, lengths - start, context,
                             on_layer=lambda l, K, V: seen.setdefault(("after", l), (K, V)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=2e-4, atol=2e-4)
    for layer in range(m.cfg.num_layers):
        for ref, got in zip(seen[("ref", layer)], seen[("after", layer)]):
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(np.asarray(got)[b, :, :n], np.asarray(ref)[b, :, :n], rtol=2e-4, atol=2e-4)
