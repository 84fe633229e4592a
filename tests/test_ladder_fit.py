"""The ladder's fits, spec validation and pre-registration record (no training here)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from conftest import tiny_config

from moelab.config import ConfigError
from moelab.errors import UserError
from moelab.ladder import prereg
from moelab.ladder.fit import (
    FitError,
    compute_levels,
    fit_chinchilla,
    fit_curve,
    fit_power_law,
    isoflop_minima,
    parametric_interval,
    power_law_refit,
)
from moelab.ladder.spec import spec_from_dict

E, A_RAW, ALPHA = 1.8, 3.0e3, 0.28  # a made-up "true" law, L = E + A_RAW * C^-ALPHA
COMPUTE = np.geomspace(1e11, 3e12, 6)
TARGET = 3e13  # 10x beyond the largest rung


def law(compute):
    return E + A_RAW * np.asarray(compute) ** -ALPHA


def test_fit_recovers_exact_parameters():
    fit = fit_power_law(COMPUTE, law(COMPUTE))
    assert fit.at_bound == ()
    assert fit.E == pytest.approx(E, rel=1e-4)
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-4)
    assert fit.A_raw == pytest.approx(A_RAW, rel=1e-3)
    assert fit.rmse < 1e-8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_parameters_from_noisy_data(seed):
    rng = np.random.default_rng(seed)
    noisy = law(COMPUTE) * (1 + 0.001 * rng.standard_normal(len(COMPUTE)))  # 0.1% noise
    fit = fit_power_law(COMPUTE, noisy)
    assert fit.E == pytest.approx(E, abs=0.15)
    assert fit.alpha == pytest.approx(ALPHA, rel=0.15)
    assert float(fit.predict(TARGET)) == pytest.approx(law(TARGET), rel=0.01)


def test_parametric_interval_covers_the_truth_at_its_confidence():
    """Points drawn with known noise sd: the 80% interval (target noise included) should
    hold a fresh noisy target draw in ~80% of 40 ladders; a binomial(40, 0.8) lies in
    [24, 38] with probability > 0.99."""
    sd, covered = 0.01, 0
    truth = law(TARGET)
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        noisy = law(COMPUTE) + sd * rng.standard_normal(len(COMPUTE))
        try:
            fit = fit_power_law(COMPUTE, noisy)
        except FitError:
            continue
        value = float(fit.predict(TARGET))
        iv = parametric_interval(power_law_refit(fit, COMPUTE, TARGET), fit.predict(COMPUTE),
                                 np.full(len(COMPUTE), sd), sd, value, 100, 0.8, seed)
        covered += iv.low <= truth + sd * rng.standard_normal() <= iv.high
        assert iv.low <= value <= iv.high and "parametric bootstrap" in iv.method
    assert 24 <= covered <= 38


def test_interval_width_grows_with_the_measured_noise():
    fit = fit_power_law(COMPUTE, law(COMPUTE))
    widths = []
    for sd in (0.005, 0.05):
        iv = parametric_interval(power_law_refit(fit, COMPUTE, TARGET), fit.predict(COMPUTE),
                                 np.full(len(COMPUTE), sd), sd, float(fit.predict(TARGET)),
                                 200, 0.9, 0)
        widths.append(iv.high - iv.low)
    # the target's own noise alone gives a 90% width of 2 * 1.645 sd
    assert widths[0] >= 2 * 1.645 * 0.005 * 0.8 and widths[1] > 5 * widths[0]


def test_compute_levels_group_equal_compute_points_and_pick_isoflop_minima():
    compute = [1e12, 1.02e12, 0.99e12, 4e12, 4.1e12, 1.6e13]
    loss = [4.0, 3.9, 4.2, 3.5, 3.6, 3.2]
    assert compute_levels(compute).tolist() == [0, 0, 0, 1, 1, 2]
    assert isoflop_minima(compute, loss) == [1, 3, 5]


def test_an_asymptote_at_zero_is_flagged():
    """A pure power law (no offset) drives E to its bound 0: the fit is kept, but flagged."""
    fit = fit_power_law(COMPUTE, A_RAW * COMPUTE**-ALPHA)
    assert fit.to_dict()["at_bound"] == ["E"]


def test_degenerate_and_bad_fits_raise_clear_errors():
    with pytest.raises(FitError, match="degenerate.*stopped falling|degenerate.*alpha"):
        fit_power_law(COMPUTE, [5.0, 4.0, 3.9, 3.9, 3.9, 3.9])
    with pytest.raises(FitError, match="do not fall with compute"):
        fit_power_law(COMPUTE, [4.0, 4.0, 4.0, 4.0, 4.0, 4.0])
    with pytest.raises(FitError, match="at least 3 rungs"):
        fit_power_law(COMPUTE[:2], law(COMPUTE[:2]))
    with pytest.raises(FitError, match="diverged"):
        fit_power_law(COMPUTE, [5.0, 4.0, float("nan"), 3.5, 3.4, 3.3])


def grid_points():
    """An IsoFLOP-like grid: 3 widths x 4 token counts, N and D varied independently."""
    n = np.repeat([1e5, 2e5, 4e5], 4)
    d = np.tile([1e6, 2e6, 4e6, 8e6], 3)
    return n, d, 1.5 + 40 * n**-0.33 + 400 * d**-0.3


def test_chinchilla_approach3_recovers_untied_exponents():
    n, d, loss = grid_points()
    fit = fit_chinchilla(n, d, loss)
    assert (fit.E, fit.a, fit.b) == pytest.approx((1.5, 0.33, 0.3), rel=2e-3)
    assert fit.at_bound == ()
    assert float(fit.predict(2e6, 5e7)) == pytest.approx(1.5 + 40 * 2e6**-0.33 + 400 * 5e7**-0.3,
                                                         rel=1e-3)
    with pytest.raises(FitError, match="at least 5"):
        fit_chinchilla(n[:4], d[:4], loss[:4])


def test_chinchilla_huber_shrugs_off_one_outlier():
    """Huber on log L (delta 1e-3) gives an outlier a linear, not quadratic, pull: one point
    off by 5% moves the extrapolation far less than the outlier itself."""
    n, d, loss = grid_points()
    bad = loss.copy()
    bad[5] *= 1.05
    truth = 1.5 + 40 * 2e6**-0.33 + 400 * 5e7**-0.3
    assert float(fit_chinchilla(n, d, bad).predict(2e6, 5e7)) == pytest.approx(truth, rel=0.01)


def test_lockstep_points_are_flagged_unidentified():
    """Points with N and D in lockstep cannot separate the two terms (A and B trade off
    exactly): the fit still "converges", and the flag says so instead of hiding it."""
    n = np.geomspace(1e5, 1e6, 6)
    d = 10 * n
    loss = 1.0 + 40 * n**-0.3 + 400 * d**-0.3
    assert fit_chinchilla(n, d, loss).to_dict()["unidentified"]
    assert not fit_chinchilla(*grid_points()).to_dict()["unidentified"]


def test_curve_law_recovers_a_schedule_aware_curve():
    n = np.repeat([1e5, 2e5, 4e5], 6)
    s1 = np.tile([1e6, 2e6, 3e6, 4e6, 4.4e6, 4.5e6], 3)
    q = np.tile([0.0, 0.0, 0.0, 0.0, 0.05, 0.11], 3)
    loss = 1.2 + 30 * n**-0.3 + 300 * s1**-0.3 * (1 - 1.5 * q)
    fit = fit_curve(n, s1, q * s1, loss)  # S2 = q S1
    assert (fit.b, fit.C) == pytest.approx((0.3, 1.5), rel=0.02)
    assert float(fit.predict(8e5, 4e7, 0.11 * 4e7)) == pytest.approx(
        1.2 + 30 * 8e5**-0.3 + 300 * 4e7**-0.3 * (1 - 1.5 * 0.11), rel=2e-3)


def test_tissue_curve_law_recovers_its_own_curve():
    """Tissue et al.'s form, L = E + A N^-a + B S1^-b - C S2 (S's in units of the smallest
    S1): exact points refit to their parameters, and the two forms differ where they should
    (the drop grows with S2 in one, with the annealed fraction in the other)."""
    n = np.repeat([1e5, 2e5, 4e5], 6)
    s1 = np.tile([1e6, 2e6, 3e6, 4e6, 4.4e6, 4.5e6], 3)
    s2 = np.tile([0.0, 0.0, 0.0, 0.0, 0.2e6, 0.5e6], 3)
    loss = 1.2 + 30 * n**-0.3 + 300 * s1**-0.3 - 0.1 * s2 / 1e6
    fit = fit_curve(n, s1, s2, loss, form="tissue")
    assert fit.form == "tissue" and fit.D0 == 1e6
    assert (fit.b, fit.C) == pytest.approx((0.3, 0.1), rel=0.02)
    assert float(fit.predict(8e5, 4e7, 4e6)) == pytest.approx(
        1.2 + 30 * 8e5**-0.3 + 300 * 4e7**-0.3 - 0.4, rel=2e-3)
    with pytest.raises(FitError, match="fit.curve_law: 'nope'"):
        fit_curve(n, s1, s2, loss, form="nope")


def test_curve_reach_backtests_find_a_drift_that_only_shows_far_out():
    """The curve-extrapolation backtests score the law where the target asks it to go:
    on points that follow the law they find ~no error; when the stable phase drifts above
    the law late and wide (as the default ladder's target did), the joint backtest sees
    it: the law fitted on the early, narrow points under-predicts the late, wide ones."""
    from moelab.ladder.predict import _curve_reach

    n = np.repeat([1e5, 2e5, 4e5, 8e5], 8)
    s1 = np.tile(np.linspace(5e5, 4e6, 8), 4)
    q = np.zeros_like(s1)
    exact = 1.2 + 30 * n**-0.3 + 300 * s1**-0.3
    t_s1, t_q = np.array([2e6, 8e6, 9e6]), np.array([0.0, 0.0, 0.05])
    clean = _curve_reach(n, s1, q, exact, None, t_s1, t_q)
    assert clean["ratio"] == pytest.approx(8e6 / 4e6)
    assert clean["backtests"]["joint"] == {**clean["backtests"]["joint"], "fit_points": 12,
                                           "scored_points": 4}
    for b in clean["backtests"].values():
        assert b["median_abs_rel_error"] < 1e-3  # an exact law refits exactly (2e-3 budget)
    drift = exact * (1 + 0.03 * (s1 / 4e6) ** 2 * (n / 8e5))  # late and wide: +3% at the corner
    drifted = _curve_reach(n, s1, q, drift, None, t_s1, t_q)["backtests"]
    assert drifted["joint"]["mean_rel_error"] < -0.005  # the law under-predicts out there
    three = _curve_reach(n[8:], s1[8:], q[8:], exact[8:], None, t_s1, t_q)["backtests"]
    assert "skipped" in three["width"] and "median_abs_rel_error" in three["s1_2x"]
    # the widest rung short (a held-out ladder's): none of its points past half the
    # largest S1, so `joint` has nothing to score: NaN, and no numpy warning on the way
    short = np.where(n == n.max(), s1 / 4, s1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reach = _curve_reach(n, short, q, exact, None, t_s1, t_q)
    joint = reach["backtests"]["joint"]
    assert joint["scored_points"] == 0 and math.isnan(joint["median_abs_rel_error"])
    from moelab.ladder.report import _reach_lines

    line = _reach_lines(reach)[0]
    assert "joint n/a (no point to score)" in line and "nan" not in line


# ------------------------------------------------------------------------ specs


def spec_raw(tmp_path, steps=(20, 40, 80), target_steps=1000) -> dict:
    base = tiny_config(tmp_path / "data")
    return {"base": base,
            "rungs": [{"name": f"r{i}", "train": {"steps": s}} for i, s in enumerate(steps)],
            "target": {"name": "big", "model": {"d_model": 64}, "train": {"steps": target_steps}}}


def test_spec_builds_rungs_with_rising_compute(tmp_path):
    spec = spec_from_dict(spec_raw(tmp_path), "demo")
    assert [r.name for r in spec.runs()] == ["r0", "r1", "r2", "big"]
    assert spec.out.as_posix() == "runs/ladder/demo"
    assert spec.target.config.model.d_model == 64 and spec.rungs[0].config.model.d_model == 32
    assert spec.rungs[0].config.train.log_every == 4  # base fields survive a rung's override
    assert spec.rungs[0].config.train.eval_every == 2  # the ladder's: every 1/evals (10)
    computes = [r.compute for r in spec.runs()]
    assert computes == sorted(computes)


def test_spec_allows_equal_compute_points_and_expands_replicates_and_branches(tmp_path):
    raw = spec_raw(tmp_path, steps=(20, 40, 40), target_steps=2000)
    raw["rungs"][2]["model"] = {"d_model": 64}  # r1 and r2: two widths, (nearly) one budget
    raw["rungs"][2]["train"] = {"steps": 20}
    raw["rungs"][1]["branches"] = [30]
    raw["seeds"] = [3, 4]
    raw["evals"] = 4
    raw["lr_check"] = {"rungs": ["r0"], "factors": [0.5, 2]}
    spec = spec_from_dict(raw, "demo")
    assert [r.name for r in spec.rungs] == ["r0-s3", "r0-s4", "r1-s3", "r1-b30-s3",
                                            "r1-s4", "r1-b30-s4", "r2-s3", "r2-s4"]
    assert list(spec.points()) == ["r0", "r1", "r1-b30", "r2"]
    trunk, branch = spec.rungs[2], spec.rungs[3]
    assert (trunk.seed, trunk.config.data.seed, spec.rungs[4].config.data.seed) == (3, 3, 4)
    # a 30-step WSD run decays over its last 20% (6 steps): it leaves r1 at step 24
    assert (branch.parent, branch.branch_step, branch.config.train.steps) == ("r1-s3", 24, 30)
    assert trunk.config.train.checkpoint_every == 2  # gcd(24, 40 // 4): both are saved
    assert trunk.config.train.keep_checkpoints == 21 and trunk.config.train.eval_every == 10
    assert [r.name for r in spec.lr_runs] == ["r0-lr0.5", "r0-lr2"]
    assert spec.lr_runs[1].config.optim.lr == pytest.approx(2 * spec.rungs[0].config.optim.lr)
    assert spec.target.seed == 3


def test_spec_rejects_branches_outside_the_stable_phase(tmp_path):
    raw = spec_raw(tmp_path)
    raw["rungs"][2]["branches"] = [90]  # longer than the rung itself
    with pytest.raises(ConfigError, match=r"rungs\[2\] \(r2\).branches: a 90-step branch"):
        spec_from_dict(raw, "demo")
    raw["rungs"][2]["branches"] = [3]  # its decay would start inside warmup
    with pytest.raises(ConfigError, match="after warmup"):
        spec_from_dict(raw, "demo")
    raw["rungs"][2]["branches"] = "40"
    with pytest.raises(ConfigError, match="list of integers"):
        spec_from_dict(raw, "demo")


def test_spec_rejects_a_target_inside_the_range_or_too_close(tmp_path):
    raw = spec_raw(tmp_path)
    raw["target"] = {"name": "big", "train": {"steps": 30}}
    with pytest.raises(ConfigError, match=r"target \(big\).*only 0.\d\dx"):
        spec_from_dict(raw, "demo")
    raw["target"] = {"name": "big", "train": {"steps": 160}}
    with pytest.raises(ConfigError, match=r"target \(big\).*only 2.00x.*at least 8x"):
        spec_from_dict(raw, "demo")


def test_spec_errors_name_the_rung_and_field(tmp_path):
    raw = spec_raw(tmp_path)
    raw["rungs"][1]["model"] = {"d_modle": 64}
    with pytest.raises(ConfigError, match=r"rungs\[1\] \(r1\): model: unknown key.*d_modle"):
        spec_from_dict(raw, "demo")
    with pytest.raises(ConfigError, match="at least 3 distinct points"):
        spec_from_dict(spec_raw(tmp_path, steps=(20, 40)), "demo")
    raw = spec_raw(tmp_path)
    raw["rungs"][2]["name"] = "r0"
    with pytest.raises(ConfigError, match=r"names \['r0'\] are used twice"):
        spec_from_dict(raw, "demo")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rung'\]"):
        spec_from_dict({**spec_raw(tmp_path), "rung": []}, "demo")


# -------------------------------------------------------------- pre-registration


def test_preregistration_is_written_once_and_edits_are_detected(tmp_path):
    path = tmp_path / prereg.PREREG_FILE
    record = {"kind": prereg.KIND, "prediction": {"value": 3.0}, "rungs": [],
              "target": {"name": "big", "config_sha256": "abc"}}
    assert prereg.write_once(path, record)
    assert not prereg.write_once(path, {**record, "prediction": {"value": 2.0}})
    assert prereg.read(path)["prediction"]["value"] == 3.0
    prereg.check_matches(prereg.read(path), path, {"big": "abc"})
    with pytest.raises(UserError, match=r"other configs.*big"):
        prereg.check_matches(prereg.read(path), path, {"big": "abd"})
    path.chmod(0o644)
    edited = json.loads(path.read_text())
    edited["prediction"]["value"] = 2.5
    path.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="edited after it was written"):
        prereg.read(path)


def test_code_version_is_the_code_the_process_imported(monkeypatch):
    """A ladder runs for half an hour or more; a commit made meanwhile is not the code that
    decides its pre-registration, so the record names the commit at import and, when the
    tree has moved since, the commit it is at now beside it (`changed_since`)."""
    at_import = {"commit": "a" * 40, "dirty": False}
    monkeypatch.setattr(prereg, "_AT_IMPORT", at_import)
    monkeypatch.setattr(prereg, "_git_version", lambda: dict(at_import))
    assert prereg.code_version() == at_import
    moved = {"commit": "b" * 40, "dirty": True}
    monkeypatch.setattr(prereg, "_git_version", lambda: dict(moved))
    assert prereg.code_version() == {**at_import, "changed_since": moved}


def test_the_report_says_when_a_law_is_not_identified_by_its_points():
    """repetition_v7's kept report: its Chinchilla fit on rungs at two token counts has a
    Jacobian condition number of 7e16 (E, B and b trade off exactly), which report.md
    states; its curve law (condition 1e2) is not named."""
    from pathlib import Path

    from moelab.ladder.report import markdown

    kept = Path(__file__).resolve().parents[1] / "bench" / "results" / "ladder_repetition"
    report = json.loads((kept / "repetition_v7" / "report.json").read_text())
    assert report["fits"]["chinchilla"]["unidentified"]
    text = markdown(report)
    assert "chinchilla: not identified by the points (its Jacobian's condition number 6.6e+16" \
        in text
    assert "curve: not identified" not in text
