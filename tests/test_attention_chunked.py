"""model.attention_impl: chunked (model/flash.py) computes dense attention's numbers in
key/value blocks and leaves KV-cache decoding alone (its memory: tests/test_model.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ConfigError, ModelConfig, MoEConfig, RopeConfig, config_from_dict
from moelab.model import Transformer
from moelab.model.attention import Attention
from moelab.model.layers import rope_angles
from moelab.model.transformer import short_segments, with_model_config

# GQA (4 query heads over 2 kv heads), QK-norm, YaRN RoPE and a logit multiplier: every
# input the chunked path must treat as the dense one does; init_std 0.3 makes the logits
# O(1), so attention is far from uniform
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32,
                  attn_logit_scale=1.3, attention_chunk=16, init_std=0.3,
                  rope=RopeConfig(type="yarn", factor=2.0, original_max_position_embeddings=32))
# Tolerance: both paths are float32 with the same products; the chunked one sums each
# row's exponentials block by block, rescaled by exp(m_old - m_new), instead of in one
# pass. Each output is a convex combination of values O(1): the reordering moves it by
# about (terms summed) x 2^-24 ~ 64 x 6e-8 = 4e-6 at worst here; 2e-5 leaves 5x. Gradients
# add one more such sum (dp - rowsum(do * o)), so they are compared relative to their scale.
RTOL = 2e-5


def both(attn: Attention) -> tuple[Attention, Attention]:
    return (dataclasses.replace(attn, impl="dense"), dataclasses.replace(attn, impl="chunked"))


# one block; 2.5 blocks (padded) with packed windows; four blocks
@pytest.mark.parametrize("s, segmented", [(16, False), (40, True), (64, False)])
def test_chunked_equals_dense_in_outputs_and_gradients(s, segmented):
    dense, chunked = both(Attention.init(CFG, jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (2, s, CFG.d_model))
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(s), (2, s)), CFG.resolved_head_dim,
                           CFG.rope_theta, CFG.rope)
    # row 0 cut into windows of 8 (packed short sequences), row 1 whole
    segments = short_segments(2, s, 1, 8) if segmented else None
    run = lambda a, x: a(x, cos, sin, segments=segments)[0]
    loss = lambda a, x: jnp.sum(jnp.sin(3 * run(a, x)))  # a cotangent varying per entry
    both_ways = jax.jit(lambda a, x: (run(a, x), jax.grad(loss, argnums=(0, 1))(a, x)))
    (out_d, grads_d), (out_c, grads_c) = both_ways(dense, x), both_ways(chunked, x)
    assert float(jnp.std(out_d)) > 0.1  # outputs far from zero: the bound means something
    np.testing.assert_allclose(out_c, out_d, rtol=RTOL, atol=RTOL * float(jnp.abs(out_d).max()))
    for c, d in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_d), strict=True):
        np.testing.assert_allclose(c, d, rtol=RTOL, atol=RTOL * float(jnp.abs(d).max()))


def test_kv_cache_generation_is_unaffected():
    """Decoding with a KV cache runs the cached path under either impl: its logits equal the
    chunked model's full forward, and greedy generation picks the full forward's argmax.
    (A stage switches a model's impl with with_model_config, as here.)"""
    from moelab.export.generate import generate

    moe = MoEConfig(n_experts=4, top_k=2, dispatch="dropless")
    dense = Transformer.init(CFG, moe, jax.random.key(0))
    chunked = with_model_config(dense, dataclasses.replace(CFG, attention_impl="chunked"))
    assert {b.attn.impl for b in chunked.blocks} == {"chunked"}
    prompt = [5, 17, 42, 3, 9]
    tokens = prompt + generate(chunked, prompt, max_new_tokens=35)
    forward = jax.jit(lambda m, t, caches=None: m(t, caches)[0])
    full = forward(chunked, jnp.asarray([tokens]))
    cached = forward(chunked, jnp.asarray([tokens]), chunked.init_caches(1, 48))  # prefill
    np.testing.assert_allclose(cached, full, rtol=RTOL, atol=RTOL * float(jnp.abs(full).max()))
    assert np.argmax(full[0, len(prompt) - 1:-1], -1).tolist() == tokens[len(prompt):]


def test_bad_attention_values_are_refused_by_name():
    raw = {"data": {"seq_len": 64}}
    with pytest.raises(ConfigError, match="model.attention_impl"):
        config_from_dict({**raw, "model": {"attention_impl": "flash"}})
    with pytest.raises(ConfigError, match="model.attention_chunk"):
        config_from_dict({**raw, "model": {"attention_chunk": 0}})
    with pytest.raises(ConfigError, match=r"stages\[0\].model.attention_chunk"):
        config_from_dict({**raw, "stages": [{"model": {"attention_chunk": -8}}]})
