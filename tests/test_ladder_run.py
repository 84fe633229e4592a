"""`moelab ladder` end to end: a tiny 3-rung ladder and its target on the small corpus."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import tiny_config

from moelab import cli
from moelab.lab.store import Store
from moelab.ladder import prereg
from moelab.train import trainer


def ladder_spec(data_path) -> dict:
    """Rungs that grow in width and tokens together; the target has 8.6x the top rung's
    compute. One layer each and the target as wide as r3 (its init is then compiled
    already), since compiling is most of a tiny run's time."""
    base = tiny_config(data_path, model={"n_layers": 1}, optim={"lr": 1e-2, "warmup_steps": 5},
                       train={"log_every": 1000, "eval_every": 1000, "eval_batches": 4,
                              "checkpoint_every": 1000})
    rung = lambda name, d, steps: {"name": name, "model": {"d_model": d, "d_ff": d},
                                   "train": {"steps": steps}}
    return {"base": base,
            "rungs": [rung("r1", 16, 30), rung("r2", 24, 45), rung("r3", 32, 70)],
            "target": rung("big", 32, 600),
            "fit": {"bootstrap": 50}}


@pytest.fixture
def moelab(monkeypatch, capsys, tmp_path):
    """Run `moelab ladder ARGS...` in tmp_path; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(cli, "PARTS", ["moelab.ladder.cli"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "lab.sqlite"))

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["ladder", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_tiny_ladder_end_to_end(moelab, tmp_path, small_corpus, monkeypatch):
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(ladder_spec(small_corpus)))
    out = tmp_path / "runs" / "ladder" / "tiny"
    registration = out / prereg.PREREG_FILE
    with Store(tmp_path / "lab.sqlite") as store:
        exp = store.new_experiment("ladder", "the fit predicts big within 5%", {}, None)

    trained, train = [], trainer.train

    def spy(cfg, run_dir, experiment=None):  # what trains, and was it pre-registered by then
        trained.append((run_dir.name, registration.exists()))
        return train(cfg, run_dir, experiment)

    monkeypatch.setattr(trainer, "train", spy)

    code, text, err = moelab("plan", str(spec_path))
    assert code == 0, err
    assert "big" in text and "r3" in text

    code, text, err = moelab("run", str(spec_path), "--experiment", exp)
    assert code == 0, err
    assert trained == [("r1", False), ("r2", False), ("r3", False), ("big", True)]
    assert "pre-registered" in text and "relative error" in text

    record = prereg.read(registration)
    assert record["created_at"].endswith("Z") and record["code_version"].keys() == {
        "commit", "dirty"}
    assert [r["name"] for r in record["rungs"]] == ["r1", "r2", "r3"]
    assert record["target"]["config"]["train"]["steps"] == 600
    # written before the target's trainer started (its config.yaml is the first file it writes)
    assert registration.stat().st_mtime_ns <= (out / "big" / "config.yaml").stat().st_mtime_ns

    report = json.loads((out / "report.json").read_text())
    assert report["predicted"] == record["prediction"]["value"]
    last = [json.loads(x) for x in (out / "big" / "metrics.jsonl").read_text().splitlines()][-1]
    by_source = [v for k, v in last.items() if k.startswith("val_loss/")]
    assert len(by_source) == 2 and min(by_source) <= report["actual"] <= max(by_source)
    assert report["relative_error"] == pytest.approx(
        (report["predicted"] - report["actual"]) / report["actual"])
    assert "relative error" in (out / "report.md").read_text()
    assert (out / "fit.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0
    with Store(tmp_path / "lab.sqlite") as store:
        (prediction,) = store.predictions(exp)
    assert prediction.value == record["prediction"]["value"]
    assert prediction.details["sha256"] == record["sha256"]

    # a re-run trains nothing, rewrites no metrics and leaves the pre-registration alone
    before = {p: p.read_bytes() for p in [registration, *out.glob("*/metrics.jsonl")]}
    stamp = registration.stat().st_mtime_ns
    code, text, err = moelab("run", str(spec_path), "--experiment", exp)
    assert code == 0, err
    assert len(trained) == 4 and text.count("already trained") == 4
    assert {p: p.read_bytes() for p in before} == before
    assert registration.stat().st_mtime_ns == stamp
    with Store(tmp_path / "lab.sqlite") as store:
        assert len(store.predictions(exp)) == 1

    code, _, err = moelab("report", str(spec_path))
    assert code == 0, err

    # a changed target does not silently reuse the old prediction
    changed = ladder_spec(small_corpus)
    changed["target"]["train"]["steps"] = 700
    spec_path.write_text(yaml.safe_dump(changed))
    code, _, err = moelab("run", str(spec_path))
    assert code == 2 and "other configs than this spec's" in err and "big" in err


def test_bad_spec_exits_with_a_clear_message(moelab, tmp_path, small_corpus):
    spec = ladder_spec(small_corpus)
    spec["rungs"][2]["train"]["steps"] = 20  # less compute than r2
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    code, _, err = moelab("run", str(path))
    assert code == 2
    assert "rungs[2] (r3)" in err and "strictly rising compute" in err
