"""The repetition law that can rise (moelab.ladder.overfit), on synthetic rungs only."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import tiny_config

from moelab.config import ConfigError
from moelab.errors import UserError
from moelab.ladder import repetition
from moelab.ladder.fit import FitError
from moelab.ladder.overfit import fit_overfit
from moelab.ladder.predict import forecast, interval_refusal
from moelab.ladder.report import _repetition_lines
from moelab.ladder.results import RunResult
from moelab.ladder.spec import spec_from_dict

TRUE = {"E": 1.8, "A": 1.2, "a": 0.35, "B": 1.5, "b": 0.3, "P": 0.04, "r": 1.1, "s": 0.6}
NOISE = 0.004  # nats per run, about the seed sd the ladder measures on its rungs


def _runs(seed: int = 0):
    """Muennighoff's design: 4 widths, each on 2 fixed unique subsets for 1..16 passes."""
    n, u, r = (np.array(v, float).ravel() for v in np.meshgrid(
        [1e6, 2e6, 4e6, 8e6], [2e6, 8e6], [1, 2, 4, 8, 16], indexing="ij"))
    d = u * r
    t = TRUE
    q = (n / u) / (n / u).min()
    loss = (t["E"] + t["A"] * (n / n.min()) ** -t["a"] + t["B"] * (d / d.min()) ** -t["b"]
            + t["P"] * np.maximum(r - 1, 0) ** t["r"] * q ** t["s"])
    rng = np.random.default_rng(seed)
    return n, d, r, loss + NOISE * rng.standard_normal(len(loss))


def test_recovers_the_penalty_within_its_interval_and_rises_where_muennighoff_cannot():
    n, d, r, loss = _runs()
    fit = fit_overfit(n, d, r, loss)
    # a 90% interval covers the true P in 9 of 10 noise draws; this seed is one draw
    assert fit.P_interval[0] <= TRUE["P"] <= fit.P_interval[1]
    assert fit.P_interval[1] / fit.P_interval[0] < 3  # 40 runs pin it, not just bound it
    assert fit.rmse < 2 * NOISE  # the law describes the points down to their noise
    # the smallest width on the largest ratio turns up with passes: the fit says so too
    small = (n == n.min()) & (d / r == 2e6)
    assert np.argmin(loss[small]) < small.sum() - 1  # the data turn up
    curve = fit.predict(n[small], d[small], r[small])
    assert curve[-1] > curve.min() + 5 * NOISE
    # Muennighoff's decay only discounts repeats: its loss never rises with passes, so its
    # residual stays far above the noise the rising law reaches
    assert fit.muennighoff["rmse"] > 3 * fit.rmse
    iv = fit.interval(float(n[0]), float(d[-1]), 16.0)
    assert iv["low"] < iv["value"] < iv["high"]


def test_refuses_points_without_repetition():
    n, d, r, loss = _runs()
    once = r == 1
    with pytest.raises(FitError, match="two or more pass counts above 1"):
        fit_overfit(n[once], d[once], r[once], loss[once])


def _measuring_spec(tmp_path, target_d=64, **fit):
    """Three widths (three, so E, A and a are pinned: fit.require_identified), each on a
    small unique subset U1 (100 steps' tokens) for 1..16 passes and on U2 (400 steps') for
    1..4: Muennighoff's design, 24 points; the target 16x the largest rung's compute."""
    base = tiny_config(tmp_path / "data", model={"n_layers": 1},
                       optim={"warmup_steps": 5}, train={"log_every": 1000})
    rungs, passes = [], {}
    for d in (16, 24, 32):
        for group, first, counts in (("a", 100, (1, 2, 4, 8, 16)), ("b", 400, (1, 2, 4))):
            for k in counts:
                name = f"w{d}-{group}{k}"
                rungs.append({"name": name, "model": {"d_model": d, "d_ff": d},
                              "train": {"steps": first * k}})
                passes[name] = float(k)
    raw = {"base": base, "evals": 2, "rungs": rungs,
           "target": {"name": "big", "model": {"d_model": target_d, "d_ff": target_d},
                      "train": {"steps": 6400}},
           "fit": {"bootstrap": 20, "noise_sd": NOISE, "repetition": "measured", **fit}}
    passes["big"] = 6.0
    return spec_from_dict(raw, "measured", tmp_path / "ladder"), passes


def _stub_repetition(monkeypatch, target: float, rungs: float) -> None:
    """runner.preregister's reads of the prepared corpus, stubbed for synthetic rungs: the
    repetition check passing with the target's and the rungs' most passes over one source,
    and the corpus's hash."""
    monkeypatch.setattr(repetition, "check", lambda spec: {
        "target_max": target, "target": {"prose": target}, "rungs_max": {"prose": rungs},
        "beyond_rungs": []})
    monkeypatch.setattr(repetition, "corpus",
                        lambda spec: {"path": "data", "content_sha256": "c0ffee"})


def _true_loss(n, d, r, n0, d0, q0):
    t = TRUE
    return (t["E"] + t["A"] * (n / n0) ** -t["a"] + t["B"] * (d / d0) ** -t["b"]
            + t["P"] * max(r - 1, 0) ** t["r"] * ((n * r / d) / q0) ** t["s"])


def _measured_results(spec, passes, misfit: float = 0.0):
    """Every rung's result on the true law plus its seed noise, and, with `misfit`, a
    swing of that fraction of the loss up and down from rung to rung (no law of N, D and R
    describes it)."""
    n = np.array([r.active_params for r in spec.rungs], float)
    d = np.array([r.tokens for r in spec.rungs], float)
    r = np.array([passes[x.name] for x in spec.rungs])
    scale = (n.min(), d.min(), (n * r / d).min())
    rng = np.random.default_rng(1)
    results = []
    for i, rung in enumerate(spec.rungs):
        loss = _true_loss(n[i], d[i], r[i], *scale) + NOISE * rng.standard_normal()
        loss *= 1 + misfit * (-1) ** i
        results.append(RunResult(rung.name, rung.point, rung.seed, rung.active_params,
                                 rung.total_params, rung.tokens, rung.compute, loss, {},
                                 [{"step": rung.config.train.steps, "loss": loss}]))
    return results, scale


def test_measured_repetition_is_the_preregistered_law(tmp_path, monkeypatch):
    """fit.repetition: measured: the pre-registration's prediction is the rising law fitted
    on the rungs' own passes (as moelab.data.passes counts them; here given per run), at
    the target's passes, with Muennighoff's R* fitted beside the published one."""
    spec, passes = _measuring_spec(tmp_path)
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    results, scale = _measured_results(spec, passes)
    record = forecast(spec, results, [])
    p, t = record["prediction"], spec.target
    assert p["law"] == "repetition" and record["laws"]["repetition"]["value"] == p["value"]
    # a 90% interval at the target covers the true law there (one noise draw)
    assert p["low"] <= _true_loss(t.active_params, t.tokens, 6.0, *scale) <= p["high"]
    measured = record["repetition"]["measured"]
    assert measured["P_interval"]["low"] <= TRUE["P"] <= measured["P_interval"]["high"]
    assert measured["muennighoff"]["published_r_star"] == pytest.approx(15.39)
    assert measured["muennighoff"]["r_star"] > 0 and record["repetition"]["target_passes"] == 6
    # seed noise of 0.004 nats on losses of ~3.5 nats: the law fits to ~0.1%, far inside
    # the 2% cap
    assert measured["relative_rmse"] < 0.01
    # the record is written as JSON; the report sets the measured cost beside the published
    (line,) = _repetition_lines(json.loads(json.dumps(record))["repetition"]["measured"])
    assert "published 15.39" in line and f"P {measured['P']:.4g}" in line


def test_measured_repetition_refuses_a_law_that_misses_its_own_rungs(tmp_path, monkeypatch):
    """Rungs swinging 5% up and down from one to the next: the law (8 parameters, smooth
    in N, D and R) cannot follow them, its residual sd is ~5% of the loss, past the 2% cap,
    so the pre-registration refuses in one line; with the cap raised it pre-registers."""
    spec, passes = _measuring_spec(tmp_path)
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    results, _ = _measured_results(spec, passes, misfit=0.05)
    with pytest.raises(FitError, match="fit.max_rung_residual 2.0%") as err:
        forecast(spec, results, [])
    assert "\n" not in str(err.value)
    # raised, it pre-registers (the 5% misfit also widens the interval past fit.precision,
    # which is checked next and lifted here too)
    loose, _ = _measuring_spec(tmp_path / "loose", max_rung_residual=0.2, precision=None)
    record = forecast(loose, results, [])
    assert 0.02 < record["repetition"]["measured"]["relative_rmse"] < 0.2
    with pytest.raises(ConfigError, match="fit.max_rung_residual: must be a fraction"):
        _measuring_spec(tmp_path / "bad", max_rung_residual=2)


def test_precision_refuses_an_interval_too_wide_to_hold_it():
    """A 90% interval of half-width h, read as a normal one, has sd h / 1.645 and even odds
    within 0.674 sd: the odds of landing within 2% are even at h = 2% x 1.645 / 0.674 =
    4.88% of the value. repetition_v3's interval ([3.38, 4.58] around 3.978, +-15%) gives
    even odds only within 6.2%, so it is refused in one line; 4.8% passes, 5.0% does not."""
    v3 = {"value": 3.9782, "low": 3.3799, "high": 4.5764}
    reason = interval_refusal(v3, 0.9, 0.02)
    assert reason and "fit.precision 2.0%" in reason and "\n" not in reason
    assert "within 6.2%" in reason
    at = {"value": 3.0, "low": 3.0 * (1 - 0.048), "high": 3.0 * (1 + 0.01)}
    assert interval_refusal(at, 0.9, 0.02) is None
    assert interval_refusal({**at, "high": 3.0 * 1.05}, 0.9, 0.02)  # the larger side counts
    assert interval_refusal(v3, 0.9, None) is None
    assert interval_refusal(v3, 0.9, 0.07) is None
    # fit.precision_odds 0.9 with a 90% interval: sd h / 1.645, 90% within 1.645 sd, so
    # the half-width itself must be under 2%: 1.9% passes, 2.1% is refused naming the odds
    strict = {"value": 3.0, "low": 3.0 * (1 - 0.019), "high": 3.0 * (1 + 0.01)}
    assert interval_refusal(strict, 0.9, 0.02, odds=0.9) is None
    reason = interval_refusal({**strict, "low": 3.0 * (1 - 0.021)}, 0.9, 0.02, odds=0.9)
    assert reason and "within 2.1% only at 90% odds" in reason
    assert interval_refusal({**strict, "low": 3.0 * (1 - 0.021)}, 0.9, 0.02) is None


def test_measured_repetition_refuses_by_its_own_interval(tmp_path, monkeypatch):
    """Through the pre-registration: the law fitted on 16 noisy rungs has an interval at its
    target of some width; a precision below what it gives refuses in one line naming
    fit.precision, and null pre-registers the same record."""
    spec, passes = _measuring_spec(tmp_path)
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    results, _ = _measured_results(spec, passes)
    record = forecast(spec, results, [])  # the default 2%: this interval is narrow enough
    p = record["prediction"]
    half = max(p["high"] - p["value"], p["value"] - p["low"]) / p["value"]
    tight, _ = _measuring_spec(tmp_path / "tight", precision=half / 10)
    with pytest.raises(FitError, match="fit.precision") as err:
        forecast(tight, results, [])
    assert "\n" not in str(err.value)
    off, _ = _measuring_spec(tmp_path / "off", precision=None)
    assert forecast(off, results, [])["prediction"]["value"] == p["value"]
    with pytest.raises(ConfigError, match="fit.precision: must be a fraction"):
        _measuring_spec(tmp_path / "bad", precision=2)
    for odds in (0, 1, True, "high"):
        with pytest.raises(ConfigError, match="fit.precision_odds: must be a probability"):
            _measuring_spec(tmp_path / "bad-odds", precision_odds=odds)
    # fit.precision at 0.7 of the half-width: even odds lie within 0.41 of it (0.674 /
    # 1.645), so it pre-registers; 90% odds need the whole half-width, so it is refused
    even, _ = _measuring_spec(tmp_path / "even", precision=0.7 * half, precision_odds=0.5)
    assert forecast(even, results, [])["prediction"]["value"] == p["value"]
    strict, _ = _measuring_spec(tmp_path / "strict", precision=0.7 * half)  # 0.9: default
    with pytest.raises(FitError, match="at 90% odds"):
        forecast(strict, results, [])


def test_a_measured_spec_defaults_to_the_form_error_term_and_ninety_percent_odds(tmp_path):
    """fit.repetition: measured turns on fit.misspecification and fit.precision_odds 0.9
    unless the spec sets them; other specs, and FitOptions as records rebuild it, keep
    the old defaults (off, even odds)."""
    from moelab.ladder.spec import FitOptions

    spec, _ = _measuring_spec(tmp_path)
    assert spec.fit.misspecification is True and spec.fit.precision_odds == 0.9
    own, _ = _measuring_spec(tmp_path / "own", misspecification=False, precision_odds=0.6)
    assert own.fit.misspecification is False and own.fit.precision_odds == 0.6
    other, _ = _measuring_spec(tmp_path / "other", repetition="muennighoff")
    assert other.fit.misspecification is False and other.fit.precision_odds == 0.5
    assert FitOptions(repetition="measured").misspecification is False


def test_ladder_plan_states_the_bar_a_measured_spec_will_be_held_to(tmp_path, capsys):
    """Before any rung trains, `ladder plan` says what the pre-registration will need."""
    from moelab.ladder.cli import _print_measured

    spec, _ = _measuring_spec(tmp_path)
    _print_measured(spec)
    line = capsys.readouterr().out
    assert "widened by its error in form" in line and "90% odds of landing within 2.0%" in line
    assert "within 2.0% of its rungs" in line and "(fit.require_identified)" in line
    loose, _ = _measuring_spec(tmp_path / "loose", precision=None, max_rung_residual=None,
                               require_identified=False)
    _print_measured(loose)
    other, _ = _measuring_spec(tmp_path / "other", repetition="muennighoff")
    _print_measured(other)
    assert capsys.readouterr().out == ""


def test_a_refused_preregistration_keeps_its_reason_and_rungs(tmp_path, monkeypatch):
    """A refusal is a ladder's result: `ladder run` writes <out>/refusal.json with the
    one-line reason and the rung losses it was decided on (a fresh checkout has no runs/,
    so without it a refused spec leaves nothing to show), and `ladder report` names it."""
    from moelab.ladder import prereg, runner

    spec, passes = _measuring_spec(tmp_path)
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    _stub_repetition(monkeypatch, 6.0, 16.0)
    results, _ = _measured_results(spec, passes)
    tight = dataclasses.replace(spec, fit=dataclasses.replace(spec.fit, precision=1e-4))
    with pytest.raises(FitError, match="fit.precision") as err:
        runner.preregister(tight, results, [])
    kept = json.loads((spec.out / prereg.REFUSAL_FILE).read_text())
    assert kept["kind"] == prereg.REFUSAL_KIND and kept["reason"] == str(err.value)
    assert [r["final_val_loss"] for r in kept["rungs"]] == [r.final_val_loss for r in results]
    assert kept["fit_options"]["precision"] == 1e-4 and kept["corpus"]["content_sha256"]
    # what the check computed: the interval it refused and the law behind it
    low, value = kept["detail"]["interval"]["low"], kept["detail"]["value"]
    assert low < value and f"{value:.4g}" in kept["reason"]
    assert kept["detail"]["fit"]["n"] == len(results)
    readable = (spec.out / prereg.REFUSAL_MD).read_text()
    assert str(err.value) in readable and f"{value:.4f}" in readable
    assert readable.count("| w") == len(results)  # every rung's row
    assert not (spec.out / prereg.PREREG_FILE).exists()
    with pytest.raises(UserError, match="the target was refused .*fit.precision"):
        runner.read_preregistration(tight)
    with pytest.raises(FitError):  # refused again on the same rungs: decided when first
        runner.preregister(tight, results, [])
    again = json.loads((spec.out / prereg.REFUSAL_FILE).read_text())
    assert again["created_at"] == kept["created_at"]
    # a spec that lifts the check pre-registers; the refusal stays as what was refused first
    record = runner.preregister(spec, results, [])
    assert record["prediction"]["law"] == "repetition"
    assert (spec.out / prereg.REFUSAL_FILE).is_file()
    # a refusal damaged by hand: one line, not a traceback, from `ladder report`
    (spec.out / prereg.PREREG_FILE).unlink()
    (spec.out / prereg.REFUSAL_FILE).write_text('{"reason": "cut sho')
    with pytest.raises(UserError, match="cannot be read .*JSONDecodeError"):
        runner.read_preregistration(tight)


def test_measured_repetition_needs_enough_rungs_and_repeating_rungs(tmp_path):
    raw = {"base": tiny_config(tmp_path / "data"),
           "rungs": [{"train": {"steps": s}} for s in (10, 20, 40)],
           "target": {"train": {"steps": 400}}, "fit": {"repetition": "measured"}}
    with pytest.raises(ConfigError, match="needs as many rung points, got 3"):
        spec_from_dict(raw, "few", tmp_path / "ladder")
    raw["rungs"] += [{"train": {"steps": s}} for s in (80, 160, 320, 640, 1280)]
    raw["target"]["train"]["steps"] = 40000
    raw["rungs"][0]["data"] = {"path": str(tmp_path / "small")}
    with pytest.raises(ConfigError, match="must share its corpus"):
        spec_from_dict(raw, "other-corpus", tmp_path / "ladder")
    raw["fit"]["repetition"] = "decay"
    with pytest.raises(ConfigError, match="fit.repetition: 'decay' is not one of"):
        spec_from_dict(raw, "bad", tmp_path / "ladder")
    once = {"beyond_rungs": [], "accepted": False, "measured": True, "rung_passes": [4.0]}
    assert "at 1 pass count(s) above 1" in repetition.refusal(once)
    assert repetition.refusal({**once, "rung_passes": [2.0, 4.0]}) is None


def test_measured_repetition_refuses_a_target_past_the_rungs_params_per_unique(
        tmp_path, monkeypatch):
    """N/U (active parameters per unique token, U = D / R) is what the penalty grows with:
    a target much wider than the repeating rungs at the same passes sits past their N/U,
    where the law would extrapolate its exponent; one inside their N/U is not refused."""
    for target_d, refused in ((64, False), (256, True)):
        spec, passes = _measuring_spec(tmp_path / str(target_d), target_d=target_d)
        monkeypatch.setattr(repetition, "run_passes",
                            lambda rung, p=passes: [{"cumulative": {"prose": p[rung.name]}}])
        rep = repetition.repetition(spec)
        # by hand: the largest N/U among rungs past one pass is d_model 32's at 16 passes
        w32 = next(r for r in spec.rungs if r.name == "w32-a16")
        ratio = rep["params_per_unique"]
        assert ratio["rungs_max"] == pytest.approx(w32.active_params * 16 / w32.tokens)
        target = spec.target.active_params * 6.0 / spec.target.tokens
        assert ratio["target"] == pytest.approx(target)
        reason = repetition.refusal(rep)
        assert (reason is not None) == refused, (target_d, ratio)
        if refused:
            assert "N/U" in reason and f"{target:.3g}" in reason and "\n" not in reason
            assert repetition.refusal({**rep, "accepted": True}) is None


def test_misspecification_widens_the_measured_law_by_its_error_in_form(tmp_path,
                                                                       monkeypatch):
    """fit.misspecification with repetition: measured. Rungs and target on a law the
    repetition law cannot express, its loss scaled by 1 + 0.2% ln(C / C_min)^2 (a drift
    that curves in ln C; a linear one the law's exponents absorb, and with the rungs at
    three widths its delta-method interval then covers the target already): at the
    target, ~16x past the top rung, the law fitted on the rungs misses by ~1.7%, outside
    the delta-method interval (parameter noise of 24 rungs at 0.004 nats). Refitted
    without its top or bottom compute level, the law misses those by an error that grows
    with distance; that rate, times the target's distance in ln C, widens the interval to
    cover the target. On the law's own form the rate is several times smaller."""
    spec, passes = _measuring_spec(tmp_path, misspecification=True, precision=None)
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    results, scale = _measured_results(spec, passes)
    c0 = min(r.compute for r in spec.rungs)

    def drifting(k: float):
        out = []
        for r in results:
            loss = r.final_val_loss * (1 + k * np.log(r.compute / c0) ** 2)
            out.append(dataclasses.replace(r, final_val_loss=loss,
                                           curve=[{"step": 1, "loss": loss}]))
        return forecast(spec, out, [])["laws"]["repetition"]

    t = spec.target
    truth = (_true_loss(t.active_params, t.tokens, 6.0, *scale)
             * (1 + 0.002 * np.log(t.compute / c0) ** 2))
    law = drifting(0.002)
    seed, wide = law["interval_seed"], law["interval"]
    assert not seed["low"] <= truth <= seed["high"]  # the form error, outside
    assert wide["low"] <= truth <= wide["high"]  # covered once it is counted
    term = law["misspecification"]
    assert term["distance_ln_compute"] == pytest.approx(
        np.log(t.compute / max(r.compute for r in spec.rungs)))
    assert {x["level"] for x in term["terms"]} == {0, max(b["level"] for b in law["backtest"])}
    # the rungs on the law's own form: its extrapolating refits miss by their noise only
    assert drifting(0.0)["misspecification"]["rate_per_ln_compute"] < \
        term["rate_per_ln_compute"] / 3


def test_a_measured_spec_on_prefix_subsets_is_refused(tmp_path, monkeypatch):
    """Runs on the first data.unique_tokens of a source (a prefix, narrower than the
    corpus) refuse a measured spec in one line before any rung trains; spread subsets, a
    spec that does not measure repetition, or fit.accept_repetition do not."""
    spec, passes = _measuring_spec(tmp_path)
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    assert repetition.refusal(repetition.repetition(spec)) is None  # no subsets

    def with_subsets(sample: str, measured: str = "measured", accept: bool = False):
        subset, _ = _measuring_spec(tmp_path / sample / measured / str(accept),
                                    repetition=measured, accept_repetition=accept)
        runs = [dataclasses.replace(r, config=dataclasses.replace(
            r.config, data=dataclasses.replace(r.config.data, unique_tokens={"prose": 1000},
                                               unique_sample=sample)))
                for r in subset.rungs]
        return repetition.repetition(dataclasses.replace(subset, rungs=runs))

    prefix = with_subsets("first")
    line = repetition.refusal(prefix)
    assert line and "24 run(s)" in line and "unique_sample: spread" in line
    assert "\n" not in line
    monkeypatch.setattr(repetition, "repetition", lambda spec: prefix)
    with pytest.raises(UserError, match="on prefix subsets"):
        repetition.check(spec)  # what `ladder run` calls before any rung trains
    monkeypatch.undo()
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])
    assert repetition.prefix_refusal(with_subsets("spread")) is None
    assert repetition.prefix_refusal(with_subsets("first", "muennighoff")) is None
    assert repetition.prefix_refusal(with_subsets("first", accept=True)) is None


def test_rungs_at_two_token_counts_are_refused_before_they_train_and_after(tmp_path,
                                                                          monkeypatch):
    """fit.require_identified (a measured spec's default): with the rungs at two token
    counts, E, B and b of the data term meet two values and trade off exactly. `ladder
    plan` and `ladder run` refuse the spec before any rung trains; and a fit of such rungs
    (there the check before training switched off) finds the flat direction and refuses
    the target, which moves along it, while a rung does not. Three token counts pass both."""
    passes: dict[str, float] = {"big": 3.0}
    monkeypatch.setattr(repetition, "run_passes",
                        lambda rung: [{"cumulative": {"prose": passes[rung.name]}}])

    def spec_at(combos, name: str, **fit):
        """Three widths, each at every (steps, passes) of `combos` (v5's design in small:
        passes on smaller unique subsets at the same steps)."""
        base = tiny_config(tmp_path / "data", model={"n_layers": 1},
                           optim={"warmup_steps": 5}, train={"log_every": 1000})
        rungs = []
        for d in (16, 24, 32):
            for steps, k in combos:
                rung = f"w{d}-t{steps}-p{k}"
                rungs.append({"name": rung, "model": {"d_model": d, "d_ff": d},
                              "train": {"steps": steps}})
                passes[rung] = float(k)
        raw = {"base": base, "evals": 2, "rungs": rungs,
               "target": {"name": "big", "model": {"d_model": 64, "d_ff": 64},
                          "train": {"steps": 4000}},
               "fit": {"bootstrap": 20, "noise_sd": NOISE, "repetition": "measured",
                       "precision": None, **fit}}
        return spec_from_dict(raw, name, tmp_path / name)

    v5_like = ((200, 1), (400, 1), (200, 2), (400, 2), (400, 4))
    flat = spec_at(v5_like, "flat")
    line = repetition.refusal(repetition.repetition(flat))
    assert line and "B (D/D0)^-b" in line and "E, B and b" in line and "\n" not in line
    assert f"{flat.rungs[0].tokens:,}" in line and "fit.require_identified: false" in line
    with pytest.raises(UserError, match="trade off exactly"):
        repetition.check(flat)  # what `ladder run` calls before any rung trains
    three = spec_at((*v5_like, (800, 1), (800, 2)), "three")
    assert repetition.refusal(repetition.repetition(three)) is None

    # after the fit: the same two-count rungs, the check before training off
    loose = spec_at(v5_like, "loose", require_identified=False)
    assert repetition.refusal(repetition.repetition(loose)) is None
    results, _ = _measured_results(loose, passes)
    forecast(loose, results, [])  # pre-registers: nothing checks
    held = dataclasses.replace(loose, fit=dataclasses.replace(loose.fit,
                                                              require_identified=True))
    with pytest.raises(FitError, match="do not pin the repetition law") as err:
        forecast(held, results, [])
    pin = err.value.detail["fit"]["unpinned_at_target"]
    assert pin["shift"] > 1e-3 and {"E", "B"} <= set(pin["parameters"])
    from moelab.ladder import prereg, runner  # the refusal as `ladder run` keeps it
    _stub_repetition(monkeypatch, 3.0, 4.0)
    with pytest.raises(FitError):
        runner.preregister(held, results, [])
    readable = (held.out / prereg.REFUSAL_MD).read_text()
    assert f"moves the target's by {pin['shift']:.2%} per unit step" in readable
    # the fit itself: one flat direction, which moves the target but no rung
    rows = [(x.active_params, x.tokens, passes[x.name], res.final_val_loss)
            for x, res in zip(loose.rungs, results, strict=True)]
    n, d, r, y = (np.array(v, float) for v in zip(*rows, strict=True))
    fit = fit_overfit(n, d, r, y)
    assert len(fit.null_space) == 1
    assert fit.unpinned(n[0], d[0], r[0])["shift"] < 1e-6  # a rung: flat by construction
    t = loose.target
    assert fit.unpinned(t.active_params, t.tokens, 3.0)["shift"] > 1e-3
    # three token counts: nothing flat, the target pre-registers with the check on
    results3, _ = _measured_results(three, passes)
    record = forecast(three, results3, [])
    assert record["laws"]["repetition"]["fit"]["unpinned_at_target"]["shift"] == 0.0


def test_ladder_run_notes_a_preregistered_law_its_rungs_do_not_identify(tmp_path, monkeypatch,
                                                                        capsys):
    """Rungs at two token counts under the Chinchilla law (no measured repetition): its E,
    B and b trade off exactly, and `ladder run` says so beside the value it pre-registers
    (the record's fit holds the condition number)."""
    from moelab.ladder import runner

    base = tiny_config(tmp_path / "data", model={"n_layers": 1},
                       optim={"warmup_steps": 5}, train={"log_every": 1000})
    rungs = [{"name": f"w{d}-t{steps}", "model": {"d_model": d, "d_ff": d},
              "train": {"steps": steps}} for d in (16, 24, 32) for steps in (200, 400)]
    raw = {"base": base, "evals": 2, "rungs": rungs,
           "target": {"name": "big", "model": {"d_model": 64, "d_ff": 64},
                      "train": {"steps": 4000}},
           "fit": {"bootstrap": 20, "noise_sd": NOISE, "repetition": "none"}}
    spec = spec_from_dict(raw, "flat", tmp_path / "flat")
    passes = {r.name: 1.0 for r in spec.runs()}
    _stub_repetition(monkeypatch, 1.0, 1.0)
    results, _ = _measured_results(spec, passes)
    record = runner.preregister(spec, results, [])
    fit = record["laws"]["chinchilla"]["fit"]
    assert record["prediction"]["law"] == "chinchilla" and fit["unidentified"]
    out = capsys.readouterr().out
    assert f"law chinchilla is not identified by the rungs (its Jacobian's condition number " \
           f"{fit['condition']:.2g})" in out
