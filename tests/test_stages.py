"""Staged runs: the plan (parse, checks), the staged loader, the LR across stages, resume
across a boundary, branches (`--from`), and the recipe configs trained from the CLI."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import THREE_STAGES, events, losses, moelab_train, tiny_config

from moelab.config import config_from_dict
from moelab.config.plan import build_plan
from moelab.data.loader import StagedLoader, read_meta
from moelab.errors import ConfigError
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
    # a stage's rope is checked against the stage's own seq_len (64 here, the run's 32)
    ([{"start": 10, "seq_len": 64, "model": {"rope": {
        "type": "yarn", "factor": 4, "original_max_position_embeddings": 128}}}],
     "stages[0].model.rope.original_max_position_embeddings"),
    ([{"start": 10, "model": {"rope": {"type": "yarn", "factor": 4}}}],
     "stages[0].model.rope.original_max_position_embeddings"),  # yarn needs it
    ([{"start": 10, "model": {"rope": {"type": "rotary"}}}], "stages[0].model.rope.type"),
    ([{"start": 10, "model": {"rope": {"type": "linear", "factor": 0}}}],
     "stages[0].model.rope.factor"),
    ([{"start": 10, "model": {"attn_logit_scale": 0}}], "stages[0].model.attn_logit_scale"),
    ([{"start": 10, "optimizer": "new"}], "stages[0].optimizer"),
    # short windows: a whole number of the stage's sequences, of a stage longer than the run
    ([{"start": 10, "seq_len": 64, "short_fraction": 0.25}], "stages[0].short_fraction"),
    ([{"start": 10, "short_fraction": 0.5}], "stages[0].short_fraction"),
    ([{"start": 10, "seq_len": 64, "short_fraction": 1.0}], "stages[0].short_fraction"),
])
def test_bad_plans_are_one_line_errors_naming_the_field(small_corpus, stages, field):
    optim = {"grad_accum": 2} if "batch_size" in str(stages) else {}
    with pytest.raises(ConfigError) as err:
        staged(small_corpus, stages, optim=optim)
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message, message


def test_a_stage_changes_rope_from_the_runs_model():
    """stages[i].model overrides the run's model.* (rope as a whole section); the stages
    that do not name it keep the run's model, and the stage's summary names the change."""
    yarn = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32}
    cfg = staged("data", [{}, {"start": 10, "seq_len": 128,
                               "model": {"rope": yarn, "attn_logit_scale": 1.3}}])
    plan = build_plan(cfg)
    assert plan.at(9).model == cfg.model
    long = plan.at(10).model
    assert (long.rope.type, long.rope.factor, long.attn_logit_scale) == ("yarn", 4, 1.3)
    assert long.rope.beta_fast == 32 and long.d_model == cfg.model.d_model
    assert plan.at(10).summary().endswith("rope yarn x4, attn logit scale 1.3")


def test_a_stage_keeps_short_windows_in_its_long_batches():
    """short_fraction cuts that share of the stage's sequences into windows of the run's
    seq_len: the stage's config carries it as data.short_rows / short_len."""
    from moelab.config.plan import stage_config

    cfg = staged("data", [{}, {"start": 10, "seq_len": 128, "batch_size": 4,
                               "short_fraction": 0.5}])
    plan = build_plan(cfg)
    assert (plan.at(9).short_rows, plan.at(10).short_rows, plan.at(10).short_len) == (0, 2, 32)
    data = stage_config(cfg, plan.at(10)).data
    assert (data.seq_len, data.batch_size, data.short_rows, data.short_len) == (128, 4, 2, 32)
    assert plan.at(10).summary().endswith("2 of them cut into windows of 32")


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


def test_a_stage_with_short_windows_trains_its_steps_with_them(small_corpus, tmp_path):
    """The trainer switches to the stage's cut step at the boundary: the first update of a
    stage with short_fraction 0.5 logs the loss of the boundary checkpoint on its batch
    with the first of the 2 sequences cut into windows of 32; the steps before are the
    same as without the cut."""
    from moelab.config.plan import stage_config
    from moelab.model.transformer import short_segments
    from moelab.train.checkpoint import load_latest
    from moelab.train.step import make_loss
    from moelab.train.trainer import train

    def run(name, **cut):
        cfg = config_from_dict({**tiny_config(small_corpus, train={
            "steps": 14, "eval_every": 100, "checkpoint_every": 12,
            "keep_stage_checkpoints": True}), "stages": [{}, {"start": 12, "seq_len": 64, **cut}]})
        train(cfg, tmp_path / name)
        return cfg, losses(tmp_path / name)

    _, plain = run("plain")
    cfg, cut = run("cut", short_fraction=0.5)
    assert [cut[s] for s in range(1, 13)] == [plain[s] for s in range(1, 13)]
    model, _, _ = load_latest(tmp_path / "cut", only_step=12)
    plan = build_plan(cfg)
    stage = plan.at(12)
    batch = StagedLoader(cfg.data.path, plan.stages, seed=cfg.data.seed).batch(12)
    segments = short_segments(2, 64, 1, 32)
    as_cut = float(make_loss(stage_config(cfg, stage))(model, batch, segments)[0])
    as_whole = float(make_loss(stage_config(cfg, stage))(model, batch)[0])
    # the jitted step and this eager call sum in another order: float32 rounding only
    assert abs(cut[13] - as_cut) < 1e-5 * as_cut
    assert abs(cut[13] - as_whole) > 3 * abs(cut[13] - as_cut), (cut[13], as_cut, as_whole)


# Pre-train at 32 tokens, extend to 128 (4x, tokens per step kept: batch 4 -> 1) with yarn
# and a logit scale for the last 4 of 16 steps: the long-context recipe in miniature.
EXTENSION = [{"name": "pretrain"},
             {"name": "extend", "start": 12, "seq_len": 128, "model": {
                 "rope": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32},
                 "attn_logit_scale": 1.3}}]


@pytest.mark.slow
def test_a_rope_extension_stage_trains_resumes_bitwise_and_exports_its_rope(
        tmp_path, write_config):
    """The plan through the CLI: the extension stage's first update already uses its RoPE
    (its logged loss is the loss of the boundary checkpoint under the stage's model, not
    under the run's); kill -9 at the boundary and one step after resume bitwise; the
    checkpoint loads, and exports, with the last stage's RoPE and seq_len."""
    from moelab import cli
    from moelab.config.plan import stage_config
    from moelab.export.hf import hf_rope_parameters
    from moelab.model.transformer import with_model_config
    from moelab.train.checkpoint import load_latest
    from moelab.train.step import make_loss

    train = {"steps": 16, "checkpoint_every": 5, "keep_checkpoints": 1, "eval_every": 100,
             "keep_stage_checkpoints": True}
    config = write_config(stages=EXTENSION, train=train)
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    moelab_train(config, clean)
    for fault in ("12", "13"):
        killed = moelab_train(config, crashed, env={FAULT_ENV: fault}, check=False)
        assert killed.returncode == -9, killed.stderr
    moelab_train(config, crashed)
    assert losses(crashed) == losses(clean)  # bitwise equal floats, steps 1..16

    model, cfg, step = load_latest(clean, only_step=12)  # trained by the pre-training stage
    assert step == 12 and cfg.model.rope.type == "default" and cfg.data.seq_len == 32
    plan = build_plan(cfg)  # the stage-0 config at step 12 is the run's own
    stage = plan.at(12)
    batch = StagedLoader(cfg.data.path, plan.stages, seed=cfg.data.seed).batch(12)
    assert batch.shape == (1, 129)
    loss = lambda m: float(make_loss(stage_config(cfg, stage))(m, batch)[0])
    as_stage, as_run = loss(with_model_config(model, stage.model)), loss(model)
    logged = losses(clean)[13]
    # the jitted step and this eager call sum in another order: float32 rounding only
    assert abs(logged - as_stage) < 1e-5 * as_stage
    # a 12-step model barely uses positions, yet the run's plain RoPE is further off than
    # that rounding by a clear factor: the logged step did use the stage's RoPE
    assert abs(logged - as_run) > 3 * abs(logged - as_stage), (logged, as_stage, as_run)

    final, final_cfg, _ = load_latest(clean)
    assert final_cfg.data.seq_len == 128 and final.cfg == final_cfg.model == stage.model
    assert final.blocks[0].attn.logit_scale == 1.3
    out = tmp_path / "hf"
    assert cli.main(["export", "--run-dir", str(clean), "--out", str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"] == hf_rope_parameters(stage.model)
    assert exported["rope_parameters"]["rope_type"] == "yarn"
    assert exported["max_position_embeddings"] == 128
