"""The whole MoE transformer: gradients reach router and experts, and it learns."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moelab.config import Config, LossConfig, ModelConfig, MoEConfig
from moelab.model import Transformer, objective
from moelab.model.attention import Attention, causal_chunks
from moelab.model.layers import apply_rope, rope_angles

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)


def tiny(dispatch, **moe):
    cfg = Config(model=TINY, moe=MoEConfig(n_experts=4, top_k=2, dispatch=dispatch, **moe))
    return Transformer.init(cfg.model, cfg.moe, jax.random.key(0)), cfg


DEFAULT_WEIGHTS = LossConfig()


def loss_fn(model, tokens, weights=DEFAULT_WEIGHTS):
    logits, stats, _ = model(tokens[:, :-1])
    return objective(logits, tokens[:, 1:], stats, weights)


@pytest.mark.parametrize("dispatch", ["capacity", "pooled", "dropless"])
def test_gradients_reach_router_and_experts(dispatch):
    model, _ = tiny(dispatch, capacity_factor=1.0)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
    grads, _ = eqx.filter_jit(eqx.filter_grad(loss_fn, has_aux=True))(model, tokens)
    for block in grads.blocks:
        for leaf in (block.ffn.router, *jax.tree.leaves(block.ffn.experts)):
            assert bool(jnp.all(jnp.isfinite(leaf)))
            assert float(jnp.max(jnp.abs(leaf))) > 0


def test_shared_expert_sigmoid_router_and_dense_first_layer_train():
    model_cfg = dataclasses.replace(TINY, n_dense_layers=1, tie_embeddings=True)
    cfg = Config(model=model_cfg,
                 moe=MoEConfig(n_experts=4, top_k=2, router="sigmoid", shared_expert=True))
    model = Transformer.init(cfg.model, cfg.moe, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
    (loss, parts), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))(
        model, tokens)
    assert model.lm_head is None and parts["drop_frac"].shape == (1,)
    assert float(jnp.max(jnp.abs(grads.blocks[1].ffn.shared.w_up))) > 0
    assert float(jnp.max(jnp.abs(grads.blocks[0].ffn.w_up))) > 0


def test_loss_falls_on_a_repeated_batch():
    model, _ = tiny("dropless")
    tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, 64)
    opt = optax.adamw(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, tokens)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(40):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_loss_parts_are_separate_and_weighted():
    model, _ = tiny("capacity", capacity_factor=0.5)
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, 64)
    w = LossConfig(aux_weight=0.5, router_z_weight=0.25, logit_z_weight=0.125)
    total, p = loss_fn(model, tokens, w)
    expected = p["ce"] + 0.5 * p["aux_loss"] + 0.25 * p["router_z"] + 0.125 * p["logit_z"]
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert float(p["aux_loss"]) >= 1.0 - 1e-5  # Switch aux loss is >= 1, = 1 when uniform
    assert float(jnp.min(p["drop_frac"])) > 0  # capacity 0.5 must drop


def test_kv_cache_decoding_matches_full_forward():
    model, _ = tiny("dropless")
    tokens = jax.random.randint(jax.random.key(4), (1, 12), 0, 64)
    full, _, _ = model(tokens)
    caches = model.init_caches(1, 16)
    prefix, _, caches = model(tokens[:, :8], caches, 0)
    steps = [prefix]
    for i in range(8, 12):
        logits, _, caches = model(tokens[:, i:i + 1], caches, i)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_scan_unrolled_and_every_remat_policy_give_the_same_loss_and_grads(dispatch):
    """Scanned and unrolled layers, with each remat policy, compute the same float32 ops;
    only XLA's fusion and reduction order differ. Each reordered sum here has <= 64 terms,
    so its rounding error is <= 64 * 2^-24 ~ 4e-6 of the summed magnitudes: compare
    losses to 1e-5 relative and gradients to 1e-5 of the whole gradient's scale."""
    model_cfg = dataclasses.replace(TINY, n_layers=3, n_dense_layers=1)
    moe = MoEConfig(n_experts=4, top_k=2, dispatch=dispatch, capacity_factor=1.0)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
    results = {}
    for scan in (True, False):
        for remat in ("none", "full", "save_moe"):
            cfg = dataclasses.replace(model_cfg, scan_layers=scan, remat=remat)
            model = Transformer.init(cfg, moe, jax.random.key(0))
            fn = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))
            (loss, parts), grads = fn(model, tokens)
            results[scan, remat] = loss, parts["drop_frac"], jax.tree.leaves(grads)
    ref_loss, ref_drop, ref_grads = results[False, "none"]
    scale = max(float(jnp.max(jnp.abs(g))) for g in ref_grads)
    for key, (loss, drop, grads) in results.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(key))
        np.testing.assert_array_equal(drop, ref_drop)
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * scale, err_msg=str(key))


def test_layers_are_stacked_and_unstack_to_the_per_layer_blocks():
    cfg = dataclasses.replace(TINY, n_layers=3, n_dense_layers=1)
    model = Transformer.init(cfg, MoEConfig(n_experts=4, top_k=2), jax.random.key(0))
    assert model.dense_layers.attn.wq.shape[0] == 1 and model.moe_layers.attn.wq.shape[0] == 2
    blocks = model.blocks
    assert len(blocks) == 3 and blocks[0].ffn.w_up.ndim == 2
    np.testing.assert_array_equal(blocks[2].ffn.router, model.moe_layers.ffn.router[1])


def square_attention(attn: Attention, x, cos, sin, xp=jnp):
    """Causal attention as one masked softmax over the whole square: q, k, v projected in
    float32, the rest in jnp float32 or (xp=numpy) float64."""
    b, s, _ = x.shape
    hd, groups = attn.head_dim, attn.n_heads // attn.n_kv_heads
    dtype = jnp.float32 if xp is jnp else np.float64
    q = apply_rope((x @ attn.wq).reshape(b, s, attn.n_heads, hd), cos, sin)
    k = apply_rope((x @ attn.wk).reshape(b, s, attn.n_kv_heads, hd), cos, sin)
    v = (x @ attn.wv).reshape(b, s, attn.n_kv_heads, hd)
    q, k, v = (xp.asarray(a, dtype) for a in (q, k, v))
    k, v = xp.repeat(k, groups, axis=2), xp.repeat(v, groups, axis=2)  # head h uses kv h // G
    logits = xp.einsum("bqhd,bthd->bhqt", q, k) / np.sqrt(hd)
    logits = xp.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    probs = xp.exp(logits - logits.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    return xp.einsum("bhqt,bthd->bqhd", probs, v).reshape(b, s, -1) @ xp.asarray(attn.wo, dtype)


@pytest.mark.parametrize("s, chunks", [
    (200, [(0, 64), (64, 128), (128, 192), (192, 200)]),  # short: chunks of 64, one ragged
    # long: 256-query chunks, each scanning two 128-query sub-chunks recomputed in the
    # backward pass; the last chunk's one sub-chunk padded from 76 queries to 128
    (1100, [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1100)]),
])
def test_chunked_causal_attention_equals_one_masked_softmax(s, chunks):
    """Attention runs query chunk by chunk (the blocks above the diagonal skipped); it must
    equal softmax over the whole masked square, computed here in float64 numpy, and its
    gradient must equal the square's (the long path recomputes probabilities in backward)."""
    cfg = dataclasses.replace(TINY, qk_norm=False)
    assert causal_chunks(s) == chunks
    attn = Attention.init(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, s, cfg.d_model))
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(s), (2, s)), cfg.resolved_head_dim,
                           cfg.rope_theta)
    out, _ = attn(x, cos, sin)
    expected = square_attention(attn, x, cos, sin, np)
    # float32 sums of <= 1100 terms of O(1) values: error ~ 1100 * 6e-8 relative at worst
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)

    loss = lambda f: lambda a, x: jnp.sum(f(a, x) ** 2)  # a cotangent that varies per row
    grads = jax.grad(loss(lambda a, x: a(x, cos, sin)[0]), argnums=(0, 1))(attn, x)
    ref = jax.grad(loss(lambda a, x: square_attention(a, x, cos, sin)), argnums=(0, 1))(attn, x)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        # both float32, summed in another order: relative to the gradient's scale
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * float(jnp.abs(r).max()))


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_long_attention_backward_memory_is_linear_in_the_length(impl):
    """Past SHORT_LIMIT the backward pass keeps q, k, v and recomputes each sub-chunk's
    probabilities (chunked: each key block's, model/flash.py), so XLA's scratch memory for
    attention fwd+bwd grows ~linearly: doubling 2048 -> 4096 tokens doubles it (keeping the
    S^2/2 triangle of probabilities would quadruple it; measured 3.4x before the
    sub-chunks). Read from the compiled program's buffer assignment, so it is exact and
    independent of the machine's load."""
    cfg = dataclasses.replace(TINY, d_model=128, n_heads=4, n_kv_heads=2, attention_impl=impl,
                              attention_chunk=128)
    attn = Attention.init(cfg, jax.random.key(0))

    def scratch(s):
        x = jnp.zeros((1, s, cfg.d_model))
        cos, sin = rope_angles(jnp.arange(s)[None], cfg.resolved_head_dim, cfg.rope_theta)
        f = jax.grad(lambda a, x: jnp.sum(a(x, cos, sin)[0] ** 2), argnums=(0, 1))
        return jax.jit(f).lower(attn, x).compile().memory_analysis().temp_size_in_bytes

    small, large = scratch(2048), scratch(4096)
    assert large / small < 2.5, (small, large)  # linear: 2; quadratic: 4


# Short windows packed in a long row (data.short_rows / a stage's short_fraction): the
# block-diagonal mask makes each window attend exactly as its own sequence would.
# Tolerance: the same float32 products and sums, except that each query's key sum also
# runs over masked keys (exact zeros) in another blocking, so results agree to float32
# rounding accumulated over 2 layers (~1e-6 of values of order 1); 1e-5 leaves 10x.
@pytest.mark.parametrize("window, windows", [(32, 4), (128, 8)])  # 128 and 1024 tokens:
def test_windows_cut_from_one_row_attend_as_separate_sequences(window, windows):
    """...the unrolled short path and the scanned long path (> 512 tokens) of attention."""
    from moelab.model.transformer import short_segments

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    model = Transformer.init(cfg, MoEConfig(n_experts=4, top_k=2, dispatch="dropless"),
                             jax.random.key(0))
    s = window * windows
    tokens = jax.random.randint(jax.random.key(1), (2, s), 0, 64)
    segments = short_segments(2, s, 1, window)  # row 0 cut into windows, row 1 whole
    packed, _, _ = model(tokens, segments=segments)
    apart, _, _ = model(tokens[:1].reshape(windows, window))
    whole, _, _ = model(tokens[1:])
    np.testing.assert_allclose(packed[0].reshape(windows, window, -1), apart, atol=1e-5)
    np.testing.assert_allclose(packed[1], whole[0], atol=1e-5)
    # and the mask matters: without it the later windows see the earlier ones
    unmasked, _, _ = model(tokens)
    assert np.abs(unmasked[0, window:] - packed[0, window:]).max() > 1e-3


def test_the_train_step_cuts_its_short_rows_into_windows():
    """A step on one 128-token row with data.short_rows = 1 (windows of 32) has the loss of
    a step on the 4 windows as sequences of their own (tolerance: as the test above)."""
    from moelab.config import config_from_dict
    from moelab.train.optimizer import make_optimizer, trainable
    from moelab.train.step import make_train_step

    def step_loss(data: dict, batch: np.ndarray) -> float:
        cfg = config_from_dict({
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
                      "n_kv_heads": 2, "d_ff": 32},
            "moe": {"n_experts": 4, "top_k": 2, "dispatch": "dropless"}, "data": data})
        model = Transformer.init(cfg.model, cfg.moe, jax.random.key(0))
        optimizer = make_optimizer(cfg.optim, 10, None, cfg.model.d_model)
        step = make_train_step(cfg, optimizer, donate=False)
        _, _, parts = step(model, optimizer.init(trainable(model)), jnp.asarray(batch))
        return float(parts["ce"])

    stream = np.random.default_rng(0).integers(0, 64, 129)
    windows = np.stack([stream[i:i + 33] for i in range(0, 128, 32)])  # [4, 32 + 1]
    cut = step_loss({"seq_len": 128, "batch_size": 1, "short_rows": 1, "short_len": 32},
                    stream[None])
    apart = step_loss({"seq_len": 32, "batch_size": 4}, windows)
    whole = step_loss({"seq_len": 128, "batch_size": 1}, stream[None])
    assert abs(cut - apart) < 1e-5 and abs(cut - whole) > 1e-3
