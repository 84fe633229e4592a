"""Trainer parts in-process: spike detector, LR schedules, accumulation, FLOPs count."""

import dataclasses
import json
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moelab.config import Config, LossConfig, ModelConfig, MoEConfig, OptimConfig, config_from_dict
from moelab.model import Transformer
from moelab.train.metrics import active_params, flops_per_token, total_params
from moelab.train.optimizer import lr_schedule, make_optimizer, trainable
from moelab.train.spikes import SpikeDetector
from moelab.train.step import make_train_step


def run_detector(series, **kw):
    detector = SpikeDetector(**kw)
    return {i: flag for i, v in enumerate(series) if (flag := detector.update(v))}


def noisy_loss(n, seed=0):
    rng = np.random.default_rng(seed)
    return 3.0 * np.exp(-np.arange(n) / 400) + 0.02 * rng.standard_normal(n) + 2.0


def test_normal_noise_is_not_flagged():
    for seed in range(5):
        assert run_detector(noisy_loss(500, seed)) == {}


def test_single_spike_is_flagged_and_the_run_goes_on():
    series = noisy_loss(300)
    series[150] += 1.0
    assert run_detector(series) == {150: "spike"}


def test_sustained_blow_up_is_a_divergence():
    series = noisy_loss(300)
    series[200:] += np.linspace(1.0, 5.0, 100)
    flags = run_detector(series, patience=5)
    assert [flags[i] for i in range(200, 204)] == ["spike"] * 4
    assert flags[204] == "divergence"
    assert run_detector([2.0] * 20 + [float("nan")]) == {20: "divergence"}


def test_wsd_schedule_warms_up_holds_then_decays():
    cfg = OptimConfig(lr=1.0, schedule="wsd", warmup_steps=10, decay_fraction=0.2,
                      min_lr_ratio=0.1)
    lr = [float(lr_schedule(cfg, 100)(s)) for s in range(101)]
    assert lr[0] < lr[5] < lr[10] == pytest.approx(1.0)
    assert all(v == pytest.approx(1.0) for v in lr[10:80])
    assert lr[90] == pytest.approx(0.55, abs=0.01) and lr[100] == pytest.approx(0.1)
    cos = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert float(lr_schedule(cos, 100)(50)) == pytest.approx(0.5, abs=0.01)


def test_gradient_accumulation_matches_one_big_batch():
    base = Config(model=ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                    n_kv_heads=1, d_ff=32),
                  moe=MoEConfig(n_experts=4, top_k=1), loss=LossConfig(0.0, 0.0, 0.0))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 64)
    results = []
    for accum in (1, 4):
        cfg = dataclasses.replace(base, optim=OptimConfig(grad_accum=accum, warmup_steps=0))
        model = Transformer.init(cfg.model, cfg.moe, jax.random.key(1))
        opt = make_optimizer(cfg.optim, 10, None)
        _, state, parts = make_train_step(cfg, opt)(model, opt.init(trainable(model)), tokens)
        results.append((state, parts))
    (s1, p1), (s4, p4) = results
    np.testing.assert_allclose(p1["ce"], p4["ce"], rtol=1e-5)
    np.testing.assert_allclose(p1["grad_norm"], p4["grad_norm"], rtol=1e-4)
    # Accumulation must give the same gradient, so compare what Adam stores from it: after
    # one step mu = (1 - b1) * g and nu = (1 - b2) * g^2 (clipping is inactive at this
    # norm). The parameters themselves are not comparable: Adam's first update is
    # lr * g / (|g| + eps), so a gradient near eps = 1e-8 turns a float32 rounding
    # difference of ~1e-9 into a parameter difference of order lr, on any CPU whose
    # reduction order differs. The gradients are means over 128 tokens summed in a
    # different order (4 micro-batches vs 1); float32 summation error is bounded by
    # n * 2^-24 * sum|terms| ~ 1e-5 of the gradient's scale. The scale is the whole
    # gradient's, not each leaf's: with top_k=1 the router's true gradient is exactly zero
    # (the renormalized combine weight is 1) and that leaf holds only rounding noise.
    for key in ("mu", "nu"):
        a_leaves = [np.asarray(x) for x in jax.tree.leaves(optax.tree_utils.tree_get(s1, key))]
        b_leaves = [np.asarray(x) for x in jax.tree.leaves(optax.tree_utils.tree_get(s4, key))]
        scale = max(float(np.abs(a).max()) for a in a_leaves)
        for a, b in zip(a_leaves, b_leaves, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale)


def _one_update(optim: OptimConfig, d_model: int = 32, grad: float = 1e-3):
    """(params, AdamW's first update) for a tiny two-layer model and a constant gradient."""
    cfg = Config(model=ModelConfig(vocab_size=64, d_model=d_model, n_layers=2, n_heads=2,
                                   n_kv_heads=1, d_ff=32), moe=MoEConfig(n_experts=4, top_k=2))
    params = trainable(Transformer.init(cfg.model, cfg.moe, jax.random.key(1)))
    grads = jax.tree.map(lambda p: jnp.full_like(p, grad), params)
    opt = make_optimizer(optim, 10, None, d_model)
    updates, _ = opt.update(grads, opt.init(params), params)
    return params, updates


def _leaves(tree):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_weight_decay_skips_the_stacked_norm_scales():
    # Stacked layers make a norm scale [L, D], a matrix by rank; it must still not decay.
    # A zero gradient leaves only the decoupled decay: update = -lr * wd * p exactly.
    params, updates = _one_update(OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5),
                                  grad=0.0)
    p, u = _leaves(params), _leaves(updates)
    norms = [k for k in p if "norm" in k]
    assert any(p[k].ndim == 2 for k in norms)  # the stacked ones are there
    for k in p:
        expected = 0.0 if "norm" in k else -0.1 * 0.5 * p[k]
        np.testing.assert_allclose(u[k], expected, rtol=1e-6, atol=1e-12, err_msg=k)


def test_width_transfer_scales_every_matrix_but_the_embedding():
    # lr_base_width 16 at d_model 64: the matrices' updates are exactly 1/4 of the plain
    # optimizer's (a power-of-two scale is exact in float32); embedding and norms unchanged.
    plain_optim = OptimConfig(lr=1e-2, warmup_steps=0)
    params, plain = _one_update(plain_optim, d_model=64)
    _, scaled = _one_update(dataclasses.replace(plain_optim, lr_base_width=16), d_model=64)
    p, a, b = _leaves(params), _leaves(plain), _leaves(scaled)
    scaled_keys = {k for k in p if "norm" not in k and k != ".embed"}
    assert {".lm_head", ".moe_layers.attn.wq", ".moe_layers.ffn.router"} <= scaled_keys
    for k in p:
        factor = 0.25 if k in scaled_keys else 1.0
        np.testing.assert_array_equal(b[k], factor * a[k], err_msg=k)
        assert np.abs(a[k]).max() > 0, k


def test_width_power_sets_the_width_rules_exponent():
    # lr_width_power 0.5 at lr_base_width 16, d_model 64: (16/64)**0.5 = 1/2 (exact), so
    # the matrices move half as far as the plain optimizer's, the embedding as far
    plain_optim = OptimConfig(lr=1e-2, warmup_steps=0)
    params, plain = _one_update(plain_optim, d_model=64)
    _, scaled = _one_update(dataclasses.replace(plain_optim, lr_base_width=16,
                                                lr_width_power=0.5), d_model=64)
    a, b = _leaves(plain), _leaves(scaled)
    np.testing.assert_array_equal(b[".moe_layers.attn.wq"], 0.5 * a[".moe_layers.attn.wq"])
    np.testing.assert_array_equal(b[".embed"], a[".embed"])
    assert set(_leaves(params)) == set(a)


def test_bf16_compute_runs_and_keeps_float32_params():
    cfg = config_from_dict({"model": {"vocab_size": 64, "d_model": 32, "n_layers": 1,
                                      "n_heads": 2, "n_kv_heads": 1, "d_ff": 32},
                            "moe": {"n_experts": 4, "top_k": 2},
                            "train": {"dtype": "bfloat16"}})
    model = Transformer.init(cfg.model, cfg.moe, jax.random.key(1))
    opt = make_optimizer(cfg.optim, 10, None)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    new, _, parts = make_train_step(cfg, opt)(model, opt.init(trainable(model)), tokens)
    assert np.isfinite(float(parts["loss"])) and new.embed.dtype == jnp.float32


def test_flops_count_only_active_experts():
    cfg = config_from_dict({"model": {"vocab_size": 100, "d_model": 8, "n_layers": 1,
                                      "n_heads": 2, "n_kv_heads": 1, "d_ff": 4},
                            "moe": {"n_experts": 4, "top_k": 1}, "data": {"seq_len": 10}})
    attn = 8 * 4 * (2 * 2 + 2 * 1)  # q, o: 2 heads; k, v: 1 head; head_dim 4
    routed = 1 * 3 * 8 * 4 + 8 * 4  # one expert's SwiGLU + the router
    assert active_params(cfg) == attn + routed + 8 * 100
    assert total_params(cfg) == active_params(cfg) + 3 * 3 * 8 * 4 + 100 * 8
    assert flops_per_token(cfg) == 6 * active_params(cfg) + 12 * 1 * 2 * 4 * 10


# Run in a fresh interpreter: the trainer applies the setting process-wide, so this
# process may already have it.
FAULTS_SCRIPT = """
import resource, sys
import numpy as np
from moelab.train.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.ones(64 << 18, np.float32)  # 64 MiB, every page written
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


@pytest.mark.skipif(not platform.libc_ver()[0] == "glibc", reason="mallopt is glibc's")
def test_a_training_process_reuses_freed_pages_instead_of_faulting_them_in_again():
    run = lambda mode: json.loads(subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT, mode], capture_output=True, text=True,
        check=True).stdout)
    kept = run("keep")
    # 64 MiB is 16,384 pages of 4 KiB: once the first block's pages are in the heap, the
    # later ones reuse them; allow 1% for the interpreter's own small allocations
    assert kept[0] > 0 and max(kept[1:]) < 164, kept
    assert min(run("default")[1:]) > 0  # without it each block is mapped and faulted anew
