"""`moelab eval longctx` and weights-only restores: the probes measure what they say."""

import json

import jax
import numpy as np
import pytest

from moelab.config import config_from_dict, config_to_dict, load_config
from moelab.errors import UserError
from moelab.eval import longctx
from moelab.eval.longctx import documents, loss_by_position, passkey_row
from moelab.model import Transformer


def test_passkey_row_puts_the_needle_at_its_depth_and_the_key_last():
    fill, needle, query = np.arange(100, 200), np.array([1, 2, 3]), np.array([7, 8, 5, 6])
    for depth in (0.1, 0.5, 0.9):
        row = passkey_row(fill, needle, query, depth)
        at = int(np.flatnonzero(row == 1)[0])
        assert at == round(depth * 100) and list(row[at:at + 3]) == [1, 2, 3]
        assert list(row[-4:]) == [7, 8, 5, 6] and len(row) == 107
        assert sorted(row[row >= 100]) == list(fill)  # all filler, in order, kept


def test_passkey_pairs_differ_only_in_the_inserted_key(small_corpus, monkeypatch):
    """A trial's two rows share filler, depth and query (ending with the real key) and
    differ only in the key inside the needle; the gain is the mean paired difference of the
    real key's log-prob and gain_se its sd / sqrt(trials). The model is replaced by random
    per-token losses, so the arithmetic is checked against the rows actually scored."""
    from moelab.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(small_corpus)
    filler = np.arange(1000, 4000) % 500 + 10
    scored = {}

    def fake_score(model, rows):
        scored["rows"] = rows
        scored["losses"] = np.random.default_rng(0).uniform(0, 5, rows[:, 1:].shape)
        return scored["losses"], np.zeros(rows[:, 1:].shape, bool)

    monkeypatch.setattr(longctx, "_score", fake_score)
    (result,) = longctx.passkey(None, tokenizer, filler, 200, depths=(0.5,), trials=6)
    rows, losses = scored["rows"], scored["losses"]
    prefix = tokenizer.encode(" What is the pass key? The pass key is").ids
    assert rows.shape == (12, 201)
    gains = []
    for real, control, loss_r, loss_c in zip(rows[::2], rows[1::2], losses[::2], losses[1::2],
                                              strict=True):
        differ = np.flatnonzero(real != control)
        assert len(differ) and differ.max() < 200 - 10  # only inside the needle, not the query
        assert (real[:differ.min()] == control[:differ.min()]).all()  # same filler before it
        n_key = len(real) - len(prefix) - int(np.flatnonzero(  # the tokens after the query
            [list(real[i:i + len(prefix)]) == prefix for i in range(len(real))])[-1])
        gains.append(loss_c[-n_key:].sum() - loss_r[-n_key:].sum())
    assert result["gains"] == pytest.approx(gains)
    assert result["retrieval_gain"] == pytest.approx(np.mean(gains))
    assert result["gain_se"] == pytest.approx(np.std(gains, ddof=1) / np.sqrt(6))
    assert longctx.pooled_gain([result, result])[0] == pytest.approx(np.mean(gains))


def test_documents_split_a_packed_stream_at_eos():
    stream = np.array([5, 6, 0, 7, 0, 8, 9, 9, 0])
    assert [list(d) for d in documents(stream, eos=0)] == [[5, 6], [7], [8, 9, 9]]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_corpus):
    """A tiny run trained for 8 steps at seq_len 32 (its original context)."""
    import yaml
    from conftest import tiny_config

    from moelab.train.trainer import train

    root = tmp_path_factory.mktemp("longctx")
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(
        small_corpus, train={"steps": 8, "checkpoint_every": 8, "eval_every": 8})))
    cfg = load_config(path)
    train(cfg, root / "run")
    return root / "run", cfg


def test_eval_longctx_cli_writes_every_probe(trained_run, capsys):
    from moelab.cli import main

    run_dir, cfg = trained_run
    # --original 64: the key sentence and query take ~40 of a 512-token vocabulary's tokens
    code = main(["eval", "longctx", str(run_dir), "--original", "64", "--max-multiple", "2",
                 "--trials", "2"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((run_dir / "longctx.json").read_text())
    assert result["original_length"] == 64 and result["step"] == 8
    by_pos = result["loss_by_position"]
    assert by_pos["length"] == 128 and by_pos["documents"] > 0
    assert [(b["start"], b["end"]) for b in by_pos["buckets"]] == [(0, 128)]
    assert set(result["passkey"]) == {"1x", "2x"}
    for rows in result["passkey"].values():
        assert [r["depth"] for r in rows] == [0.1, 0.3, 0.5, 0.7, 0.9]
        for r in rows:
            assert r["key_logprob"] < 0 and 0 <= r["exact"] <= 1
            # mean of differences vs difference of means of float32 log-probs ~ -30:
            # equal up to their rounding (~30 * 1.2e-7 per sum)
            assert r["retrieval_gain"] == pytest.approx(
                r["key_logprob"] - r["control_logprob"], abs=1e-4)
            assert len(r["gains"]) == 2 and r["gain_se"] >= 0
    assert set(result["short_context_loss"]) == {"code", "prose", "mean"}
    counts = result["documents_by_length"]
    assert all(counts[s][">=128"] >= counts[s][">=256"] for s in counts)


@pytest.mark.parametrize("original", [str(10**30), "5000"])
def test_eval_longctx_refuses_probes_longer_than_its_text(trained_run, capsys, original):
    """A context longer than the held-out text is a one-line refusal before any scoring
    (it was a numpy traceback)."""
    from moelab.cli import main

    code = main(["eval", "longctx", str(trained_run[0]), "--original", original, "--out",
                 str(trained_run[0].parent / "refused.json")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (trained_run[0].parent / "refused.json").exists()


def test_loss_by_position_averages_each_bucket_of_the_documents(trained_run):
    """Buckets of 16 over 48 positions: each equals the mean CE of those positions,
    computed here from a plain forward."""
    from moelab.train.checkpoint import load_latest

    model, _, _ = load_latest(trained_run[0])
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 512, n) for n in (49, 60, 30)]  # the 30-token one is too short
    out = loss_by_position(model, docs, 48, bucket=16)
    assert out["documents"] == 2
    rows = np.stack([d[:49] for d in docs[:2]])
    logits = np.asarray(model(rows[:, :-1])[0], np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = lse - np.take_along_axis(logits, rows[:, 1:, None], -1)[..., 0]
    for b, start in zip(out["buckets"], (0, 16, 32), strict=True):
        # float32 logsumexp over 512 logits vs float64: ~1e-6 relative
        assert b["loss"] == pytest.approx(ce[:, start:start + 16].mean(), rel=1e-5)


def test_restore_weights_seeds_a_longer_context_config_and_refuses_other_shapes(trained_run):
    from moelab.train.checkpoint import load_latest, restore_weights

    run_dir, cfg = trained_run
    raw = config_to_dict(cfg)
    raw["data"].update(seq_len=128, batch_size=2)
    raw["model"].update(rope={"type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32}, attn_logit_scale=1.3)
    longer = config_from_dict(raw)
    fresh = Transformer.init(longer.model, longer.moe, jax.random.key(1))
    restored = restore_weights(run_dir, fresh, longer)
    saved, _, _ = load_latest(run_dir)
    assert restored.cfg == longer.model  # the new rope and scale, the old weights
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    raw["model"]["d_ff"] = 64
    wider = config_from_dict(raw)
    with pytest.raises(UserError, match="model.d_ff"):
        restore_weights(run_dir, Transformer.init(wider.model, wider.moe, jax.random.key(1)),
                        wider)
    with pytest.raises(UserError, match="no checkpoint 3"):
        restore_weights(run_dir, fresh, longer, step=3)
