"""A staged ladder: every rung runs the plan at the same fractions, the fit pre-registers a
loss for the end of every stage, and the report scores each against the target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import tiny_config

from moelab import cli
from moelab.config import ConfigError
from moelab.lab.report import load_view
from moelab.lab.store import Store
from moelab.ladder import prereg
from moelab.ladder.predict import forecast, stage_ends
from moelab.ladder.results import LOSS_MIXTURE, RunResult
from moelab.ladder.spec import spec_from_dict

SWITCH = [{"mixture": {}}, {"start": 0.8, "mixture": {"code": 1, "prose": 3}}]


def staged_spec(data_path, widths=(16, 24, 32), steps=100, branches=(50, 75),
                target=(64, 800)) -> dict:
    base = tiny_config(data_path, model={"n_layers": 1}, optim={"lr": 1e-2, "warmup_steps": 5},
                       train={"log_every": 1000, "eval_batches": 1, "checkpoint_every": 1000})
    base["stages"] = SWITCH
    rung = lambda name, d, n: {"name": name, "model": {"d_model": d, "d_ff": d},
                               "train": {"steps": n}}
    return {"base": base, "seeds": [0, 1], "evals": 4,
            "rungs": [{**rung(f"w{d}", d, steps), "branches": list(branches)} for d in widths],
            "target": rung("big", *target), "fit": {"bootstrap": 20}}


# Two known laws: L(N, D) at the end of stage 0, another at the end of the run.
LAWS = [(1.5, 40.0, 0.4, 300.0, 0.35), (1.4, 30.0, 0.45, 250.0, 0.3)]


def law(k: int, n: float, d: float) -> float:
    e, a, alpha, b, beta = LAWS[k]
    return e + a * (n / 1e4) ** -alpha + b * (d / 1e4) ** -beta


def test_a_known_law_per_stage_is_recovered_and_preregistered(tmp_path):
    """Rungs whose loss at each stage's end follows that stage's own L(N, D) (the other
    evaluations in between): the forecast at the end of each stage of the target recovers
    that stage's law 10x past the rungs. The points are exact up to a +-1e-4 seed offset,
    so the refit is exact to ~1e-4 relative; 1e-3 leaves room for the solver's tolerance."""
    spec = spec_from_dict(staged_spec(tmp_path / "data"), "synthetic", tmp_path / "ladder")
    record = forecast(spec, synthetic_results(spec), [])
    first, last = record["stages"]
    target = spec.target
    assert (first["end_step"], last["end_step"]) == (640, 800)
    assert first["law"] == last["law"] == "chinchilla"
    assert first["value"] == pytest.approx(law(0, target.active_params, first["tokens"]),
                                           rel=1e-3)
    assert last["value"] == pytest.approx(law(1, target.active_params, target.tokens),
                                          rel=1e-3)
    assert last["value"] == record["prediction"]["value"]
    assert first["low"] <= first["value"] <= first["high"]
    # a stage's end is also among the curve law's points, and every point was fitted
    assert 640 in [pt["step"] for pt in record["laws"]["curve"]["points"]]
    assert len(first["points"]) == 9 and first["laws"]["chinchilla"]["backtest"]


def synthetic_results(spec, after=None) -> list[RunResult]:
    """Every rung's curve on LAWS: stage 0's law up to its end, the last stage's after
    (a +-1e-4 offset per seed, so the replicates differ). `after(n, d_end0, d)`, if given,
    is the loss past stage 0's end instead."""
    after = after or (lambda n, d0, d: law(1, n, d))
    results = []
    for rung in spec.rungs:
        (_, _, end0, _), (_, _, end, tokens) = stage_ends(rung)
        offset = 1e-4 * (1 if rung.seed else -1)
        steps = sorted({*range(rung.config.train.eval_every, end + 1,
                               rung.config.train.eval_every), end0, end})
        steps = [s for s in steps if rung.parent is None or s > rung.branch_step]
        n, d0 = rung.active_params, end0 * tokens / end
        curve = [{"step": s, "loss": offset + (law(0, n, s * tokens / end) if s <= end0
                                               else after(n, d0, s * tokens / end))}
                 for s in steps]
        results.append(RunResult(rung.name, rung.point, rung.seed, rung.active_params,
                                 rung.total_params, rung.tokens, rung.compute,
                                 curve[-1]["loss"], {}, curve))
    return results


def test_stage_law_curve_widens_its_band_by_the_rungs_extrapolation_error(tmp_path):
    """`fit.stage_law: curve` makes the curve law the value at the end of every stage but
    the last (the last keeps fit.law's). The target's stage end lies past every rung's S1,
    so its interval is the curve point's bootstrap band widened on each side by the
    rungs' own s1_2x backtest error times the value: exactly that, nothing else."""
    raw = staged_spec(tmp_path / "data")
    raw["fit"]["stage_law"] = "curve"
    spec = spec_from_dict(raw, "synthetic", tmp_path / "ladder")
    record = forecast(spec, synthetic_results(spec), [])
    first, last = record["stages"]
    assert (first["law"], last["law"]) == ("curve", "chinchilla")
    curve = record["laws"]["curve"]
    point = next(pt for pt in curve["points"] if pt["step"] == first["end_step"])
    s1_2x = curve["extrapolation"]["backtests"]["s1_2x"]
    widen = abs(s1_2x["mean_rel_error"]) * point["predicted"]
    assert widen > 0 and first["value"] == point["predicted"]
    assert first["low"] == pytest.approx(point["low"] - widen, rel=1e-12)
    assert first["high"] == pytest.approx(point["high"] + widen, rel=1e-12)
    assert last["value"] == record["prediction"]["value"]
    raw["fit"]["stage_law"] = "median"
    with pytest.raises(ConfigError, match=r"^fit.stage_law: 'median' is not one of"):
        spec_from_dict(raw, "bad", tmp_path / "ladder")


# A stage gain exactly linear in ln N and ln D: g = G0 + G1 ln N + G2 ln D (about 5%).
G0, G1, G2 = -0.02, 0.003, 0.004


def gain(n: float, d: float) -> float:
    return G0 + G1 * np.log(n) + G2 * np.log(d)


def test_stage_gain_chains_each_stage_end_from_the_one_before(tmp_path):
    """`fit.stage_gain`: the last stage's end is the first's value times one minus the
    stage's relative gain, fitted on the rungs' own gains. The rungs' losses at the end
    of the run are exactly L0(end0) * (1 - g(N, D)) up to a +-1e-4 seed offset, so the
    gain at the target (4x past the rungs' N, 8x their D) is recovered to ~1e-4 / L
    (a few 1e-5) times the lever arm; 1e-3 absolute bounds that with room to spare. The
    chain's value is exact arithmetic on the recovered gain."""
    raw = staged_spec(tmp_path / "data")
    raw["fit"]["stage_gain"] = True
    spec = spec_from_dict(raw, "synthetic", tmp_path / "ladder")
    results = synthetic_results(spec, lambda n, d0, d: law(0, n, d0) * (1 - gain(n, d)))
    record = forecast(spec, results, [])
    first, last = record["stages"]
    target = spec.target
    entry = last["laws"]["gain"]
    assert last["law"] == "gain" and first["law"] == "chinchilla"
    assert entry["gain"]["predicted"] == pytest.approx(
        gain(target.active_params, target.tokens), abs=1e-3)
    assert last["value"] == pytest.approx(first["value"] * (1 - entry["gain"]["predicted"]),
                                          rel=1e-12)
    # the interval holds the first stage's, scaled, and the gain's own: it is wider
    assert last["low"] < last["value"] < last["high"]
    assert last["high"] - last["low"] > (first["high"] - first["low"]) * (
        1 - entry["gain"]["predicted"])
    # the chain is the final prediction, and the other laws stay beside it
    assert record["prediction"]["value"] == last["value"]
    assert record["prediction"]["law"] == "gain" and "chinchilla" in last["laws"]
    # the rung-only backtests of the form score (near) zero error on an exact form
    for name in ("branches_to_trunks", "narrow_to_widest"):
        assert entry["rung_backtests"][name]["mean_abs_error"] < 1e-3


def test_stage_gain_is_refused_where_it_cannot_apply(tmp_path):
    raw = staged_spec(tmp_path / "data")
    raw["fit"]["stage_gain"] = "yes"
    with pytest.raises(ConfigError, match=r"^fit.stage_gain: must be true or false"):
        spec_from_dict(raw, "bad", tmp_path / "ladder")
    raw["fit"]["stage_gain"] = True
    del raw["base"]["stages"]
    with pytest.raises(ConfigError, match=r"^fit.stage_gain: the plan has one stage"):
        spec_from_dict(raw, "bad", tmp_path / "ladder")


def test_a_branch_whose_stages_switch_before_it_is_refused(tmp_path):
    raw = staged_spec(tmp_path / "data")
    raw["base"]["stages"] = [{"mixture": {}}, {"start": 0.5, "mixture": {"code": 1}}]
    with pytest.raises(ConfigError, match=r"rungs\[0\] \(w16\).branches: a 50-step branch"):
        spec_from_dict(raw, "bad", tmp_path / "ladder")


@pytest.mark.slow
def test_staged_ladder_end_to_end(tmp_path, small_corpus, monkeypatch, capsys):
    """Train a tiny staged ladder from the CLI: the pre-registration holds each stage's end
    before the target trains; the report scores each against the target's evaluation at
    that step; the lab scores the final prediction on the target's logged metric."""
    monkeypatch.setattr(cli, "PARTS", ["moelab.ladder.cli", "moelab.lab.cli"])
    monkeypatch.chdir(tmp_path)
    lab = tmp_path / "lab.sqlite"
    monkeypatch.setenv("MOELAB_LAB", str(lab))
    raw = {**staged_spec(small_corpus, target=(32, 900)), "evals": 5}
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(raw))
    with Store(lab) as store:
        exp = store.new_experiment("staged", "each stage's end within 5%", {}, None)
    assert cli.main(["ladder", "run", str(path), "--experiment", exp]) == 0, capsys.readouterr()
    out = tmp_path / "runs" / "ladder" / "staged"
    record = prereg.read(out / prereg.PREREG_FILE)
    assert [s["end_step"] for s in record["stages"]] == [720, 900]
    report = json.loads((out / "report.json").read_text())
    target_curve = {e["step"]: e["loss"] for e in report["target"]["curve"]}
    for stage, scored in zip(record["stages"], report["stages"], strict=True):
        assert scored["actual"] == target_curve[stage["end_step"]]
        assert scored["relative_error"] == pytest.approx(
            (stage["value"] - scored["actual"]) / scored["actual"])
    assert report["stages"][-1]["actual"] == report["actual"]
    assert "stage 0 ends at step 720" in (out / "report.md").read_text()
    # the branch w32-b75 started from its trunk's checkpoint at step 60, lineage recorded
    lineage = json.loads((out / "w32-b75-s0" / "lineage.json").read_text())
    assert lineage["step"] == 60 and lineage["parent_run_dir"].endswith("w32-s0")
    # the lab scores the ladder's prediction on the target's own logged score
    with Store(lab) as store:
        view = load_view(store, exp)
        (prediction,) = view.predictions
        observed, basis = view.scored(prediction)
    assert prediction.metric == LOSS_MIXTURE and "(named)" in basis
    assert observed == pytest.approx(report["actual"], rel=1e-6)
    assert np.isfinite(report["curve_median_abs_rel_error"])


def test_curve_areas_follow_the_plan_aware_schedule(tmp_path):
    """S1 grows by each step's tokens x lr / peak with the LR the run really uses: a stage's
    restart (new warmup to 0.5x the peak) and its halved seq_len (doubled batch, so tokens
    per step stay) show in S1 and S2; the plain whole-run schedule would miss the restart."""
    from moelab.config import config_from_dict
    from moelab.ladder.curve import schedule_areas
    from moelab.train.optimizer import lr_schedule, run_schedule

    stages = [{"mixture": {}}, {"start": 0.5, "seq_len": 16,
                                "restart": {"warmup": 2, "peak_fraction": 0.5}}]
    cfg = config_from_dict(tiny_config(tmp_path, train={"steps": 20}, stages=stages))
    s1, s2 = schedule_areas(cfg)
    lr = np.asarray(run_schedule(cfg)(np.arange(20)), float) / cfg.optim.lr
    per_step = 4 * 32  # batch 4 x 32 = batch 8 x 16
    assert np.diff(s1) == pytest.approx(per_step * lr, rel=1e-6)
    assert lr[10:13] == pytest.approx([0.25, 0.375, 0.5])  # the re-warmup to 0.5x
    plain = np.asarray(lr_schedule(cfg.optim, 20)(np.arange(20)), float) / cfg.optim.lr
    assert s1[-1] < per_step * plain.sum() * 0.9  # the restart's lower peak is seen
    assert np.diff(s2)[12:] == pytest.approx(per_step * (1 - lr[12:]), rel=1e-6)
