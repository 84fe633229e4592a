"""Multi-token prediction (mtp.depth, mtp.loss_weight): the stacked modules compute
DeepSeek-V3's equations, depth 0 is today's objective, and the FLOP count pays for them."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ConfigError, config_from_dict
from moelab.model import Transformer, init_model, objective
from moelab.model.transformer import layer_at
from moelab.train.metrics import active_params, flops_per_token
from moelab.train.step import make_eval_step, make_loss

# dense layers: MTP reads only the last hidden state, and a dense model compiles faster
RAW = {"model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
                 "n_kv_heads": 2, "d_ff": 32, "n_dense_layers": 2},
       "moe": {"n_experts": 4, "top_k": 2, "dispatch": "dropless"},
       "data": {"seq_len": 16, "batch_size": 2}}


def config(**mtp):
    return config_from_dict({**RAW, "mtp": mtp})


def rms(x, weight, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * weight


def paper_mtp(model: Transformer, tokens) -> list:
    """CE_k of DeepSeek-V3's eqs. 21-25 for k = 1..D, written as a loop over depths with
    sequences that shrink by one token per depth (tokens [B, S+1]: t_0 .. t_S)."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    h = model.hidden(x)[0]  # h^0: the main model's last layer output
    head = model.embed.T if model.lm_head is None else model.lm_head
    eps, s = model.cfg.norm_eps, x.shape[1]
    losses = []
    for k in range(1, model.mtp.depth + 1):
        m = layer_at(model.mtp, k - 1)
        n = s - k  # positions i = 0 .. S-k-1 have the target t_{i+k+1}
        combined = jnp.concatenate([rms(h[:, :n], m.hidden_norm.weight, eps),
                                    rms(model.embed[x[:, k:]], m.embed_norm.weight, eps)], -1)
        cos, sin = model.angles((x.shape[0], n), 0, h.dtype)
        h = m.block(combined @ m.proj, cos, sin)[0]  # h^k = TRM_k(M_k [..; ..])
        logits = rms(h, m.out_norm.weight, eps) @ head
        logp = jax.nn.log_softmax(logits, -1)
        losses.append(-jnp.mean(jnp.take_along_axis(logp, y[:, k:, None], -1)))
    return losses


def today(cfg):
    """The objective as the train step computed it before MTP: the model's logits only."""
    def loss(model, batch):
        logits, stats, _ = model(batch[:, :-1])
        return objective(logits, batch[:, 1:], stats, cfg.loss)[0]
    return loss


def test_stacked_modules_equal_the_papers_loop_and_are_added_with_their_weight():
    cfg = config(depth=2, loss_weight=0.3)
    model = init_model(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
    (loss, parts), grads = jax.jit(jax.value_and_grad(make_loss(cfg), has_aux=True))(
        model, tokens)
    main, ref = jax.jit(lambda m, t: (today(cfg)(m, t), paper_mtp(m, t)))(model, tokens)
    # float32 sums over <= 64 terms in another order (full length vs shrinking slices,
    # concatenation vs one matmul): agreement to a few ulps of values ~4 (ln 64); 1e-5 rel.
    np.testing.assert_allclose([parts["mtp_loss_1"], parts["mtp_loss_2"]], ref, rtol=1e-5)
    np.testing.assert_allclose(loss, main + 0.3 * (ref[0] + ref[1]) / 2, rtol=1e-5)
    # the modules train (their gradient is not zero)
    assert float(jnp.abs(grads.mtp.proj).max()) > 0
    assert float(jnp.abs(grads.mtp.block.attn.wq).max()) > 0


def test_depth_zero_is_exactly_todays_loss_and_adds_nothing():
    cfg = config()
    model = init_model(cfg, jax.random.key(0))
    assert model.mtp is None
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
    loss, parts = jax.jit(make_loss(cfg))(model, tokens)
    assert float(loss) == float(jax.jit(today(cfg))(model, tokens))
    assert not any(k.startswith("mtp_loss") for k in parts)
    # the model's own weights do not depend on the depth (MTP has its own key)
    with_mtp = init_model(config(depth=1), jax.random.key(0))
    without = dataclasses.replace(with_mtp, mtp=None)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)
    # and evaluation runs the model without its MTP modules: the same cross-entropy
    assert float(make_eval_step(config(depth=1))(with_mtp, tokens)) == float(parts["ce"])


def test_flop_count_grows_by_each_modules_flops():
    base, cfg = config(), config(depth=2)
    model = init_model(cfg, jax.random.key(0))
    m = cfg.model
    # per module: every matmul weight in it (norm scales are 1-D) plus the shared head,
    # 6 FLOPs each per token, and one layer of attention's 12 * heads * head_dim * S
    module = sum(a.size for a in jax.tree.leaves(model.mtp) if a.ndim == 3) // 2
    module += m.d_model * m.vocab_size
    attention = 12 * m.n_heads * m.resolved_head_dim * cfg.data.seq_len
    assert flops_per_token(cfg) - flops_per_token(base) == 2 * (6 * module + attention)
    assert active_params(cfg) == active_params(base)  # the served model's N is unchanged


def test_bad_mtp_values_are_refused_by_name():
    with pytest.raises(ConfigError, match="mtp.depth"):
        config(depth=-1)
    with pytest.raises(ConfigError, match="mtp.depth"):
        config(depth=16)  # seq_len 16: no position has a target 17 tokens ahead
    with pytest.raises(ConfigError, match="mtp.loss_weight"):
        config(depth=1, loss_weight=-0.1)
    with pytest.raises(ConfigError, match="mtp.*deep"):
        config_from_dict({**RAW, "mtp": {"deep": 1}})


def test_a_run_logs_each_depth_and_its_checkpoint_restores_the_modules(tmp_path, small_corpus):
    """A trained MTP run: metrics.jsonl has mtp_loss_1, the checkpoint restores with its
    modules (the restore template is built with them) and the model generates."""
    from conftest import tiny_config

    from moelab.export.generate import generate
    from moelab.train.checkpoint import load_latest
    from moelab.train.trainer import train

    raw = tiny_config(small_corpus, mtp={"depth": 1},
                      train={"steps": 2, "log_every": 1, "eval_every": 2, "checkpoint_every": 2})
    train(config_from_dict(raw), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["mtp_loss_1"]) for r in rows if "loss" in r)
    model, cfg, step = load_latest(tmp_path / "run")
    assert step == 2 and cfg.mtp.depth == 1 and model.mtp.proj.shape == (1, 64, 32)
    assert len(generate(model, [1, 2, 3], max_new_tokens=4)) == 4
