"""`moelab eval`: local held-out tasks through lm-evaluation-harness (deterministic, an
oracle scores 100%, a uniform model sits at chance), the CLI, its errors and the lab."""

import json

import numpy as np
import pytest
import yaml
from conftest import tiny_config, write_corpus

pytest.importorskip("lm_eval")

from moelab.cli import main  # noqa: E402
from moelab.data.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from moelab.eval.harness import gold_bpb, make_lm, run_tasks  # noqa: E402
from moelab.eval.tasks import CHOICES, write_tasks  # noqa: E402


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """Two domains of made-up-word documents, 40% held out: enough held-out documents for
    4-way items (the shared small corpus holds out ~3 per domain)."""
    from moelab.data.prepare import prepare

    root = tmp_path_factory.mktemp("taskdata")
    sources = {name: write_corpus(root / "raw", name, 20, 400, seed)
               for seed, name in enumerate(["code", "prose"])}
    prepare(root / "data", sources, vocab_size=400, val_fraction=0.4)
    return root / "data"


@pytest.fixture(scope="module")
def task_run(tmp_path_factory, task_data):
    """A run on task_data trained 2 steps: a real checkpoint to evaluate."""
    root = tmp_path_factory.mktemp("taskrun")
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(task_data, train={
        "steps": 2, "checkpoint_every": 2, "eval_every": 2, "log_every": 2})))
    assert main(["train", "--config", str(config), "--run-dir", str(root / "run")]) == 0
    return root / "run"


def _items(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tasks_are_deterministic_for_a_seed(task_data, tmp_path):
    tokenizer = load_tokenizer(task_data)
    names = ["cont_code", "cont_prose"]
    a = write_tasks(task_data, tokenizer, names, tmp_path / "a", 50, seed=0)
    b = write_tasks(task_data, tokenizer, names, tmp_path / "b", 50, seed=0)
    c = write_tasks(task_data, tokenizer, names, tmp_path / "c", 50, seed=1)
    for name in names:
        assert a[name].read_bytes() == b[name].read_bytes()
        assert a[name].read_bytes() != c[name].read_bytes()
        items = _items(a[name])
        assert len(items) == 50
        for item in items:
            assert len(item["choices"]) == CHOICES == len(set(item["choices"]))
        # the gold position is drawn, not fixed: every position occurs
        assert {item["gold"] for item in items} == set(range(CHOICES))


class _Oracle:
    """Knows each item's answer: log-likelihood 0 for the gold continuation, -100 else."""

    def __new__(cls, jsonls):
        from lm_eval.api.model import LM

        gold = {(it["context"], it["choices"][it["gold"]])
                for path in jsonls for it in _items(path)}

        class Oracle(LM):
            def loglikelihood(self, requests, disable_tqdm=False):
                return [(0.0 if r.args in gold else -100.0, True) for r in requests]

            def loglikelihood_rolling(self, requests, disable_tqdm=False):
                raise NotImplementedError

            def generate_until(self, requests, disable_tqdm=False):
                raise NotImplementedError

        return Oracle()


def test_oracle_scores_100_and_uniform_sits_at_chance(task_data, tmp_path):
    tokenizer = load_tokenizer(task_data)
    names = ["cont_code", "cont_prose"]
    written = write_tasks(task_data, tokenizer, names, tmp_path, 200, seed=0)
    oracle = run_tasks(_Oracle(written.values()), tmp_path, names)
    for name in names:
        assert oracle[name]["acc"] == oracle[name]["acc_norm"] == 1.0
        assert oracle[name]["n"] == 200
    # every token equally likely, through the real adapter (tokenizing, batching, slicing)
    vocab = tokenizer.get_vocab_size()
    uniform = make_lm(lambda t: np.zeros((*t.shape, vocab), np.float32), tokenizer, 32)
    scores = run_tasks(uniform, tmp_path, names)
    for name in names:
        for key in ("acc", "acc_norm"):
            # the draw is fixed by the seed; 2 standard errors is the 95% band around chance
            s, se = scores[name][key], scores[name][f"{key}_stderr"]
            assert 0 < se < 0.05 and abs(s - 1 / CHOICES) <= 2 * se, (name, key, s, se)
        # gold-answer bpb of the uniform model: log2(V) bits per gold token, over the bytes
        golds = [it["choices"][it["gold"]] for it in _items(written[name])]
        tokens = sum(len(tokenizer.encode(g).ids) for g in golds)
        assert gold_bpb(uniform, written[name]) == pytest.approx(
            tokens * np.log2(vocab) / sum(len(g.encode()) for g in golds), rel=1e-9)


def test_eval_cli_scores_a_run_and_logs_to_the_lab(task_run, tmp_path, monkeypatch, capsys):
    from moelab.lab.store import Store

    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "lab.sqlite"))
    with Store(tmp_path / "lab.sqlite") as store:
        exp = store.new_experiment("evals", "tasks run", {}, None)
    assert main(["eval", "tasks", str(task_run), "--items", "30", "--out",
                 str(tmp_path / "e"), "--experiment", exp]) == 0
    out = capsys.readouterr().out
    assert "cont_code" in out and "acc_norm" in out
    record = json.loads((tmp_path / "e" / "tasks-step2.json").read_text())
    for s in record["scores"].values():
        assert 0 <= s["acc"] <= 1 and 0 < s["acc_stderr"] < 0.2 and s["n"] == 30
        assert s["gold_bpb"] > 0
    assert main(["eval", "bpb", str(task_run), "--out", str(tmp_path / "e"),
                 "--experiment", exp]) == 0
    bpb = json.loads((tmp_path / "e" / "bpb-step2.json").read_text())["metrics"]
    assert bpb["val_bpb_macro"] > 0
    with Store(tmp_path / "lab.sqlite") as store:
        (run,) = store.runs(exp)
        latest = store.latest(run.id)
    assert latest["task_acc/cont_code"] == (2, record["scores"]["cont_code"]["acc"])
    assert latest["val_bpb_macro"] == (2, bpb["val_bpb_macro"])


def test_eval_bad_input_is_one_line(task_run, tmp_path, capsys):
    cases = [
        (["eval", "tasks", str(task_run), "--tasks", "cont_nope"], "unknown"),
        (["eval", "tasks", str(tmp_path)], "no checkpoint"),
        (["eval", "tasks", str(tmp_path / "missing")], "not a run directory"),
        (["eval", "bpb", str(task_run / "config.yaml")], "is a file, not a run directory"),
    ]
    other = train_tokenizer(["a completely different text " * 50], vocab_size=300)
    other.save(str(tmp_path / "other.json"))
    cases.append((["eval", "tasks", str(task_run), "--tokenizer", str(tmp_path / "other.json")],
                  "tokenizer mismatch"))
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


def test_an_unknown_experiment_is_refused_before_anything_is_scored(task_run, tmp_path,
                                                                    monkeypatch, capsys):
    """eval tasks / bpb --experiment nope: one line, and no result file written (the lab is
    checked before the minutes of scoring, not after)."""
    from moelab.lab.store import Store

    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "lab.sqlite"))
    Store(tmp_path / "lab.sqlite").close()
    for kind in ("tasks", "bpb"):
        assert main(["eval", kind, str(task_run), "--out", str(tmp_path / "e"),
                     "--experiment", "exp-nope"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "exp-nope" in err, err
    assert not (tmp_path / "e").exists()  # refused before --out was made


def test_ladder_downstream_states_whether_tasks_follow_the_loss(tmp_path, monkeypatch,
                                                                small_corpus):
    """The ladder's downstream table and its rank-correlation verdict (the per-run task
    scoring, exercised above through the CLI, is replaced by fixed numbers here)."""
    from types import SimpleNamespace

    from moelab.config import config_from_dict
    from moelab.ladder import downstream as ds
    from moelab.ladder.spec import FitOptions, LadderSpec, Rung

    cfg = config_from_dict(tiny_config(small_corpus))
    rungs = tuple(Rung(f"r{i}", cfg) for i in range(3))
    spec = LadderSpec("t", tmp_path, rungs, Rung("big", cfg), FitOptions())
    loss = {"r0": 4.0, "r1": 3.5, "r2": 3.2, "big": 3.0}
    gold = {"r0": 2.0, "r1": 1.8, "r2": 1.7, "big": 1.5}  # falls with the loss
    acc = {"r0": 0.30, "r1": 0.25, "r2": 0.28, "big": 0.26}  # noise around chance
    monkeypatch.setattr(ds, "is_finished", lambda rung, path: True)
    monkeypatch.setattr(ds, "result", lambda rung, path, metric: SimpleNamespace(
        final_val_loss=loss[rung.name]))
    monkeypatch.setattr(ds, "_score", lambda path, items, seed: {"cont_code": {
        "acc": acc[path.name], "acc_stderr": 0.03, "acc_norm": acc[path.name],
        "gold_bpb": gold[path.name]}})
    report = ds.write_downstream(spec, items=10)
    assert [r["run"] for r in report["runs"]] == ["r0", "r1", "r2", "big"]
    assert report["spearman_with_loss"]["gold_bpb"] == pytest.approx(1.0)
    assert report["follows_loss"] == {"gold_bpb": True, "acc": False}
    text = (tmp_path / "downstream.md").read_text()
    assert "| **big** (target) | 3.0000 | 0.260 +- 0.030 | 0.260 | 1.5000 |" in text
    assert "gold-answer bpb +1.00 (follows the loss)" in text
