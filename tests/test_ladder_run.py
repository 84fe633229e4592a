"""`moelab ladder` end to end: a tiny 3-rung ladder and its target on the small corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import tiny_config

from moelab import cli
from moelab.config import ConfigError
from moelab.eval.bpb import val_windows as windows
from moelab.lab.store import Store
from moelab.ladder import prereg
from moelab.ladder.evaluate import make_evaluator, row_losses_fn
from moelab.ladder.results import result
from moelab.ladder.runner import ensure_trained
from moelab.ladder.spec import spec_from_dict
from moelab.train import trainer
from moelab.train.checkpoint import load_latest
from moelab.train.step import make_eval_step


def ladder_spec(data_path) -> dict:
    """Three widths, seed replicates (r2 has one seed), a cooldown branch of r3 and an lr
    probe of r1; the target has 8.6x r3's compute. One layer each and the target as wide
    as r3 (its step is then compiled already): compiling is most of a tiny run's time."""
    base = tiny_config(data_path, model={"n_layers": 1}, optim={"lr": 1e-2, "warmup_steps": 5},
                       train={"log_every": 1000, "eval_batches": 1, "checkpoint_every": 1000})
    rung = lambda name, d, steps: {"name": name, "model": {"d_model": d, "d_ff": d},
                                   "train": {"steps": steps}}
    return {"base": base, "seeds": [0, 1], "evals": 4,
            "rungs": [rung("r1", 16, 40), {**rung("r2", 24, 40), "seeds": [0]},
                      {**rung("r3", 32, 60), "branches": [50]}],
            "target": rung("big", 32, 520),
            "lr_check": {"rungs": ["r1"], "factors": [2.0]},
            "fit": {"bootstrap": 20, "law": "compute"}}


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

    def spy(cfg, run_dir, experiment=None, **kw):  # what trains, pre-registered?
        trained.append((run_dir.name, registration.exists()))
        return train(cfg, run_dir, experiment, **kw)

    monkeypatch.setattr(trainer, "train", spy)

    code, text, err = moelab("plan", str(spec_path))
    assert code == 0, err
    assert "big" in text and "r3-b50-s1" in text and "r3-s1@40" in text

    code, text, err = moelab("run", str(spec_path), "--experiment", exp)
    assert code == 0, err
    runs = ["r1-s0", "r1-s1", "r2-s0", "r3-s0", "r3-b50-s0", "r3-s1", "r3-b50-s1", "r1-lr2"]
    assert trained == [*((name, False) for name in runs), ("big", True)]
    assert "pre-registered" in text and "relative error" in text

    # the branch resumed r3-s0 at step 40 (a 50-step WSD run's decay start) and decayed
    branch = [json.loads(x) for x in (out / "r3-b50-s0" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in branch]
    assert branch[0]["step"] == 41 and branch[-1]["step"] == 50
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.25 * lrs[0]  # decaying to 0
    parent = [json.loads(x) for x in (out / "r3-s0" / "metrics.jsonl").read_text().splitlines()]
    assert parent[40]["lr"] == pytest.approx(1e-2)  # still in r3's stable phase at step 41

    record = prereg.read(registration)
    assert record["created_at"].endswith("Z") and record["code_version"].keys() == {
        "commit", "dirty"}
    # written before the target's trainer started (its config.yaml is the first file it writes)
    assert registration.stat().st_mtime_ns <= (out / "big" / "config.yaml").stat().st_mtime_ns
    points = {p["point"]: p for p in record["points"]}
    assert list(points) == ["r1", "r2", "r3", "r3-b50"]
    finals = {r["name"]: r["final_val_loss"] for r in record["rungs"]}
    assert points["r1"]["mean"] == pytest.approx((finals["r1-s0"] + finals["r1-s1"]) / 2)
    noise = record["noise"]
    assert noise["dof"] == 3 and noise["seed_sd"] > 0  # r1, r3, r3-b50: 2 seeds each
    assert record["prediction"]["law"] == "compute"
    assert record["prediction"]["value"] == record["laws"]["compute"]["value"]
    assert "at least 5" in record["laws"]["chinchilla"]["skipped"]  # 4 points: reported
    curve = record["laws"]["curve"]["points"]
    assert [pt["step"] for pt in curve] == [130, 260, 390, 520]  # every 1/evals of the target
    assert curve[-1]["predicted"] == record["laws"]["curve"]["value"]
    assert all(pt["low"] <= pt["predicted"] <= pt["high"] for pt in curve)
    assert record["lr_check"]["r1"]["probes"].keys() == {"0.02"}
    assert record["stability"]["limit"] == 4.0

    report = json.loads((out / "report.json").read_text())
    assert {"relative_error", "predicted", "actual", "interval", "seed_sd",
            "curve_median_abs_rel_error", "wall_s"} <= report.keys()
    assert report["predicted"] == record["prediction"]["value"]
    assert report["relative_error"] == pytest.approx(
        (report["predicted"] - report["actual"]) / report["actual"])
    assert len(report["curve"]) == 4 and report["stability"]["check"] is not None
    # the score is the CE over every window of the val split, as the trainer logged it
    model, cfg, _ = load_latest(out / "big")
    full = make_evaluator(cfg)(model)
    assert report["actual_by_source"] == pytest.approx(
        {k.split("/")[1]: v for k, v in full.items() if k.startswith("val_loss/")}, rel=1e-6)
    assert full["val_bpb_macro"] == pytest.approx(np.mean([full["val_bpb/code"],
                                                           full["val_bpb/prose"]]))
    # the ladder's per-window losses average to the trainer's own validation CE
    batch = windows(small_corpus, "code", 32)[:4]
    rows = np.asarray(row_losses_fn(cfg)(model, batch))
    assert rows.mean() == pytest.approx(float(make_eval_step(cfg)(model, batch)), rel=1e-5)
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
    assert len(trained) == 9 and text.count("already trained") == 9
    assert {p: p.read_bytes() for p in before} == before
    assert registration.stat().st_mtime_ns == stamp
    with Store(tmp_path / "lab.sqlite") as store:
        assert len(store.predictions(exp)) == 1

    code, _, err = moelab("report", str(spec_path))
    assert code == 0, err
    code, text, err = moelab("fit", str(spec_path))  # refits, writes nothing
    assert code == 0, err
    assert "chinchilla: skipped" in text and "pre-registered law: compute" in text

    # a changed target does not silently reuse the old prediction
    changed = ladder_spec(small_corpus)
    changed["target"]["train"]["steps"] = 600
    spec_path.write_text(yaml.safe_dump(changed))
    code, _, err = moelab("run", str(spec_path))
    assert code == 2 and "other configs than this spec's" in err and "big" in err


def test_bad_spec_exits_with_a_clear_message(moelab, tmp_path, small_corpus):
    spec = ladder_spec(small_corpus)
    spec["rungs"][2]["branches"] = [70]  # longer than r3 itself
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    code, _, err = moelab("run", str(path))
    assert code == 2
    assert "rungs[2] (r3).branches: a 70-step branch" in err


@pytest.mark.slow
def test_a_cooldown_branch_is_the_shorter_run(tmp_path, small_corpus):
    """A branch resumes its trunk's checkpoint at the step where a run of the branch's
    length starts decaying: same init, batches and lr up to there, so it must end where a
    run of that length trained from scratch ends. Both run the same jitted ops on the same
    inputs; only the compiled schedule constants differ, so f32 results may differ by
    rounding, which 20 steps of Adam amplify to ~1e-6 relative at most."""
    raw = ladder_spec(small_corpus)
    raw["rungs"] = [{"name": "a", "model": {"d_model": 16, "d_ff": 16},
                     "train": {"steps": 30}, "branches": [20]},
                    *raw["rungs"][1:]]
    del raw["lr_check"]
    spec = spec_from_dict(raw, "eq", tmp_path / "ladder")
    trunk, branch = spec.rungs[0], spec.rungs[1]
    assert (branch.name, branch.branch_step) == ("a-b20-s0", 16)
    ensure_trained(spec, trunk, "trunk")
    branched = ensure_trained(spec, branch, "branch")
    scratch = tmp_path / "scratch"
    trainer.train(branch.config, scratch, evaluator=make_evaluator(branch.config))
    alone = result(branch, scratch)
    assert branched.final_val_loss == pytest.approx(alone.final_val_loss, rel=1e-6)
    assert [e["step"] for e in branched.curve] == [20]  # its own evaluations: after step 16


def test_lr_horizon_sets_each_runs_lr_by_its_tokens(tmp_path, small_corpus):
    """lr_horizon: a run of D tokens trains at lr * (D / T)^-p; a branch keeps its trunk's
    LR (it is that run up to its branch step); bad values are one-line config errors."""
    raw = ladder_spec(small_corpus)
    raw["lr_horizon"] = {"tokens": 40 * 4 * 32, "power": 0.5}
    spec = spec_from_dict(raw, "h", tmp_path / "ladder")
    lr = {r.name: r.config.optim.lr for r in spec.runs()}
    tokens = {r.name: r.tokens for r in spec.runs()}
    base = 1e-2
    assert tokens["r1-s0"] == 40 * 4 * 32  # tiny_config's batch 4 x seq 32
    assert lr["r1-s0"] == pytest.approx(base)  # at the horizon T: the spec's lr
    assert lr["r3-s0"] == pytest.approx(base * (60 / 40) ** -0.5)
    assert lr["r3-b50-s0"] == lr["r3-s0"]  # the branch is its trunk up to step 50
    assert spec.target.config.optim.lr == pytest.approx(base * (520 / 40) ** -0.5)
    assert spec_from_dict({k: v for k, v in raw.items() if k != "lr_horizon"}, "n",
                          tmp_path / "n").target.config.optim.lr == base
    for bad, says in [({"tokens": 0, "power": 0.3}, "lr_horizon.tokens"),
                      ({"tokens": 100, "power": 1.5}, "lr_horizon.power"),
                      ({"tokens": 100}, "lr_horizon: expected")]:
        raw["lr_horizon"] = bad
        with pytest.raises(ConfigError, match=says):
            spec_from_dict(raw, "h", tmp_path / "ladder")
