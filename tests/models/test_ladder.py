"""Model correctness ladder on tiny random models: cached == uncached, prefill(N)+decode == prefill(N+1),
per-layer pieces == fused decode step, padding does not leak into other rows."""
import jax.numpy as jnp
import numpy as np
import pytest

from models import tiny_model

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, seed=3)


def _tokens(rng, B, T, vocab):
    return rng.integers(3, vocab, size=(B, T)).astype(np.int32)


def test_padding_does_not_change_logits(model):
    rng = np.random.default_rng(0)
    toks = _tokens(rng, 2, 9, model.cfg.vocab_size)
    alone, _ = model.prefill(toks[:1, :5], np.array([5]))
    padded, _ = model.prefill(toks, np.array([5, 9]))
    np.testing.assert_allclose(np.asarray(padded[0]), np.asarray(alone[0]), atol=1e-5, rtol=1e-5)


def test_prefill_plus_decode_equals_longer_prefill(model):
    rng = np.random.default_rng(1)
    lengths = np.array([7, 4, 10])
    toks = _tokens(rng, 3, 11, model.cfg.vocab_size)
    _, kv = model.prefill(toks[:, :10], lengths)
    cache = model.cache_from_prefill(kv, 16)
    next_tok = toks[np.arange(3), lengths]
    logits, _ = model.decode_step(cache, next_tok, lengths)
    for b in range(3):
        n = lengths[b] + 1
        ref, _ = model.prefill(toks[b:b + 1, :n], np.array([n]))
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(ref[0]), atol=2e-5, rtol=2e-5)


def test_cached_decode_equals_uncached_forward(model):
    """Greedy-decode 6 tokens with the cache; every step's logits equal a full forward pass."""
    rng = np.random.default_rng(2)
    prompt = _tokens(rng, 1, 5, model.cfg.vocab_size)
    logits, kv = model.prefill(prompt, np.array([5]))
    cache = model.cache_from_prefill(kv, 16)
    seq = list(prompt[0])
    for step in range(6):
        tok = int(np.argmax(np.asarray(logits[0])))
        seq.append(tok)
        logits, cache = model.decode_step(cache, np.array([tok]), np.array([len(seq) - 1]))
        full, _ = model.prefill(np.array([seq]), np.array([len(seq)]), all_logits=True)
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(full[0, -1]), atol=2e-5, rtol=2e-5)


def test_pieces_equal_fused_decode_step(model):
    """qkv + attend_and_mlp over the full cache reproduce decode_step (the sparse path's contract)."""
    rng = np.random.default_rng(3)
    lengths = np.array([6, 3])
    toks = _tokens(rng, 2, 6, model.cfg.vocab_size)
    _, kv = model.prefill(toks, lengths)
    n_max = 8
    cache = model.cache_from_prefill(kv, n_max)
    new_tok = np.array([5, 9], np.int32)
    ref_logits, _ = model.decode_step(model.cache_from_prefill(kv, n_max), new_tok, lengths)
    x = model.embed(new_tok)
    for l in range(model.cfg.num_layers):
        q, k, v = model.qkv(l, x, lengths)
        K, V = (np.array(a) for a in cache[l])
        for b in range(2):
            K[b, :, lengths[b]] = np.asarray(k[b])
            V[b, :, lengths[b]] = np.asarray(v[b])
        valid = np.broadcast_to((lengths + 1)[:, None], (2, model.cfg.num_kv_heads))
        x = model.attend_and_mlp(l, x, q, jnp.asarray(K), jnp.asarray(V), valid)
    np.testing.assert_allclose(np.asarray(model.logits(x)), np.asarray(ref_logits), atol=2e-5, rtol=2e-5)


def test_on_layer_callback_sees_every_layer_in_order(model):
    seen = []
    toks = np.ones((1, 4), np.int32)
    _, kv = model.prefill(toks, np.array([4]), on_layer=lambda l, K, V: seen.append((l, K.shape)))
    assert [l for l, _ in seen] == list(range(model.cfg.num_layers))
    assert seen[0][1] == (1, model.cfg.num_kv_heads, 4, model.cfg.head_dim)


def test_long_prompt_chunked_attention_matches_unchunked(monkeypatch):
    from models import transformer as tfm

    m = tiny_model("llama", seed=5)
    rng = np.random.default_rng(4)
    toks = _tokens(rng, 1, 64, m.cfg.vocab_size)
    ref, _ = m.prefill(toks, np.array([50]), all_logits=True)
    monkeypatch.setattr(tfm, "PREFILL_QUERY_CHUNK", 16)
    m2 = tiny_model("llama", seed=5)  # fresh jit caches pick up the smaller chunk
    out, _ = m2.prefill(toks, np.array([50]), all_logits=True)
    np.testing.assert_allclose(np.asarray(out[0, :50]), np.asarray(ref[0, :50]), atol=2e-5, rtol=2e-5)


def test_blocked_prefill_attention_equals_whole_causal_attention(monkeypatch):
    """Blocks of 16 queries x keys with an online softmax give one causal attention over all keys:
    GQA group 3, two prompt lengths (padding inside a block and whole blocks past the length)."""
    from models import transformer as tfm

    rng = np.random.default_rng(6)
    B, T, H, H_kv, D = 2, 64, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    K, V = (jnp.asarray(rng.standard_normal((B, H_kv, T, D)), jnp.float32) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lengths = jnp.array([64, 23], jnp.int32)
    key = jnp.arange(T)
    mask = (key[None, None, :] <= positions[:, :, None]) & (key[None, None, :] < lengths[:, None, None])
    want = tfm.attention(q, K, V, mask[:, None])
    got = tfm.blocked_causal_attention(q, K, V, positions, lengths, block=16)
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(got[b, :n]), np.asarray(want[b, :n]), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(tfm, "PREFILL_BLOCK", 16)
    np.testing.assert_array_equal(np.asarray(tfm.prefill_attention(q, K, V, positions, lengths)), np.asarray(got))


def test_long_prompt_blocked_attention_matches_whole(monkeypatch):
    from models import transformer as tfm

    m = tiny_model("llama", seed=5)
    rng = np.random.default_rng(4)
    toks = _tokens(rng, 1, 64, m.cfg.vocab_size)
    ref, _ = m.prefill(toks, np.array([50]), all_logits=True)  # 64 <= PREFILL_BLOCK: whole attention
    monkeypatch.setattr(tfm, "PREFILL_BLOCK", 16)
    m2 = tiny_model("llama", seed=5)  # fresh jit caches pick up the smaller block
    out, _ = m2.prefill(toks, np.array([50]), all_logits=True)
    np.testing.assert_allclose(np.asarray(out[0, :50]), np.asarray(ref[0, :50]), atol=2e-5, rtol=2e-5)


def test_bfloat16_model_tracks_float32():
    """bf16 params/activations (norms and softmax in f32) stay close to the fp32 model."""
    import jax

    from models import Model
    from models.transformer import init_params

    m32 = tiny_model("qwen2", seed=7)
    cfg16 = m32.cfg.replace(dtype="bfloat16")
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_params(m32.cfg, 7))
    m16 = Model(cfg16, p16)
    assert m16.params["layers"][0]["q_proj"]["kernel"].dtype == jnp.bfloat16
    rng = np.random.default_rng(5)
    toks = _tokens(rng, 2, 12, m32.cfg.vocab_size)
    l32, _ = m32.prefill(toks, np.array([12, 7]))
    l16, kv16 = m16.prefill(toks, np.array([12, 7]))
    assert kv16[0][0].dtype == jnp.bfloat16
    a, b = np.asarray(l32), np.asarray(l16, np.float32)
    assert np.abs(a - b).max() <= 5e-2 * np.abs(a).max()
    cache = m16.cache_from_prefill(kv16, 16)
    logits, _ = m16.decode_step(cache, np.array([4, 5]), np.array([12, 7]))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
