"""DuoAttention-style retrieval scores and MixHQ head classification."""
import numpy as np
import pytest

from jkv.compression.heads import attention_probs, classify_heads, retrieval_scores


def _probs_with_focus(n_layers, n_heads, tq, tk, focus):
    """probs [L, H, Tq, Tk]; focus[l][h] = 'middle' | 'recent' | 'sink'."""
    probs = np.zeros((n_layers, n_heads, tq, tk), np.float32)
    for l in range(n_layers):
        for h in range(n_heads):
            col = {"middle": tk // 2, "recent": tk - 1, "sink": 0}[focus[l][h]]
            probs[l, h, :, col] = 1.0
    return probs


def test_scores_find_the_heads_that_attend_to_the_middle():
    focus = [["middle", "recent", "sink", "recent"], ["sink", "sink", "middle", "middle"]]
    probs = _probs_with_focus(2, 4, 3, 200, focus)
    q_pos = np.array([199, 199, 199])
    scores = retrieval_scores(probs, q_pos, n_kv_heads=4, sink=4, recent=16)
    np.testing.assert_allclose(scores, [[1, 0, 0, 0], [0, 0, 1, 1]])
    # GQA: 4 query heads over 2 KV heads average their group.
    np.testing.assert_allclose(retrieval_scores(probs, q_pos, n_kv_heads=2, sink=4, recent=16),
                               [[0.5, 0], [0, 1]])


def test_classify_top_fraction_globally_with_stable_ties():
    scores = np.array([[0.1, 0.9, 0.5], [0.5, 0.0, 0.7]])
    np.testing.assert_array_equal(classify_heads(scores, 0.5), [[False, True, True], [False, False, True]])
    np.testing.assert_array_equal(classify_heads(scores, 4 / 6), [[False, True, True], [True, False, True]])
    assert not classify_heads(scores, 0.0).any() and classify_heads(scores, 1.0).all()


def test_attention_probs_is_causal_and_normalized():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((4, 5, 8)), rng.standard_normal((2, 10, 8))
    q_pos = np.array([0, 3, 5, 8, 9])
    p = attention_probs(q, k, q_pos)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    assert np.all(p[:, 0, 1:] == 0) and np.all(p[:, 1, 4:] == 0)
    logits = q[0, 2] @ k[0, :6].T / np.sqrt(8)
    np.testing.assert_allclose(p[0, 2, :6], np.exp(logits) / np.exp(logits).sum(), rtol=1e-5)
    np.testing.assert_allclose(p[1], attention_probs(q[1:2], k[0:1], q_pos)[0], rtol=1e-6)  # GQA group 0


@pytest.mark.parametrize("bad, match", [(np.zeros(3), "must be a non-empty"), (np.full((1, 2), np.nan), "NaN")])
def test_classify_rejects_bad_scores(bad, match):
    with pytest.raises(ValueError, match=match):
        classify_heads(bad, 0.5)


def test_scores_validate_shapes():
    with pytest.raises(ValueError, match="must divide"):
        retrieval_scores(np.zeros((1, 3, 2, 4)), np.array([3, 3]), n_kv_heads=2)
    with pytest.raises(ValueError, match="q_pos"):
        retrieval_scores(np.zeros((1, 2, 2, 4)), np.array([3]), n_kv_heads=2)
