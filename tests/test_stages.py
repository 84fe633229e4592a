"""Staged runs: the plan (parse, checks), the staged loader, the LR across stages, resume
across a boundary, branches (`--from`), and the recipe configs trained from the CLI."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import THREE_STAGES, events, losses, moelab_train, tiny_config

from moelab.config import config_from_dict
from moelab.data.loader import StagedLoader, read_meta
from moelab.errors import ConfigError
from moelab.train.plan import build_plan
from moelab.train.trainer import FAULT_ENV


def staged(data_path, stages, **sections):
    return config_from_dict({**tiny_config(data_path, train={"steps": 30}, **sections),
                             "stages": stages})


def test_staged_loader_reads_exactly_the_planned_tokens(small_corpus):
    cfg = staged(small_corpus, THREE_STAGES)
    plan = build_plan(cfg)
    assert [(s.start, s.end, s.seq_len, s.batch_size) for s in plan.stages] == [
        (0, 12, 32, 4), (12, 24, 16, 8), (24, 30, 32, 4)]
    loader = StagedLoader(small_corpus, plan.stages, seed=cfg.data.seed)
    meta = read_meta(small_corpus)
    sources = loader.sources
    tokens = {(s.index, src): 0 for s in plan.stages for src in sources}
    read = {}  # (source, seq_len) -> windows in the order read
    for step in range(cfg.train.steps):
        stage = plan.at(step)
        batch = next(loader)
        assert batch.shape == (stage.batch_size, stage.seq_len + 1)
        for row, i, k in zip(batch, *loader.plan(step), strict=True):
            s = stage.seq_len  # the row is the planned window of the planned source
            np.testing.assert_array_equal(row, loader.streams[i][k * s : k * s + s + 1])
            tokens[stage.index, sources[i]] += s
            read.setdefault((sources[i], s), []).append(int(k))
    for stage in plan.stages:
        if stage.mixture:
            w = np.array([stage.mixture.get(src, 0.0) for src in sources])
        else:
            w = np.array([meta["train_tokens"][src] for src in sources], float)
        w = w / w.sum()
        got = np.array([tokens[stage.index, src] for src in sources])
        # the stage trains exactly steps x batch x seq_len tokens ...
        assert got.sum() == (stage.end - stage.start) * stage.batch_size * stage.seq_len
        # ... split by source as its weights say, to the row: a count is an integer number
        # of rows, so the best it can be is within one row (seq_len tokens) of w * tokens
        assert np.all(np.abs(got - w * got.sum()) < stage.seq_len), (stage.index, got)
    assert tokens[2, "prose"] == 0  # the last stage is code only
    # no window read twice while the source has unread ones (one cursor across stages)
    for (src, s), windows in read.items():
        n = loader.windows(src, s)
        first_epoch = windows[:n]
        assert len(set(first_epoch)) == len(first_epoch), (src, s)
    # a pure function of (seed, step): a fresh loader jumps to any step
    again = StagedLoader(small_corpus, plan.stages, seed=cfg.data.seed)
    for step in (0, 11, 12, 13, 24, 29):
        np.testing.assert_array_equal(again.batch(step), loader.batch(step))


@pytest.mark.parametrize("stages, field", [
    ([{"start": 0.5}, {"start": 0.2}], "stages[1].start"),  # unordered
    ([{"start": 5}, {"start": 5}], "stages[1].start"),  # overlapping
    ([{"start": 30}], "stages[0].start"),  # past the end
    ([{"start": 1.0}], "stages[0].start"),  # a fraction of 1 is the end
    ([{"mixture": {"code": 0, "prose": 0}}], "stages[0].mixture"),
    ([{"mixture": {"code": -1, "prose": 2}}], "stages[0].mixture.code"),
    ([{"seq_len": 48}], "stages[0].seq_len"),  # does not divide the tokens per step
    ([{"seq_len": 16, "batch_size": 3}], "stages[0].batch_size"),  # grad_accum 1, but ...
    ([{"start": 10, "restart": {"warmup": 25}}], "stages[0].restart.warmup"),
    ([{"start": 10, "model": {"d_model": 64}}], "stages[0].model"),
    ([{"start": 10, "optimizer": "new"}], "stages[0].optimizer"),
])
def test_bad_plans_are_one_line_errors_naming_the_field(small_corpus, stages, field):
    optim = {"grad_accum": 2} if "batch_size" in str(stages) else {}
    with pytest.raises(ConfigError) as err:
        staged(small_corpus, stages, optim=optim)
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message, message


TWO_STAGES = [{"mixture": {"code": 1, "prose": 1}},
              {"start": 10, "mixture": {"code": 1, "prose": 3}}]


def test_plan_changes_on_resume_and_branches_with_lineage(tmp_path, write_config, capsys):
    """One parent run (two stages, 16 steps) attached to a lab experiment, then: a resume
    that changes the started stage is refused, one that changes the stage yet to start is
    recorded; a branch with the parent's optimizer state continues the parent bitwise, a
    weights-only branch matches it on its first step only (same weights, same batch) and
    the lineage shows in the run dir, `moelab lab show` and the published site."""
    from moelab import cli

    lab = tmp_path / "lab.sqlite"
    env = {"MOELAB_LAB": str(lab)}
    train = {"steps": 16, "checkpoint_every": 5, "eval_every": 100, "keep_checkpoints": 1,
             "keep_stage_checkpoints": True}
    config = write_config(stages=TWO_STAGES, train=train)
    assert cli.main(["lab", "--lab", str(lab), "new", "branches", "--hypothesis", "h",
                     "--config", str(config)]) == 0
    parent = tmp_path / "parent"
    killed = moelab_train(config, parent, "--experiment", "exp-1", env={**env, FAULT_ENV: "7"},
                          check=False)
    assert killed.returncode == -9  # checkpoint 5 kept: stage 0 has started, stage 1 not
    started = write_config(stages=[{"mixture": {"code": 2, "prose": 1}}, TWO_STAGES[1]],
                           train=train)
    refused = moelab_train(started, parent, "--experiment", "exp-1", env=env, check=False)
    assert refused.returncode == 2 and "stages: the plan changes stage 0" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    later = [TWO_STAGES[0], {**TWO_STAGES[1], "mixture": {"code": 1, "prose": 5}}]
    changed = write_config(stages=later, train=train)
    moelab_train(changed, parent, "--experiment", "exp-1", env=env)
    assert [e["kind"] for e in events(parent) if e["kind"] not in ("spike", "stage")] == [
        "resume", "plan_change"]
    kept = sorted(int(p.name) for p in (parent / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [10, 16]  # the stage boundary outlives rotation

    full, fresh = tmp_path / "full", tmp_path / "fresh"
    for run, extra in ((full, []), (fresh, ["--weights-only"])):
        out = moelab_train(changed, run, "--from", f"{parent}@10", *extra, "--experiment",
                           "exp-1", "--allow-config-change", env=env)
        assert f"branched from {parent} at step 10" in out.stdout
    ref, a, b = losses(parent), losses(full), losses(fresh)
    assert sorted(a) == sorted(b) == list(range(11, 17))  # the curves fork at step 10
    assert a == {s: ref[s] for s in a}  # the parent's state: exactly the parent's steps
    assert b[11] == ref[11] and b[12] != ref[12]  # fresh moments change the first update
    lineage = json.loads((fresh / "lineage.json").read_text())
    assert lineage == {"parent_run_dir": str(parent), "step": 10, "parent_lab_run": "run-1",
                       "optimizer_state": "fresh"}
    capsys.readouterr()
    assert cli.main(["lab", "--lab", str(lab), "show", "exp-1"]) == 0
    shown = capsys.readouterr().out
    assert shown.count(f"branched from {parent}@10 (lab run run-1)") == 2
    assert cli.main(["lab", "--lab", str(lab), "publish", str(tmp_path / "site")]) == 0
    page = (tmp_path / "site/experiments/exp-1.html").read_text()
    assert page.count('"kind":"branch"') == 2  # the charts' fork mark on each branch
    bad = moelab_train(changed, tmp_path / "x", "--from", f"{parent}@7", check=False)
    assert bad.returncode == 2 and "no checkpoint at that step; it keeps steps [10, 16]" in \
        bad.stderr


RECIPES = Path(__file__).parent.parent / "configs" / "stages"


def test_recipe_configs_express_marin_delphi_and_olmo():
    """The LR and optimizer each public recipe asks for, read off the configs' plans."""
    from moelab.config import load_config
    from moelab.train.optimizer import run_schedule

    def plan_and_lr(name):
        cfg = load_config(RECIPES / f"{name}.yaml")
        lr = run_schedule(cfg)
        return cfg, build_plan(cfg), lambda step: float(lr(step)) / cfg.optim.lr

    # Marin: one schedule (1% warmup, linear to 5%); the data switches inside the decay
    cfg, plan, lr = plan_and_lr("marin")
    assert plan.starts() == [17, 48] and {s.restart for s in plan.stages} == {None}
    slope = 0.95 / (60 - 1)  # from 1 at step 1 (after the warmup) to 0.05 at step 60
    for step in (17, 48):  # no jump at a switch: the decay's slope goes on through it
        assert lr(step - 1) - lr(step) == pytest.approx(slope, rel=1e-5)  # f32 rounding
    assert lr(59) == pytest.approx(0.05 + slope, rel=1e-5)
    # Delphi: fresh optimizer at 83.3%, 0.83x peak after 3 warmup steps, linear to 0.1 of it
    cfg, plan, lr = plan_and_lr("delphi")
    assert plan.starts() == [50] and plan.fresh_optimizer_at(50)
    assert lr(50) == pytest.approx(0.83 / 3, rel=1e-5) and lr(53) == pytest.approx(0.83)
    assert lr(59) == pytest.approx(0.83 * (1 - 0.9 * 6 / 7), rel=1e-5)  # 6 of 7 decay steps
    # OLMo: optimizer kept, no warmup, linear from the peak to 0 over the last 12 steps
    cfg, plan, lr = plan_and_lr("olmo")
    assert plan.starts() == [48] and not plan.fresh_optimizer_at(48)
    assert lr(47) == lr(48) == pytest.approx(1.0) and lr(59) == pytest.approx(1 / 12)
    cfg, plan, _ = plan_and_lr("three_stage")
    # each stage departs from the run's data.*, not from the stage before
    assert [(s.seq_len, s.batch_size) for s in plan.stages] == [(64, 8), (128, 4), (64, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["marin", "delphi", "olmo", "two_stage", "three_stage"])
def test_recipe_configs_train_from_the_cli(name, small_corpus, tmp_path):
    run = tmp_path / name
    moelab_train(RECIPES / f"{name}.yaml", run, "--set", f"data.path={small_corpus}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    from moelab.config import load_config

    plan = build_plan(load_config(RECIPES / f"{name}.yaml"))
    assert [r["stage"] for r in rows] == [plan.at(r["step"] - 1).index for r in rows]
    assert len(rows) == plan.steps and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("stage, field", [
    ({"start": 4, "mixture": {"code": 1, "web": 1}}, "stages[0].mixture: source(s) ['web']"),
    # one window of 65536 tokens: its attention scores alone need ~137 GB, over any CPU here
    ({"start": 4, "seq_len": 65536, "batch_size": 1}, "stages[0].seq_len: 65536 x batch 1"),
])
def test_plans_the_data_or_the_memory_cannot_hold_fail_before_compiling(
        small_corpus, tmp_path, stage, field):
    from moelab.train.trainer import train

    cfg = staged(small_corpus, [stage])
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    assert str(err.value).startswith(field) and "\n" not in str(err.value), err.value
    assert not (tmp_path / "run" / "checkpoints").exists()
