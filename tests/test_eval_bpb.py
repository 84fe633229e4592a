"""Bits per byte against a hand computation: bytes of the decoded text, nats to bits."""

import json
import math

import jax
import numpy as np
import pytest
from conftest import tiny_config

from moelab.config import config_from_dict
from moelab.data.tokenizer import load_tokenizer, train_tokenizer
from moelab.eval.bpb import val_windows, whole_split_evaluator
from moelab.model import Transformer
from moelab.train.bpb import bits_per_byte, token_bytes


def test_token_bytes_add_up_to_the_utf8_bytes_of_the_text():
    texts = ["def f(x):\n    return x  # café\n", "Grüße, 日本語 text ✓ and more."] * 30
    tokenizer = train_tokenizer(texts, vocab_size=300)
    table = token_bytes(tokenizer)
    text = "Grüße ✓ 日本 def café(x): return x\n"
    ids = tokenizer.encode(text).ids
    assert table[ids].sum() == len(text.encode("utf-8"))
    # a cut inside a multi-byte character still counts each byte once across the cut
    assert sum(table[ids[:k]].sum() + table[ids[k:]].sum() for k in range(len(ids))) == \
        len(ids) * len(text.encode("utf-8"))
    assert table[tokenizer.token_to_id("<|endoftext|>")] == 0  # EOS decodes to no text


def test_bits_per_byte_is_nats_over_ln2_over_bytes():
    assert bits_per_byte(math.log(2) * 10, 5) == pytest.approx(2.0)
    assert math.isnan(bits_per_byte(1.0, 0))


def _hand_bpb(model, rows: np.ndarray, tokenizer) -> tuple[float, float]:
    """(mean NLL per token, bpb) in float64 numpy, the text's bytes from decode()."""
    logits = np.asarray(model(rows[:, :-1])[0], np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, rows[:, 1:, None], -1)[..., 0]
    # the scored tokens tile the val stream: decode them in one go (EOS decodes to nothing)
    text = tokenizer.decode(rows[:, 1:].reshape(-1).tolist())
    return nll.mean(), nll.sum() / math.log(2) / len(text.encode("utf-8"))


def test_whole_split_bpb_matches_a_hand_computation(small_corpus):
    cfg = config_from_dict(tiny_config(small_corpus))
    model = Transformer.init(cfg.model, cfg.moe, jax.random.key(0))
    tokenizer = load_tokenizer(small_corpus)
    got = whole_split_evaluator(small_corpus, cfg.data.seq_len)(model)
    meta = json.loads((small_corpus / "meta.json").read_text())
    assert meta["held_out"]["split"] == "val" and meta["held_out"]["domains"] == meta["sources"]
    for source in meta["sources"]:
        loss, bpb = _hand_bpb(model, val_windows(small_corpus, source, cfg.data.seq_len),
                              tokenizer)
        # f32 forward vs f64 reference over a few thousand tokens: ~1e-6 relative
        assert got[f"val_loss/{source}"] == pytest.approx(loss, rel=1e-5)
        assert got[f"val_bpb/{source}"] == pytest.approx(bpb, rel=1e-5)
    assert got["val_bpb_macro"] == pytest.approx(
        np.mean([got[f"val_bpb/{s}"] for s in meta["sources"]]))


def test_trainer_logs_bpb_of_its_sampled_batches(tmp_path, small_corpus):
    from moelab.train.trainer import Trainer

    cfg = config_from_dict(tiny_config(small_corpus, train={"eval_batches": 2}))
    trainer = Trainer(cfg, tmp_path / "run")
    got = trainer.evaluate()
    tokenizer = load_tokenizer(small_corpus)
    for source, loader in trainer.val.items():
        rows = np.concatenate([loader.batch(i) for i in range(2)])
        # sampled windows overlap and cut text anywhere: count bytes per token, not decode
        loss, _ = _hand_bpb(trainer.model, rows, tokenizer)
        n_bytes = token_bytes(tokenizer)[rows[:, 1:]].sum()
        assert got[f"val_loss/{source}"] == pytest.approx(loss, rel=1e-5)
        assert got[f"val_bpb/{source}"] == pytest.approx(
            loss * rows[:, 1:].size / math.log(2) / n_bytes, rel=1e-5)
    assert "val_bpb_macro" in got


def test_ladder_fits_bpb_macro_when_asked(tmp_path, small_corpus):
    from moelab.config import ConfigError
    from moelab.errors import UserError
    from moelab.ladder.results import result
    from moelab.ladder.spec import Rung, _fit_options
    from moelab.train.metrics import JsonlLog

    rung = Rung("r", config_from_dict(tiny_config(small_corpus)))
    log = JsonlLog(tmp_path / "r" / "metrics.jsonl")
    for step, scale in ((6, 2.0), (12, 1.0)):
        log.write({"step": step, "val_loss/code": 3.0 * scale, "val_loss/prose": 4.0 * scale,
                   "val_bpb/code": 1.0 * scale, "val_bpb/prose": 2.0 * scale,
                   "val_bpb_macro": 1.5 * scale})
    bpb = result(rung, tmp_path / "r", "bpb_macro")
    assert bpb.final_val_loss == 1.5 and bpb.val_loss == {"code": 1.0, "prose": 2.0}
    assert [p["loss"] for p in bpb.curve] == [3.0, 1.5]
    loss = result(rung, tmp_path / "r")  # the default: CE weighted by the mixture
    assert 3.0 < loss.final_val_loss < 4.0
    with pytest.raises(ConfigError, match="fit.metric"):
        _fit_options({"metric": "accuracy"})
    log.write({"step": 18, "val_loss/code": 1.0, "val_loss/prose": 1.0})  # logged no bpb
    with pytest.raises(UserError, match="no val_bpb_macro"):
        result(rung, tmp_path / "r", "bpb_macro")
