"""Auxiliary-loss-free balancing: the selection bias, its two update rules, and its state."""

import dataclasses
import json
import math
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import (
    Config,
    ConfigError,
    LossConfig,
    ModelConfig,
    MoEConfig,
    config_from_dict,
)
from moelab.model import Transformer, objective
from moelab.model.balance import moe_layers, sign_rule, update_bias, without_bias
from moelab.model.moe import MoE
from moelab.model.router import quantile_bias, route, share_margin
from moelab.train.optimizer import make_optimizer, trainable
from moelab.train.step import make_train_step

SIGMOID = MoEConfig(n_experts=8, top_k=2, router="sigmoid")


def test_bias_changes_the_choice_but_not_the_weights_nor_the_gradient():
    logits = jax.random.normal(jax.random.key(0), (2, 16, 8))
    bias = jnp.zeros(8).at[3].set(2.0)  # sigmoid scores < 1: expert 3 always wins
    routing, _ = route(logits, SIGMOID, bias)
    assert bool(jnp.all(jnp.any(routing.experts == 3, axis=-1)))
    scores = jax.nn.sigmoid(logits)
    picked = jnp.take_along_axis(scores, routing.experts, -1)
    np.testing.assert_array_equal(routing.weights, picked / picked.sum(-1, keepdims=True))

    def weight_sum(bias):
        r, _ = route(logits, SIGMOID, bias)
        return jnp.sum(r.weights * jnp.arange(2.0))

    assert not bool(jnp.any(jax.grad(weight_sum)(bias)))


def test_routed_scaling_multiplies_the_normalized_weights():
    logits = jax.random.normal(jax.random.key(0), (1, 4, 8))
    routing, _ = route(logits, MoEConfig(n_experts=8, top_k=2, router="sigmoid",
                                         routed_scaling=2.5))
    np.testing.assert_allclose(routing.weights.sum(-1), 2.5, rtol=1e-6)


def test_sign_rule_moves_toward_the_mean_and_stays_zero_mean_per_layer():
    load = jnp.array([[10.0, 11.0, 12.0, 47.0], [20.0, 20.0, 20.0, 20.0]])  # stacked [L, E]
    new = sign_rule(jnp.zeros((2, 4)), load, 0.01)
    # signs +, +, +, - ; minus their mean 0.005
    np.testing.assert_allclose(new[0], [0.005, 0.005, 0.005, -0.015], atol=1e-7)
    np.testing.assert_array_equal(new[1], 0.0)  # balanced: nothing moves


def test_quantile_rule_gives_each_expert_exactly_its_share():
    """Moving one expert by -beta_e (the others held) makes exactly C tokens pick it.

    Scores are continuous random numbers, so ties (where "exactly" could fail) have
    probability zero; the margin at the C-th token is then strictly above the (C+1)-th.
    """
    tokens, n_experts, k = 96, 8, 2
    scores = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (1, tokens, n_experts)))
    bias = 0.1 * jax.random.normal(jax.random.key(4), (n_experts,))
    beta = share_margin(scores + bias, k)
    share = math.ceil(tokens * k / n_experts)
    for e in range(n_experts):
        # -beta_e puts the C-th token exactly on the line; half its gap to the next keeps it
        moved = bias.at[e].add(-beta[e] + 1e-7)
        chosen = jax.lax.top_k(scores[0] + moved, k)[1]
        assert int(jnp.sum(chosen == e)) == share, e
    new = quantile_bias(scores + bias, bias, k)
    np.testing.assert_allclose(new, (bias - beta) - jnp.mean(bias - beta), atol=1e-7)


def tiny_biased(balance: str, **moe) -> tuple[Transformer, Config]:
    cfg = Config(model=ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2,
                                   n_kv_heads=1, d_ff=16, n_dense_layers=1),
                 moe=MoEConfig(n_experts=4, top_k=2, router="sigmoid", balance=balance,
                               block_size=8, **moe))
    return Transformer.init(cfg.model, cfg.moe, jax.random.key(0)), cfg


def run_steps(balance: str, steps: int, **moe):
    model, cfg = tiny_biased(balance, **moe)
    optimizer = make_optimizer(cfg.optim, steps, None)
    opt_state = optimizer.init(trainable(model))
    step = make_train_step(cfg, optimizer)
    batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
    for _ in range(steps):
        model, opt_state, parts = step(model, opt_state, batch)
    return model, opt_state, parts


def test_optimizer_never_holds_nor_decays_the_bias():
    """bias_rate 0: Adam with weight decay 0.1 would still move a leaf it held; it must not."""
    model, opt_state, parts = run_steps("bias_sign", 3, bias_rate=0.0)
    for layer in moe_layers(model):
        np.testing.assert_array_equal(layer.bias, 0.0)
    n_weights = len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    n_bias = len(moe_layers(model))  # one bias leaf per MoE stack ([L_moe, E] when stacked)
    assert n_bias >= 1
    assert len(jax.tree.leaves(without_bias(eqx.filter(model, eqx.is_array)))) == (
        n_weights - n_bias)
    moments = [a for a in jax.tree.leaves(opt_state) if a.ndim > 0]
    assert len(moments) == 2 * (n_weights - n_bias)  # Adam's mu and nu, none for the biases
    np.testing.assert_array_equal(parts["bias_range"], 0.0)


@pytest.mark.parametrize("balance", ["bias_sign", "bias_quantile"])
def test_train_step_moves_each_layers_bias_by_its_own_loads(balance):
    model, _, parts = run_steps(balance, 1, bias_rate=0.01, quantile_rate=0.1)
    biases = model.moe_layers.ffn.bias  # the 2 MoE layers, stacked: [2, E]
    assert biases.shape == (2, 4) and parts["tokens_per_expert"].shape == (2, 4)
    for i, bias in enumerate(biases):
        if balance == "bias_sign":
            want = sign_rule(jnp.zeros(4), parts["tokens_per_expert"][i], 0.01)
        else:
            want = 0.1 * parts["quantile_bias"][i]  # quantile_rate 0.1, from a zero bias
        np.testing.assert_array_equal(bias, want)
        assert float(jnp.ptp(bias)) > 0
    np.testing.assert_allclose(parts["bias_range"], [float(jnp.ptp(b)) for b in biases])
    assert parts["router_entropy"].shape == (2,)


def test_lr_decay_schedule_scales_the_sign_rule_by_the_lr_after_warmup():
    """WSD over 8 steps, warmup 2, decay_fraction 0.5: lr/peak is 0.5, 0.75 in warmup, 1 at
    steps 2-4 and 1 - 0.9 * (t - 4) / 4 at t = 4..7 (min_lr_ratio 0.1). lr_decay keeps the
    full rate in warmup, then follows lr/peak. The scale is float32 (1 ulp ~ 6e-8 relative)
    times a rate of 0.01 on biases of ~0.01: 1e-8 absolute covers it."""
    model, cfg = tiny_biased("bias_sign", bias_rate=0.01, bias_rate_schedule="lr_decay")
    cfg = dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, warmup_steps=2, schedule="wsd",
                                       decay_fraction=0.5, min_lr_ratio=0.1),
        train=dataclasses.replace(cfg.train, steps=8))
    optimizer = make_optimizer(cfg.optim, 8, None)
    opt_state = optimizer.init(trainable(model))
    step = make_train_step(cfg, optimizer)
    batch = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
    for t, scale in enumerate([1, 1, 1, 1, 1, 0.775, 0.55, 0.325]):
        before = np.asarray(model.moe_layers.ffn.bias)
        model, opt_state, parts = step(model, opt_state, batch)
        want = sign_rule(before, parts["tokens_per_expert"], 0.01 * scale)
        np.testing.assert_allclose(model.moe_layers.ffn.bias, want, rtol=0, atol=1e-8,
                                   err_msg=f"step {t}")
        assert float(jnp.max(jnp.abs(want - before))) > 0, t  # the rule moved the bias


def test_update_bias_reads_stacked_layers_in_order():
    """A layer axis on the bias (layers stacked for scan) takes that many stats rows, in
    layer order."""
    model, cfg = tiny_biased("bias_sign", bias_rate=1.0)
    load = jnp.array([[1.0, 2, 3, 4], [4, 3, 2, 1]])  # one row per stacked MoE layer
    new = update_bias(model, {"tokens_per_expert": load}, cfg.moe)
    np.testing.assert_array_equal(new.moe_layers.ffn.bias, sign_rule(jnp.zeros((2, 4)),
                                                                      load, 1.0))
    assert float(new.moe_layers.ffn.bias[0, 0]) > 0 > float(new.moe_layers.ffn.bias[1, 0])


def test_bias_quantile_needs_a_next_choice():
    with pytest.raises(ConfigError, match="moe.balance"):
        config_from_dict({"moe": {"n_experts": 2, "top_k": 2, "balance": "bias_quantile"}})


def test_resume_restores_the_bias_bitwise(tmp_path, small_corpus):
    """Kill-free resume: drop the last checkpoint, rerun, land on the same bias and losses."""
    from conftest import tiny_config

    from moelab.train.trainer import Trainer

    raw = tiny_config(small_corpus, moe={"router": "sigmoid", "balance": "bias_sign",
                                         "bias_rate": 0.01},
                      train={"steps": 8, "checkpoint_every": 4, "eval_every": 8})
    cfg = config_from_dict(raw)
    clean = Trainer(cfg, tmp_path / "clean")
    clean.run()
    resumed = Trainer(cfg, tmp_path / "resumed")
    resumed.run()
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "8")
    again = Trainer(cfg, tmp_path / "resumed")
    assert again.step == 4
    again.run()
    for a, b in zip(moe_layers(clean.model), moe_layers(again.model), strict=True):
        np.testing.assert_array_equal(a.bias, b.bias)
    rows = [json.loads(line) for line in
            (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    clean_rows = [json.loads(line) for line in
                  (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [r["loss"] for r in clean_rows]
    # The sign rule can swing a bias back to 0 (+rate, then -rate), so ask that it moved at
    # some step, not at the last one.
    assert max(r["bias_range/layer_1"] for r in rows) > 0 and "router_entropy/layer_0" in rows[-1]


def test_bfloat16_compute_keeps_the_selection_bias_in_float32():
    """A bias step of 1e-3 on a score near 0.5 is below bfloat16's resolution (2^-9 there):
    cast, it would not change the choice it was moved to change."""
    from moelab.train.step import cast_floats

    model, _ = tiny_biased("bias_sign")
    model = eqx.tree_at(lambda m: m.moe_layers.ffn.bias, model, jnp.full((2, 4), 1e-3))
    cast = cast_floats(model, jnp.bfloat16)
    assert cast.moe_layers.ffn.router.dtype == jnp.bfloat16
    assert cast.moe_layers.ffn.bias.dtype == jnp.float32
    np.testing.assert_array_equal(cast.moe_layers.ffn.bias, model.moe_layers.ffn.bias)


def deepseek_sequence_loss(experts: np.ndarray, scores: np.ndarray) -> float:
    """DeepSeek-V3 eq. 17-20 written out: per sequence, f_i = E/(K*T) * #tokens routed to i,
    P_i = mean over its tokens of s_i / sum_j s_j; sum_i f_i P_i, then the mean over sequences."""
    b, t, k = experts.shape
    e = scores.shape[-1]
    per_sequence = []
    for seq in range(b):
        f = [e / (k * t) * sum(i in experts[seq, tok] for tok in range(t)) for i in range(e)]
        normalized = scores[seq] / scores[seq].sum(-1, keepdims=True)
        p = normalized.mean(0)
        per_sequence.append(sum(f[i] * p[i] for i in range(e)))
    return float(np.mean(per_sequence))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_sequence_aux_loss_is_deepseeks_formula(router):
    logits = 2.0 * jax.random.normal(jax.random.key(5), (3, 16, 8))
    bias = 0.3 * jax.random.normal(jax.random.key(6), (8,))  # f counts the biased choice
    moe = MoEConfig(n_experts=8, top_k=2, router=router)
    routing, stats = route(logits, moe, bias)
    scores = jax.nn.softmax(logits, -1) if router == "softmax" else jax.nn.sigmoid(logits)
    want = deepseek_sequence_loss(np.asarray(routing.experts), np.asarray(scores, np.float64))
    # float32 sums of 16 x 8 terms of size ~1: relative error well under 1e-5
    np.testing.assert_allclose(float(stats.seq_aux_loss), want, rtol=1e-5)
    # one sequence: the sequence-wise loss is the batch (Switch) loss
    _, one = route(logits[:1], moe, bias)
    np.testing.assert_allclose(float(one.seq_aux_loss), float(one.aux_loss), rtol=1e-6)


def moe_layer(**moe) -> MoE:
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16)
    return MoE.init(cfg, MoEConfig(n_experts=4, top_k=2, block_size=8, **moe), jax.random.key(2))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_sequence_aux_loss_trains_only_the_router(router):
    layer = moe_layer(router=router, shared_expert=True)
    x = jax.random.normal(jax.random.key(3), (2, 8, 16))
    grads = eqx.filter_grad(lambda m: m(x)[1].seq_aux_loss)(layer)
    assert float(jnp.abs(grads.router).max()) > 0
    for leaf in jax.tree.leaves((grads.experts, grads.shared)):
        np.testing.assert_array_equal(leaf, 0.0)


def test_sequence_aux_loss_adds_nothing_at_weight_zero():
    """Weight 0 leaves the term out of the total (a NaN term would otherwise poison it)."""
    logits = jax.random.normal(jax.random.key(0), (2, 8, 64))
    targets = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    _, stats = jax.vmap(moe_layer())(jax.random.normal(jax.random.key(3), (1, 2, 8, 16)))
    poisoned = eqx.tree_at(lambda s: s.seq_aux_loss, stats, jnp.full((1,), jnp.nan))
    total, parts = objective(logits, targets, poisoned, LossConfig())
    assert np.isfinite(float(total)) and np.isnan(float(parts["seq_aux_loss"]))
    off, _ = objective(logits, targets, stats, LossConfig())
    on, parts = objective(logits, targets, stats, LossConfig(seq_aux_weight=0.5))
    np.testing.assert_allclose(float(on - off), 0.5 * float(parts["seq_aux_loss"]), rtol=1e-5)
    assert float(parts["seq_aux_loss"]) > 0


def test_sequence_aux_loss_per_stacked_layer_scanned_or_not():
    stats = []
    for scan_layers in (True, False):
        cfg = Config(model=ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2,
                                       n_kv_heads=1, d_ff=16, scan_layers=scan_layers),
                     moe=MoEConfig(n_experts=4, top_k=2, block_size=8))
        model = Transformer.init(cfg.model, cfg.moe, jax.random.key(0))
        stats.append(model(jax.random.randint(jax.random.key(1), (2, 9), 0, 64))[1])
    assert stats[0].seq_aux_loss.shape == (3,)
    np.testing.assert_allclose(stats[0].seq_aux_loss, stats[1].seq_aux_loss, rtol=1e-6)
    _, parts = objective(jnp.zeros((2, 9, 64)), jnp.zeros((2, 9), int), stats[0], LossConfig())
    np.testing.assert_allclose(parts["seq_aux_loss"], jnp.mean(stats[0].seq_aux_loss))


@pytest.mark.parametrize("dispatch", ["capacity", "pooled", "pooled_wave"])
def test_uniform_routing_balances_exactly_and_capacity_one_drops_nothing(dispatch):
    layer = moe_layer(uniform_routing=True, dispatch=dispatch, capacity_factor=1.0,
                      send_capacity_factor=1.0, balance="bias_sign")
    x = jax.random.normal(jax.random.key(3), (3, 8, 16))  # S*K = 16: a multiple of E = 4
    logits = jnp.einsum("bsd,de->bse", x, layer.router)
    routing, stats = route(logits, layer.moe, layer.bias)
    per_sequence = jax.nn.one_hot(routing.experts, 4).sum((1, 2))
    np.testing.assert_array_equal(per_sequence, 4.0)  # 8 tokens x 2 / 4 experts, each sequence
    np.testing.assert_array_equal(stats.tokens_per_expert, 12.0)
    np.testing.assert_array_equal(routing.weights, 0.5)
    assert bool(jnp.all(routing.experts[..., 0] != routing.experts[..., 1]))
    _, out = layer(x)
    assert float(out.drop_frac) == 0.0

    def total(layer):  # every router-dependent term: outputs, aux, z, sequence aux
        y, s = layer(x)
        return jnp.sum(y ** 2) + s.aux_loss + s.router_z + s.seq_aux_loss

    np.testing.assert_array_equal(eqx.filter_grad(total)(layer).router, 0.0)
    learned = moe_layer(dispatch=dispatch, capacity_factor=1.0, send_capacity_factor=1.0)
    assert float(jnp.abs(eqx.filter_grad(total)(learned).router).max()) > 0
