"""The 2025-26 recipe options against their references: Muon (Newton-Schulz per matrix,
Moonlight's RMS matching), DeepSeek-V3 group-limited routing, balance health, upcycling."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from moelab.config import ConfigError, ModelConfig, MoEConfig, OptimConfig, config_from_dict
from moelab.model import Transformer
from moelab.model.router import route
from moelab.train.optimizer import make_optimizer, trainable

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=16,
                    n_dense_layers=1)


# ----------------------------------------------------------------------------------- Muon


def newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Keller Jordan's quintic Newton-Schulz iteration (the Muon reference), float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (np.linalg.norm(g) + 1e-8)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def first_update(optim: OptimConfig, seed: int = 0):
    """(params, grads, the optimizer's first update) of a tiny model with random grads."""
    model = Transformer.init(MODEL, MoEConfig(n_experts=4, top_k=2), jax.random.key(seed))
    params = trainable(model)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    grads = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape) for k, x in
                                      zip(keys, leaves, strict=True)])
    opt = make_optimizer(optim, 10, None, MODEL.d_model)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)  # eager: 6x slower
    return params, grads, updates


def test_muon_orthogonalises_each_expert_matrix_and_leaves_the_rest_to_adamw():
    lr, wd = 0.01, 0.5
    kw = dict(lr=lr, schedule="constant", warmup_steps=0, clip_norm=1e9)
    params, grads, updates = first_update(OptimConfig(name="muon", weight_decay=0.0, **kw))
    g = np.asarray(grads.moe_layers.ffn.experts.w_down, np.float64)  # [L=1, E=4, F=16, D=32]
    u = np.asarray(updates.moe_layers.ffn.experts.w_down)
    scale = 0.2 * np.sqrt(max(g.shape[-2:]))  # Moonlight's RMS matching
    for e in range(g.shape[1]):
        want = -lr * scale * newton_schulz(g[0, e])
        # float32 NS vs float64: ~1e-6 relative per entry, entries ~lr*0.2 = 2e-3
        np.testing.assert_allclose(u[0, e], want, atol=2e-6)
    # not the flattened stack: that would orthogonalise one [E*F, D] matrix
    stacked = -lr * scale * newton_schulz(g[0].reshape(-1, g.shape[-1])).reshape(g[0].shape)
    assert np.max(np.abs(stacked - u[0])) > 10 * 2e-6
    # the update's RMS is 0.2 lr (NS's singular values sit in ~[0.7, 1.2], not exactly 1)
    rms = np.sqrt(np.mean(u[0, 0] ** 2)) / lr
    assert 0.12 < rms < 0.25, rms
    # attention is Muon's too
    wq = np.asarray(grads.moe_layers.attn.wq, np.float64)[0]
    np.testing.assert_allclose(np.asarray(updates.moe_layers.attn.wq)[0],
                               -lr * 0.2 * np.sqrt(max(wq.shape)) * newton_schulz(wq), atol=2e-6)
    # AdamW's decoupled decay is Muon's too: lr * wd * param
    _, _, decayed = first_update(OptimConfig(name="muon", weight_decay=wd, **kw))
    np.testing.assert_allclose(
        np.asarray(decayed.moe_layers.ffn.experts.w_up - updates.moe_layers.ffn.experts.w_up),
        -lr * wd * np.asarray(params.moe_layers.ffn.experts.w_up), atol=1e-8)
    # embedding, head, router and norm scales get exactly AdamW's update
    _, _, adamw = first_update(OptimConfig(weight_decay=wd, **kw))
    for pick in (lambda t: t.embed, lambda t: t.lm_head, lambda t: t.moe_layers.ffn.router,
                 lambda t: t.final_norm.weight, lambda t: t.moe_layers.attn.q_norm.weight):
        np.testing.assert_array_equal(np.asarray(pick(decayed)), np.asarray(pick(adamw)))


@pytest.mark.parametrize("field,value,message", [
    ("optim.name", "sgd", "is not one of"),
    ("optim.muon_momentum", 1.0, "must be in [0, 1)"),
    ("optim.muon_ns_steps", 0, "must be > 0"),
    ("optim.lr_base_width", 64, "muP's Adam rule"),
    ("moe.n_group", 3, "must divide moe.n_experts=8"),
    ("moe.n_group", 8, "at least 2"),
    ("moe.topk_group", 5, "exceeds moe.n_group=4"),
    ("moe.top_k", 5, "raise moe.topk_group"),
    ("train.dead_expert_window", 0, "must be > 0"),
])
def test_bad_recipe_values_are_one_line_errors(field, value, message):
    raw = {"moe": {"n_experts": 8, "top_k": 2, "n_group": 4, "topk_group": 2},
           "optim": {"name": "muon"}}
    section, name = field.split(".")
    raw.setdefault(section, {})[name] = value
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert field in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------- DeepSeek-V3 routing


def deepseek_v3_route(logits, bias, n_group, topk_group, k, scale):
    """DeepSeek-V3 (arXiv 2412.19437, eqs. 12-16 and section 2.1.2), one token at a time:
    s = sigmoid(u); groups ranked by the sum of their top-2 of s + b; top-k of s + b among
    the topk_group best groups' experts; gates s_i / sum of the chosen s, times scale."""
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    experts, weights = [], []
    for row in s.reshape(-1, s.shape[-1]):
        choice = (row + bias).reshape(n_group, -1)
        group_score = np.sort(choice, -1)[:, -2:].sum(-1)
        kept = np.argsort(-group_score)[:topk_group]
        masked = np.full_like(choice, -np.inf)
        masked[kept] = choice[kept]
        chosen = np.argsort(-masked.reshape(-1))[:k]
        experts.append(chosen)
        weights.append(row[chosen] / row[chosen].sum() * scale)
    shape = (*logits.shape[:-1], k)
    return np.reshape(experts, shape), np.reshape(weights, shape)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 1), (4, 2), (2, 1)])
def test_group_limited_routing_matches_deepseek_v3(n_group, topk_group):
    moe = MoEConfig(n_experts=16, top_k=4, router="sigmoid", balance="bias_sign",
                    routed_scaling=2.5, n_group=n_group, topk_group=topk_group)
    logits = jax.random.normal(jax.random.key(0), (2, 64, 16)) * 2
    bias = jax.random.normal(jax.random.key(1), (16,)) * 0.3
    routing, _ = route(logits, moe, bias)
    experts, weights = deepseek_v3_route(np.asarray(logits), np.asarray(bias, np.float64),
                                         n_group, topk_group, moe.top_k, 2.5)
    ours = np.sort(np.asarray(routing.experts), -1)
    np.testing.assert_array_equal(ours, np.sort(experts, -1))
    order = lambda e, w: np.take_along_axis(w, np.argsort(e, -1), -1)
    np.testing.assert_allclose(order(np.asarray(routing.experts), np.asarray(routing.weights)),
                               order(experts, weights), rtol=1e-5)  # float32 sigmoid
    if n_group > 1:  # the groups bind: some token's plain top-k leaves its top groups
        plain, _ = route(logits, dataclasses.replace(moe, n_group=1, topk_group=1), bias)
        assert np.any(np.sort(np.asarray(plain.experts), -1) != ours)
        group = np.asarray(routing.experts) // (16 // n_group)
        assert all(len(set(g)) <= topk_group for g in group.reshape(-1, moe.top_k))


# ----------------------------------------------------------------------- balance health


def test_dead_experts_are_counted_and_announced_once_across_a_muon_resume(tmp_path,
                                                                          small_corpus):
    """Experts 2 and 3 of every MoE layer are shut out by a fixed selection bias of -10
    (scores lie in [0, 1]; bias_rate 0 keeps it): with a window of 3 steps both die at
    step 3, one event each. The run uses Muon and resumes from step 4 after losing its
    last checkpoint: the losses are bitwise those of the first pass (the Muon state is in
    the checkpoint) and no death is announced twice (the idle counters are too). The same
    run without the bias (balanced by the aux loss) reports no dead expert."""
    import shutil

    import equinox as eqx
    import jax.numpy as jnp
    from conftest import events, losses, tiny_config

    from moelab.train.trainer import Trainer

    raw = tiny_config(small_corpus, moe={"balance": "bias_sign", "bias_rate": 0.0},
                      optim={"name": "muon"},
                      train={"steps": 8, "dead_expert_window": 3, "eval_every": 8,
                             "checkpoint_every": 4, "keep_checkpoints": 2})
    cfg = config_from_dict(raw)
    run = tmp_path / "forced"
    trainer = Trainer(cfg, run)
    bias = jnp.zeros_like(trainer.model.moe_layers.ffn.bias).at[:, 2:].set(-10.0)
    trainer.model = eqx.tree_at(lambda m: m.moe_layers.ffn.bias, trainer.model, bias)
    trainer.run()
    first = losses(run)
    dead = [(e["step"], e["message"][:18]) for e in events(run) if e["kind"] == "expert_dead"]
    assert dead == [(3, "layer 0 expert 2 r"), (3, "layer 0 expert 3 r"),
                    (3, "layer 1 expert 2 r"), (3, "layer 1 expert 3 r")]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["dead_experts/layer_0"] for r in rows] == [0, 0, 2, 2, 2, 2, 2, 2]
    shutil.rmtree(run / "checkpoints" / "8")
    Trainer(cfg, run).run()
    assert losses(run) == first
    assert [e["step"] for e in events(run) if e["kind"] == "expert_dead"] == [3] * 4

    balanced = tmp_path / "balanced"  # the same config (its programs are compiled) unbiased
    Trainer(cfg, balanced).run()
    assert not [e for e in events(balanced) if e["kind"].startswith("expert_")]
    rows = [json.loads(line) for line in (balanced / "metrics.jsonl").read_text().splitlines()]
    assert all(r["dead_experts/layer_1"] == 0 for r in rows) and len(rows) == 8


def test_health_is_charted_on_the_report_and_site_with_deaths_marked(tmp_path):
    from moelab.lab.site import publish, write_report
    from moelab.lab.store import Store

    with Store(tmp_path / "lab.sqlite") as store:
        exp = store.new_experiment("health", "an expert dies", {}, None)
        run = store.start_run(exp, "runs/health", {})
        for step in range(1, 11):
            store.log_metrics(run, step, {"loss": 3.0, "dead_experts/layer_0": float(step >= 5),
                                          "dead_experts/layer_1": 0.0,
                                          "router_entropy/layer_0": 1.2})
        store.log_event(run, 5, "expert_dead", "layer 0 expert 3 received no token for 4 steps")
        names = {p.name for p in write_report(store, exp, tmp_path / "report")}
        publish(store, tmp_path / "site")
    assert {"dead_experts.png", "router_entropy.png"} <= names
    for page in (tmp_path / "report/report.html", tmp_path / f"site/experiments/{exp}.html"):
        text = page.read_text()
        assert 'data-chart="dead_experts"' in text and "dead_experts/layer_1" in text
        assert "expert_dead" in text  # the event, drawn on the charts


# ---------------------------------------------------------------------------- upcycling


DENSE = dataclasses.replace(MODEL, n_dense_layers=MODEL.n_layers, d_ff_dense=48)


def test_upcycled_model_without_noise_computes_the_dense_model():
    """Every expert is the dense FFN and the k routed weights sum to 1, so the MoE's
    output is the dense FFN's whatever the routing (uniform, or the fresh router's)."""
    import equinox as eqx

    from moelab.model.upcycle import upcycle, upcycled_config

    dense = Transformer.init(DENSE, MoEConfig(), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, DENSE.vocab_size)
    logits = eqx.filter_jit(lambda model: model(tokens)[0])
    want = np.asarray(logits(dense))
    for uniform, noise in ((True, 0.0), (False, 0.0), (False, 0.01)):
        moe = MoEConfig(n_experts=4, top_k=2, uniform_routing=uniform)
        sparse = upcycle(dense, upcycled_config(DENSE, 48), moe, jax.random.key(1), noise)
        assert sparse.dense_layers is None
        assert sparse.moe_layers.ffn.experts.w_gate.shape == (2, 4, 32, 48)
        got = np.asarray(logits(sparse))
        if noise:  # the copies differ, and so does the output
            assert np.max(np.abs(got - want)) > 1e-5
        else:  # float32: w1 f + w2 f vs f with w1 + w2 = 1 up to rounding, logits ~0.1
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def test_upcycle_cli_writes_a_run_with_lineage_that_trains(tmp_path, small_corpus):
    from conftest import events, losses, tiny_config

    from moelab.cli import main
    from moelab.train.trainer import train

    dense_raw = tiny_config(small_corpus, model={"n_dense_layers": 2}, train={
        "steps": 4, "eval_every": 4, "checkpoint_every": 4})
    train(config_from_dict(dense_raw), tmp_path / "dense")
    out = tmp_path / "moe"
    assert main(["upcycle", str(tmp_path / "dense"), "--experts", "4", "--top-k", "2",
                 "--out", str(out), "--set", "train.steps=6"]) == 0
    lineage = json.loads((out / "lineage.json").read_text())
    assert (lineage["step"], lineage["upcycled"]["experts"]) == (4, 4)
    assert lineage["parent_run_dir"] == str((tmp_path / "dense").absolute())
    assert [e["kind"] for e in events(out)] == ["upcycle"]
    assert main(["train", "--config", str(out / "config.yaml"), "--run-dir", str(out)]) == 0
    curve = losses(out)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    # it starts where the dense model ended, not at ln(vocab) = 6.2 of a fresh model
    assert curve[1] < losses(tmp_path / "dense")[1] - 0.1
    # an MoE run is refused as a dense one, in one line
    assert main(["upcycle", str(out), "--experts", "8", "--top-k", "2",
                 "--out", str(tmp_path / "again")]) == 2
    # a --set that changes a shape the dense weights fix is refused before anything is
    # written (d_model raised a traceback; vocab_size wrote a checkpoint that never loads)
    for override in ("model.vocab_size=1024", "model.d_model=64", "model.n_dense_layers=1"):
        assert main(["upcycle", str(tmp_path / "dense"), "--experts", "4", "--top-k", "2",
                     "--out", str(tmp_path / "bad"), "--set", override]) == 2
    assert not (tmp_path / "bad").exists()
