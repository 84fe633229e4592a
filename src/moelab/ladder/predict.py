"""From the rungs' results to everything the pre-registration states about the target.

- points: replicates of one (N, D) averaged; their spread pooled into the per-run seed sd.
- the final loss from three laws: L(N, D) (Chinchilla approach 3), L(C) on the IsoFLOP
  minima, and the schedule-aware curve law at the target's last step; `fit.law` names the
  one whose value is *the* prediction. Each gets a parametric-bootstrap interval from the
  measured seed noise (the target's own included) and a leave-one-compute-level-out
  backtest; parameters that end on a bound are flagged.
- the whole curve: the curve law (fit.curve_law) at each of the target's evaluation
  steps, with intervals.
- a staged target (`stages:`): the loss at the end of every stage, each with its interval
  (`_stage_forecasts`): the same laws fitted on the rungs' losses at their end of that
  stage, and the curve law at that step.
- stability: the rungs' late grad norm and output log-normalizer vs compute, extrapolated
  to the target and compared with GRAD_NORM_LIMIT.
- the learning-rate check: each probed rung's loss at lr * factor beside its own lr.
`compare` then scores a finished target against the record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import scipy.stats

from moelab.errors import UserError
from moelab.ladder import misspec
from moelab.ladder.curve import REPEAT_DECAY, effective_tokens, schedule_areas
from moelab.ladder.fit import (
    FitError,
    chinchilla_theta,
    compute_levels,
    curve_theta,
    fit_chinchilla,
    fit_curve,
    fit_power_law,
    isoflop_minima,
    parametric_interval,
    power_law_refit,
)
from moelab.ladder.overfit import fit_overfit
from moelab.ladder.repetition import most_passes
from moelab.ladder.results import METRICS, RunResult
from moelab.ladder.spec import LadderSpec, Rung
from moelab.train.metrics import flops_per_token

GRAD_NORM_LIMIT = 4.0  # the public record's long ladder runs passed it before logit z-loss
SECONDARY_BOOTSTRAP = 200  # refits for the laws that are not the pre-registered one


def point_table(spec: LadderSpec, results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per (N, D) point: its replicates' final losses, mean and sd."""
    by_name = {r.name: r for r in results}
    rows = []
    for point, runs in spec.points().items():
        losses = [by_name[r.name].final_val_loss for r in runs]
        first = runs[0]
        rows.append({"point": point, "runs": [r.name for r in runs],
                     "seeds": [r.seed for r in runs], "losses": losses,
                     "mean": float(np.mean(losses)),
                     "sd": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
                     "active_params": first.active_params, "tokens": first.tokens,
                     "compute": first.compute, "branch_of": first.parent})
    return rows


def pooled_sd(groups: list[list[float]]) -> tuple[float | None, int]:
    """(sqrt of the dof-weighted mean variance over groups with >= 2 values, its dof)."""
    dof = sum(len(g) - 1 for g in groups if len(g) > 1)
    if dof == 0:
        return None, 0
    ss = sum(float(np.var(g, ddof=0)) * len(g) for g in groups if len(g) > 1)
    return math.sqrt(ss / dof), dof


def _curve_points(spec: LadderSpec, results: list[RunResult],
                  unique: float | None = None) -> dict[str, list]:
    """Every evaluation after warmup, averaged over a point's replicates: N, S1, S2, loss,
    and the replicates' values (for the per-evaluation noise)."""
    by_name = {r.name: r for r in results}
    out: dict[str, list] = {"n": [], "s1": [], "s2": [], "loss": [], "groups": [], "level": []}
    for runs in spec.points().values():
        cfg = runs[0].config
        s1, s2 = schedule_areas(cfg, unique)
        steps: dict[int, list[float]] = {}
        for r in runs:
            for e in by_name[r.name].curve:
                if e["step"] > cfg.optim.warmup_steps:
                    steps.setdefault(int(e["step"]), []).append(e["loss"])
        for step, losses in sorted(steps.items()):
            out["n"].append(runs[0].active_params)
            out["s1"].append(s1[step])
            out["s2"].append(s2[step])
            out["loss"].append(float(np.mean(losses)))
            out["groups"].append(losses)
            out["level"].append(runs[0].compute)
    return out


def _target_areas(target: Rung, unique: float | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The target's evaluation steps (as the trainer will score them) and S1, S2 there."""
    t = target.config.train
    ends = target.config.plan.starts()  # a stage's end is evaluated too
    steps = sorted({*range(t.eval_every, t.steps + 1, t.eval_every), *ends, t.steps})
    steps = [s for s in steps if s > target.config.optim.warmup_steps]
    s1, s2 = schedule_areas(target.config, unique)
    return np.array(steps), s1[steps], s2[steps]


def forecast(spec: LadderSpec, results: list[RunResult],
             lr_results: list[RunResult]) -> dict[str, Any]:
    """The pre-registration's content (all but bookkeeping): see the module docstring."""
    rows = point_table(spec, results)
    target, options = spec.target, spec.fit
    unique = _unique_tokens(spec)
    curve = _curve_points(spec, results, unique)
    seed_sd, dof = pooled_sd([r["losses"] for r in rows])
    eval_sd, eval_dof = pooled_sd(curve["groups"])
    if seed_sd is None:
        if options.noise_sd is None:
            raise FitError("the spec has no seed replicates (`seeds: [..]`) and no "
                           "fit.noise_sd, so the interval would have no measured noise; add "
                           "seeds, or state fit.noise_sd from an earlier measurement")
        seed_sd = eval_sd = options.noise_sd
    noise = {"seed_sd": seed_sd, "dof": dof, "eval_sd": eval_sd, "eval_dof": eval_dof,
             "source": ("pooled over the rungs' replicates" if dof else
                        "fit.noise_sd from the spec (no replicates)"),
             "target_sd": seed_sd,
             "target_sd_note": "the target's own seed noise is taken as the rungs' pooled sd "
                               "(seed noise fell with tokens trained in moelab's measurements, "
                               "so this is conservative for a longer target)"}
    n = np.array([r["active_params"] for r in rows], float)
    d = effective_tokens([r["tokens"] for r in rows], unique)
    c = np.array([r["compute"] for r in rows], float)
    y = np.array([r["mean"] for r in rows], float)
    point_sd = seed_sd / np.sqrt([len(r["losses"]) for r in rows])
    steps, t_s1, t_s2 = _target_areas(target, unique)
    target_at = (target.active_params, float(effective_tokens(target.tokens, unique)),
                 target.compute)
    laws = _endpoint_laws(options, n, d, c, y, point_sd, seed_sd, target_at)
    laws["curve"] = _curve_law(spec, curve, eval_sd, steps, t_s1, t_s2)
    law = misspec.choose(laws) if options.law == "backtest" else options.law
    if law != options.law:  # the stage ends follow the law chosen for the final
        spec = dataclasses.replace(spec, fit=dataclasses.replace(options, law=law))
    if "value" not in laws[law]:
        raise FitError(f"the pre-registered law {law!r} could not be fitted: "
                       f"{laws[law]['skipped']}")
    chosen = laws[law]
    prediction = {"value": chosen["value"], "low": chosen["interval"]["low"],
                  "high": chosen["interval"]["high"], "confidence": options.confidence,
                  "method": chosen["interval"]["method"], "law": law,
                  "at_bound": chosen["fit"].get("at_bound", []), "metric": METRICS[options.metric],
                  "compute": target.compute}
    out = {"prediction": prediction, "laws": laws, "points": rows, "noise": noise,
           "repetition": _repetition(spec, unique),
           "stability": _stability_forecast(spec, results),
           "lr_check": _lr_check(spec, results, lr_results),
           "fit_options": asdict(options)}
    if options.misspecification:
        out["law_choice"] = {
            "rule": ("the smallest misspecification rate in the rungs' extrapolating backtests"
                     if options.law == "backtest" else "named by fit.law"),
            "rates": {k: v["misspecification"].get("rate_per_ln_compute")
                      for k, v in laws.items() if "misspecification" in v},
            "chosen": law}
        out["coverage"] = chosen.get("misspecification", {}).get("coverage")
        out["prediction"]["laws_disagree"] = misspec.disagreement(laws, law)
    if target.config.plan.staged:
        out["stages"] = _stage_forecasts(spec, results, laws, unique,
                                         dict(zip(steps.tolist(), t_s1.tolist(), strict=True)))
        if options.stage_gain:  # the chain of stage gains is the final prediction
            last = out["stages"][-1]
            laws["gain"] = last["laws"]["gain"]
            out["prediction"] = {**prediction, "value": last["value"], "low": last["low"],
                                 "high": last["high"], "law": "gain", "at_bound": [],
                                 "method": laws["gain"]["interval"]["method"]}
    if options.repetition == "measured":  # the law fitted on the rungs' own repetition
        laws["repetition"] = measured = _measured_repetition(spec, rows, options)
        out["repetition"] = {**out["repetition"], "measured": measured["fit"],
                             "target_passes": measured["target_passes"]}
        iv = measured["interval"]
        out["prediction"] = {**out["prediction"], "value": measured["value"], "low": iv["low"],
                             "high": iv["high"], "law": "repetition", "at_bound": [],
                             "method": iv["method"]}
    return out


def rung_residual_refusal(relative: float, rmse: float, n: int, cap: float | None
                          ) -> str | None:
    """The one-line reason fit.max_rung_residual (`cap`) refuses a measured-repetition
    target whose law misses its own `n` rungs by a residual sd of `relative` of their mean
    loss, or None."""
    if cap is None or relative <= cap:
        return None
    return (f"the repetition law misses its own {n} rungs by a residual sd of "
            f"{relative:.1%} of their loss (rmse {rmse:.3g} nats), more than "
            f"fit.max_rung_residual {cap:.1%}: it does not describe how these "
            "rungs overfit, so its prediction at the target would not hold to "
            "that; train rungs closer to the target's passes and N/U, or raise "
            "fit.max_rung_residual to pre-register anyway")


# fit.require_identified: the most the target may move, as a fraction of its value, per
# unit step along a direction of the law's parameters that no rung's loss sees. The
# parameters are exponents, log amplitudes and E in nats, so a unit step is their natural
# scale and a flat direction lets them drift by several; at 1e-4 even 20 units move the
# target 0.2%, a tenth of the 2% it is held to (v5's rungs moved its target 3.7%)
UNPINNED_TOL = 1e-4


def unpinned_refusal(pin: dict[str, Any]) -> str | None:
    """The one-line reason fit.require_identified refuses a target that moves along a
    direction of the law's parameters its rungs leave flat (OverfitFit.unpinned), or None."""
    if pin["shift"] <= UNPINNED_TOL:
        return None
    return (f"the rungs do not pin the repetition law at the target: a direction of its "
            f"parameters (mostly {', '.join(pin['parameters'])}) changes no rung's loss but "
            f"moves the target's by {pin['shift']:.2%} per unit step, so its value there is "
            "set by where the fit stops; train rungs that vary what the target extrapolates "
            "in (a third token count, width or pass count), or set fit.require_identified: "
            "false to pre-register anyway")


def interval_refusal(interval: dict[str, float], confidence: float,
                     precision: float | None, odds: float = 0.5) -> str | None:
    """The one-line reason fit.precision refuses a measured-repetition target whose own
    `confidence` interval gives it less than `odds` (fit.precision_odds; 0.5, even odds,
    by default) of landing within `precision` of its value, or None. The interval is read
    as a normal one: its larger half-width over z((1 + confidence) / 2) is the sd, and a
    normal holds `odds` of its mass within z((1 + odds) / 2) sd of its centre."""
    if precision is None:
        return None
    value = interval["value"]
    half = max(interval["high"] - value, value - interval["low"]) / abs(value)
    z = float(scipy.stats.norm.ppf((1 + confidence) / 2))
    within = half / z * float(scipy.stats.norm.ppf((1 + odds) / 2))  # `odds` within this
    if within <= precision:
        return None
    at = "even odds" if odds == 0.5 else f"{odds:.0%} odds"
    return (f"the repetition law's own {confidence:.0%} interval at the target is "
            f"[{interval['low']:.4g}, {interval['high']:.4g}] around {value:.4g} "
            f"(+-{half:.1%}): by it the target lands within {within:.1%} only at {at}, "
            f"wider than fit.precision {precision:.1%}; train repeating rungs nearer the "
            "target's N, D and passes, or raise fit.precision to pre-register anyway")


def _measured_repetition(spec: LadderSpec, rows: list[dict[str, Any]], options
                         ) -> dict[str, Any]:
    """fit.repetition: measured. The law that can rise with passes (moelab.ladder.overfit)
    fitted to every point's (N, D, its largest passes over any source, mean loss), as the
    rungs' plans draw their corpora; its value and interval at the target, and beside it
    Muennighoff's decay fitted to the same points (its R* by the published 15.39). Raises
    FitError (the pre-registration refuses) when the law misses its own rungs by more than
    fit.max_rung_residual of their mean loss, or when its interval at the target is too
    wide for fit.precision."""
    runs = {r.name: r for r in spec.rungs}
    passes = [most_passes(runs[row["runs"][0]]) for row in rows]
    losses = [r["mean"] for r in rows]
    fit = fit_overfit([r["active_params"] for r in rows], [r["tokens"] for r in rows],
                      passes, losses, options.confidence)
    relative = fit.rmse / float(np.mean(losses))
    fitted = {**fit.to_dict(), "passes": passes, "relative_rmse": relative}
    reason = rung_residual_refusal(relative, fit.rmse, fit.n, options.max_rung_residual)
    if reason:
        raise FitError(reason, {"fit": fitted})
    target = spec.target
    target_passes = most_passes(target)
    at_target = (target.active_params, target.tokens, max(target_passes, 1e-9))
    if options.require_identified:
        fitted["unpinned_at_target"] = pin = fit.unpinned(*at_target)
        reason = unpinned_refusal(pin)
        if reason:
            raise FitError(reason, {"fit": fitted})
    iv = fit.interval(*at_target)
    out: dict[str, Any] = {"value": iv["value"], "interval": iv}
    if options.misspecification:  # the law's error in form, as its own backtests show it
        _widen_measured(out, rows, passes, spec.target.compute, relative, options.confidence)
    reason = interval_refusal(out["interval"], options.confidence, options.precision,
                              options.precision_odds)
    measured = {**out, "fit": fitted, "target_passes": target_passes}
    if reason:
        raise FitError(reason, measured)
    return measured


def _widen_measured(law: dict[str, Any], rows: list[dict[str, Any]], passes: list[float],
                    target_compute: float, point_rel_sd: float, confidence: float) -> None:
    """fit.misspecification with fit.repetition: measured. The delta-method interval counts
    the parameters' noise, not how wrong the law's form is away from its rungs; the law is
    refitted with each compute level of the rungs left out, and the extrapolating ones
    (the lowest and the highest level, predicted from the rest) give its error per ln C,
    which moelab.ladder.misspec adds in quadrature at the target's distance past the top
    level, as it does for the other laws. point_rel_sd: the law's residual sd over the
    rungs' mean loss (a held-out point's own noise, for the coverage)."""
    n, d, y, c = (np.array([row[k] for row in rows], float)
                  for k in ("active_params", "tokens", "mean", "compute"))
    r = np.asarray(passes, float)
    levels = compute_levels(c)

    def fit_predict(keep: np.ndarray) -> np.ndarray:
        refit = fit_overfit(n[keep], d[keep], r[keep], y[keep], confidence)
        return refit.predict(n[~keep], d[~keep], r[~keep])

    backtest = _backtest(levels, y, fit_predict)
    distance = math.log(target_compute / float(c.max()))
    misspec.widen(law, misspec.extrapolations(backtest, levels, c), distance, confidence,
                  point_rel_sd)
    law["backtest"] = backtest


def _endpoint_laws(options, n, d, c, y, point_sd, seed_sd, target_at) -> dict[str, Any]:
    """L(N, D) (approach 3) and L(C) on the IsoFLOP minima fitted to one loss per point
    (the final loss, or the loss at a stage's end), each with its parametric-bootstrap
    interval at the target and (L(N, D)) its leave-one-compute-level-out backtest."""
    tn, td, tc = target_at
    levels = compute_levels(c)
    laws: dict[str, Any] = {}

    def samples(name: str) -> int:
        return options.bootstrap if options.law in (name, "backtest") else min(
            options.bootstrap, SECONDARY_BOOTSTRAP)

    def bootstrap(name: str, refit, fitted, sd, value) -> dict:
        return parametric_interval(refit, fitted, sd, seed_sd, value, samples(name),
                                   options.confidence, options.seed).to_dict()

    try:
        nd = fit_chinchilla(n, d, y)
        start = chinchilla_theta(nd)

        def nd_refit(y_star):
            return float(fit_chinchilla(n, d, y_star, start).predict(tn, td))

        laws["chinchilla"] = {
            "fit": nd.to_dict(), "value": float(nd.predict(tn, td)),
            "interval": bootstrap("chinchilla", _safe(nd_refit), nd.predict(n, d), point_sd,
                                  float(nd.predict(tn, td))),
            "backtest": _backtest(levels, y, lambda m: fit_chinchilla(
                n[m], d[m], y[m], start).predict(n[~m], d[~m]))}
        if options.misspecification:
            top = np.log(c[levels == levels.max()]).mean()
            misspec.widen(laws["chinchilla"],
                          misspec.extrapolations(laws["chinchilla"]["backtest"], levels, c),
                          float(np.log(tc) - top), options.confidence,
                          float(seed_sd / np.mean(y)))
    except FitError as err:
        laws["chinchilla"] = {"skipped": str(err)}
    try:
        minima = isoflop_minima(c, y)
        pc = fit_power_law(c[minima], y[minima])
        laws["compute"] = {
            "fit": pc.to_dict(), "value": float(pc.predict(tc)), "points": minima,
            "interval": bootstrap("compute", power_law_refit(pc, c[minima], tc),
                                  pc.predict(c[minima]), point_sd[minima],
                                  float(pc.predict(tc)))}
    except FitError as err:
        laws["compute"] = {"skipped": str(err)}
    return laws


def _curve_law(spec: LadderSpec, curve: dict[str, list], eval_sd: float, steps: np.ndarray,
               t_s1: np.ndarray, t_s2: np.ndarray) -> dict[str, Any]:
    """The curve law (fit.curve_law) on every evaluation point, predicted at every target
    evaluation, with its bootstrap band, backtests and extrapolation checks."""
    options, target = spec.fit, spec.target
    tn, form = target.active_params, options.curve_law
    cn, cs1, cs2, cy = (np.array(curve[k], float) for k in ("n", "s1", "s2", "loss"))
    curve_sd = np.full(len(cy), eval_sd) / np.sqrt([len(g) for g in curve["groups"]])
    curve_levels = compute_levels(np.array(curve["level"]))
    samples = options.bootstrap if options.law in ("curve", "backtest") else min(
        options.bootstrap, SECONDARY_BOOTSTRAP)
    try:
        cf = fit_curve(cn, cs1, cs2, cy, form=form)
        cstart = curve_theta(cf)
        path = cf.predict(tn, t_s1, t_s2)

        def curve_refit(y_star):
            return fit_curve(cn, cs1, cs2, y_star, cstart, form).predict(tn, t_s1, t_s2)

        band = _curve_band(_safe(curve_refit), cf.predict(cn, cs1, cs2), curve_sd, eval_sd,
                           samples, options.confidence, options.seed)
        per_step = target.config.data.batch_size * target.config.data.seq_len
        law = {
            "fit": cf.to_dict(), "value": float(path[-1]),
            "interval": {"low": min(float(band[0][-1]), float(path[-1])),
                         "high": max(float(band[1][-1]), float(path[-1])),
                         "confidence": options.confidence,
                         "method": "parametric bootstrap of the curve law: every evaluation "
                                   "point redrawn with the pooled per-evaluation seed sd "
                                   f"{eval_sd:.4f} / sqrt(replicates), the target's seed sd "
                                   "added"},
            "points": [{"step": int(s), "tokens": int(s) * per_step, "predicted": float(p),
                        "low": float(lo), "high": float(hi)}
                       for s, p, lo, hi in zip(steps, path, *band, strict=True)],
            "backtest": _backtest(curve_levels, cy, lambda m: fit_curve(
                cn[m], cs1[m], cs2[m], cy[m], cstart, form).predict(cn[~m], cs1[~m], cs2[~m])),
            "extrapolation": {**_curve_reach(cn, cs1, cs2, cy, cstart, t_s1, t_s2, form),
                              "epochs": _epochs(spec)}}
        if options.misspecification:
            levels_c = np.array(curve["level"])
            top = np.log(levels_c[curve_levels == curve_levels.max()]).mean()
            misspec.widen(law, misspec.extrapolations(law["backtest"], curve_levels, levels_c),
                          float(np.log(target.compute) - top), options.confidence,
                          float(eval_sd / np.mean(cy)))
        return law
    except FitError as err:
        return {"skipped": str(err)}


def _epochs(spec: LadderSpec) -> dict[str, float] | None:
    """How many passes over the training tokens the longest rung and the target make.
    Past one pass the laws count tokens at their repeated worth (fit.repetition); a target
    far past the rungs' passes still relies on the published decay, not a measured one."""
    from moelab.config import data_dir
    from moelab.data.loader import read_meta, restrict

    try:
        meta = restrict(read_meta(data_dir(spec.target.config.data.path)),
                        spec.target.config.data.unique_tokens)
    except (OSError, UserError):
        return None
    total = sum(meta["train_tokens"].values())
    return {"train_tokens": total, "rungs_max": max(r.tokens for r in spec.rungs) / total,
            "target": spec.target.tokens / total}


def _unique_tokens(spec: LadderSpec) -> float | None:
    """The corpus's distinct training tokens when fit.repetition counts repeats (None: it
    does not, or the data is not prepared yet, so nothing is discounted)."""
    if spec.fit.repetition == "none":
        return None
    epochs = _epochs(spec)
    return float(epochs["train_tokens"]) if epochs else None


def _repetition(spec: LadderSpec, unique: float | None) -> dict[str, Any]:
    """What the laws assumed about repeated tokens, for the record."""
    if unique is None:
        return {"law": "none", "why": "fit.repetition: none" if spec.fit.repetition == "none"
                else "no prepared data to count its tokens"}
    longest = max(spec.rungs, key=lambda r: r.tokens)
    return {"law": "muennighoff", "r_star": REPEAT_DECAY, "unique_tokens": unique,
            "target_tokens": spec.target.tokens,
            "target_effective_tokens": float(effective_tokens(spec.target.tokens, unique)),
            "longest_rung_tokens": longest.tokens,
            "longest_rung_effective_tokens": float(effective_tokens(longest.tokens, unique))}


def stage_ends(rung: Rung) -> list[tuple[int, str, int, int]]:
    """(index, name, end step, tokens trained by then) of each stage of a run's plan."""
    plan = rung.config.plan
    tokens = np.cumsum([0] + [plan.at(i).batch_size * plan.at(i).seq_len
                              for i in range(rung.config.train.steps)])
    return [(s.index, s.name, s.end, int(tokens[s.end])) for s in plan.stages]


def _loss_at(run: RunResult, rung: Rung, step: int, by_name: dict[str, RunResult]) -> float:
    """A run's whole-split loss after `step` updates: its own evaluation there, else (a
    cooldown branch, which trains only after its branch step) its parent's."""
    for source in (run, by_name.get(rung.parent or "")):
        hit = [e["loss"] for e in (source.curve if source else []) if e["step"] == step]
        if hit:
            return float(hit[-1])
    raise FitError(f"{rung.name} has no evaluation at step {step} (a stage's end); the "
                   "trainer evaluates every stage boundary: retrain it with this moelab")


def _stage_forecasts(spec: LadderSpec, results: list[RunResult], laws: dict[str, Any],
                     unique: float | None, target_s1: dict[int, float]
                     ) -> list[dict[str, Any]]:
    """The loss at the end of every stage of the target, each pre-registered.

    A stage that ends before the last is fitted on the rungs' losses at *their* end of that
    stage (every rung runs the plan at the same fractions of its steps): L(N, D) and L(C)
    on those losses, D the tokens trained by then, and the curve law at the target's step
    of that end. The last stage's end is the final loss: the laws above. The value is
    fit.law's, as for the final prediction; the others are reported beside it."""
    by_name = {r.name: r for r in results}
    curve_at = {pt["step"]: pt for pt in laws["curve"].get("points", [])}
    out = []
    for index, name, end, tokens in stage_ends(spec.target)[:-1]:
        rows = []
        for point, runs in spec.points().items():
            first_end = stage_ends(runs[0])[index]
            losses = [_loss_at(by_name[r.name], r, first_end[2], by_name) for r in runs]
            rows.append({"point": point, "losses": losses, "mean": float(np.mean(losses)),
                         "active_params": runs[0].active_params, "tokens": first_end[3],
                         "compute": flops_per_token(runs[0].config) * first_end[3]})
        sd, _ = pooled_sd([r["losses"] for r in rows])
        sd = sd if sd is not None else spec.fit.noise_sd
        n, c, y = (np.array([r[k] for r in rows], float)
                   for k in ("active_params", "compute", "mean"))
        d = effective_tokens([r["tokens"] for r in rows], unique)
        point_sd = sd / np.sqrt([len(r["losses"]) for r in rows])
        target_at = (spec.target.active_params, float(effective_tokens(tokens, unique)),
                     flops_per_token(spec.target.config) * tokens)
        stage_laws = _endpoint_laws(spec.fit, n, d, c, y, point_sd, sd, target_at)
        if end in curve_at:
            stage_laws["curve"] = _curve_at_stage_end(
                curve_at[end], target_s1[end], laws["curve"], spec.fit.confidence)
        else:
            stage_laws["curve"] = {"skipped": f"no curve-law point at step {end}"}
        out.append(_stage_entry(spec, index, name, end, tokens, stage_laws, sd, rows,
                                spec.fit.stage_law or spec.fit.law))
    index, name, end, tokens = stage_ends(spec.target)[-1]
    out.append(_stage_entry(spec, index, name, end, tokens, laws, None, None, spec.fit.law))
    if spec.fit.stage_gain:
        for k in range(1, len(out)):
            gain = _stage_gain(spec, results, k, out[k - 1])
            out[k]["laws"] = {**out[k]["laws"], "gain": gain}
            out[k] |= {"law": "gain", "value": gain["value"], "low": gain["interval"]["low"],
                       "high": gain["interval"]["high"]}
    return out


def stage_gain_rows(spec: LadderSpec, results: list[RunResult], k: int
                    ) -> list[dict[str, Any]]:
    """Per rung run: its loss at its own end of stage k-1 (`before`) and of stage k
    (`after`), the relative gain between them, ln N, ln D (tokens by the end of stage k),
    and whether it is a cooldown branch."""
    by_name = {r.name: r for r in results}
    rows = []
    for point, runs in spec.points().items():
        ends = stage_ends(runs[0])
        for r in runs:
            before = _loss_at(by_name[r.name], r, ends[k - 1][2], by_name)
            after = _loss_at(by_name[r.name], r, ends[k][2], by_name)
            rows.append({"run": r.name, "point": point, "branch": r.parent is not None,
                         "ln_n": math.log(r.active_params), "ln_d": math.log(ends[k][3]),
                         "before": before, "after": after, "gain": (before - after) / before})
    return rows


def _stage_gain(spec: LadderSpec, results: list[RunResult], k: int,
                previous: dict[str, Any]) -> dict[str, Any]:
    """The end of stage k (k >= 1) as the end of stage k-1 (its pre-registered value and
    interval) times one minus the stage's relative gain g = (L_{k-1} - L_k) / L_{k-1}.

    Every rung run measures g directly: its loss at its own end of stage k-1 and of stage k,
    at the same fractions of its steps as the target's. g is fitted by least squares as
    linear in ln N and ln D (D: the tokens trained by the end of stage k), one row per run,
    so the residual sd holds the seed noise of a run's gain; the target's g gets the
    Student-t prediction interval of a single new run. The two intervals combine in
    quadrature (the gain's noise is a run's own, independent of the previous stage's fit).
    Two rung-only backtests score the form: fitted on the branches, predicting the trunks
    (further in D), and fitted without the widest rung, predicting it (further in N)."""
    from scipy import stats

    rows = stage_gain_rows(spec, results, k)
    x = np.array([[1.0, row["ln_n"], row["ln_d"]] for row in rows])
    g = np.array([row["gain"] for row in rows])
    dof = len(g) - x.shape[1]
    if dof < 1 or np.linalg.matrix_rank(x) < x.shape[1]:
        raise FitError(f"stage {k}: the stage's gain needs rungs at two or more widths and "
                       f"token counts and more than 3 runs (has {len(g)})")
    beta = np.linalg.lstsq(x, g, rcond=None)[0]
    resid = g - x @ beta
    s = math.sqrt(float(resid @ resid) / dof)
    tokens = stage_ends(spec.target)[k][3]
    xt = np.array([1.0, math.log(spec.target.active_params), math.log(tokens)])
    gt = float(xt @ beta)
    t = float(stats.t.ppf((1 + spec.fit.confidence) / 2, dof))
    half = t * s * math.sqrt(1 + float(xt @ np.linalg.pinv(x.T @ x) @ xt))
    v0, lo0, hi0 = previous["value"], previous["low"], previous["high"]
    value = v0 * (1 - gt)
    low = value - math.hypot((1 - gt) * (v0 - lo0), v0 * half)
    high = value + math.hypot((1 - gt) * (hi0 - v0), v0 * half)

    def backtest(fit: np.ndarray) -> dict[str, Any]:
        scored = ~fit
        if not scored.any() or np.linalg.matrix_rank(x[fit]) < x.shape[1]:
            return {"skipped": "too few rungs on the fitted side to fit three coefficients"}
        b = np.linalg.lstsq(x[fit], g[fit], rcond=None)[0]
        err = x[scored] @ b - g[scored]  # error in g ~ minus the relative error of L_k
        return {"fit_runs": int(fit.sum()), "scored_runs": int(scored.sum()),
                "mean_abs_error": float(np.abs(err).mean()), "mean_error": float(err.mean())}

    branch = np.array([row["branch"] for row in rows])
    widest = x[:, 1] == x[:, 1].max()
    return {"value": value,
            "interval": {"low": low, "high": high, "confidence": spec.fit.confidence,
                         "method": f"stage {k - 1}'s interval times (1 - g) and the gain's "
                                   "Student-t prediction interval for one run, in quadrature"},
            "fit": {"formula": "g = (L_prev - L_end) / L_prev = c0 + c1 ln N + c2 ln D",
                    "coefficients": beta.tolist(), "residual_sd": s, "dof": dof, "runs": len(g)},
            "gain": {"predicted": gt, "half_width": half, "previous_stage_value": v0},
            "rung_backtests": {"branches_to_trunks": backtest(branch),
                               "narrow_to_widest": backtest(~widest)}}


def _curve_at_stage_end(pt: dict[str, Any], s1: float, curve: dict[str, Any],
                        confidence: float) -> dict[str, Any]:
    """The curve law at a stage's end. Its bootstrap band holds the seed noise only; a
    stage end whose S1 lies past every rung's also carries the law's own error when it
    extrapolates along S1, which the rungs measure (`s1_2x`: fitted on the points with S1
    up to half the rungs' largest, scored on the rest): the band is widened on both sides
    by that backtest's mean relative error (its bias, not its noise) times the value."""
    reach = curve.get("extrapolation", {})
    s1_2x = reach.get("backtests", {}).get("s1_2x", {})
    past = reach.get("rungs_s1_max") is not None and s1 > reach["rungs_s1_max"]
    widen = abs(s1_2x["mean_rel_error"]) * pt["predicted"] if (
        past and "mean_rel_error" in s1_2x) else 0.0
    method = curve["interval"]["method"] + (
        f"; widened by the s1_2x backtest's mean relative error "
        f"({s1_2x['mean_rel_error']:+.4f}) times the value, since the stage ends past the "
        "rungs' S1" if widen else "")
    return {"value": pt["predicted"], "fit": curve["fit"], "widened_by": widen,
            "interval": {"low": pt["low"] - widen, "high": pt["high"] + widen,
                         "confidence": confidence, "method": method}}


def _stage_entry(spec: LadderSpec, index: int, name: str, end: int, tokens: int,
                 laws: dict[str, Any], sd: float | None, rows: list | None,
                 law: str) -> dict[str, Any]:
    chosen = laws[law]
    if "value" not in chosen:
        raise FitError(f"stage {index} ({name or 'unnamed'}): the pre-registered law "
                       f"{law!r} could not be fitted at its end (step {end}): "
                       f"{chosen['skipped']}")
    return {"index": index, "name": name, "end_step": end, "tokens": tokens,
            "law": law, "value": chosen["value"], "low": chosen["interval"]["low"],
            "high": chosen["interval"]["high"], "confidence": spec.fit.confidence,
            "laws": laws if rows is not None else {k: {"value": v["value"],
                                                       "interval": v["interval"]}
                                                   for k, v in laws.items() if "value" in v},
            "seed_sd": sd, "points": rows}


def _safe(refit: Callable) -> Callable:
    """A refit that returns None instead of raising when a resample does not converge."""
    def run(y):
        try:
            return refit(y)
        except FitError:
            return None

    return run


def _curve_band(refit, fitted, sd, target_sd, samples, confidence, seed):
    rng = np.random.default_rng(seed)
    paths = [p for p in (refit(fitted + sd * rng.standard_normal(len(fitted)))
                         for _ in range(samples)) if p is not None]
    if len(paths) < samples / 2:
        raise FitError(f"only {len(paths)} of {samples} curve refits converged")
    paths = np.array(paths) + target_sd * rng.standard_normal((len(paths), 1))
    tail = (1 - confidence) / 2 * 100
    return np.percentile(paths, tail, axis=0), np.percentile(paths, 100 - tail, axis=0)


def _curve_reach(cn, cs1, cs2, cy, start, t_s1, t_s2, form: str = "q") -> dict[str, Any]:
    """How far the target's stable phase runs past the rungs' in lr-weighted tokens S1, and
    how the curve law does when it extrapolates within the rungs the way the target makes
    it (the level-out backtest never extrapolates along S1): fitted on the points with S1
    at most half the rungs' largest and scored on the rest (`s1_2x`); fitted without the
    widest rung and scored on it (`width`); both at once, scored on the widest rung's
    points past half the S1 (`joint`, the closest to what the target asks)."""
    stable, t_stable = cs2 == 0, t_s2 == 0
    reach: dict[str, Any] = {
        "rungs_s1_max": float(cs1.max()),
        "rungs_stable_s1": float(cs1[stable].max()) if stable.any() else None,
        "target_stable_s1": float(t_s1[t_stable].max()) if t_stable.any() else None}
    if reach["rungs_stable_s1"] and reach["target_stable_s1"]:
        reach["ratio"] = reach["target_stable_s1"] / reach["rungs_stable_s1"]
    early, narrow = cs1 <= cs1.max() / 2, cn < cn.max()
    splits = {"s1_2x": (early, ~early), "width": (narrow, ~narrow),
              "joint": (early & narrow, ~early & ~narrow)}
    reach["backtests"] = {}
    for name, (fit, scored) in splits.items():
        entry: dict[str, Any] = {"fit_points": int(fit.sum()), "scored_points": int(scored.sum())}
        if len(set(cn[fit])) < 3:  # E + A N^-a has three parameters
            entry["skipped"] = "fewer than three widths left to fit the size term"
            reach["backtests"][name] = entry
            continue
        try:
            predicted = fit_curve(cn[fit], cs1[fit], cs2[fit], cy[fit], start, form).predict(
                cn[scored], cs1[scored], cs2[scored])
            errors = (predicted - cy[scored]) / cy[scored]
            # no point to score (the widest rung never passes half the largest S1): NaN,
            # as the records written before this guard hold, without numpy's warning
            entry |= ({"median_abs_rel_error": math.nan, "mean_rel_error": math.nan}
                      if errors.size == 0 else
                      {"median_abs_rel_error": float(np.median(np.abs(errors))),
                       "mean_rel_error": float(np.mean(errors))})
        except (FitError, ValueError) as err:
            entry["skipped"] = str(err)
        reach["backtests"][name] = entry
    return reach


def _backtest(levels: np.ndarray, y: np.ndarray, fit_predict: Callable) -> list[dict]:
    """Leave each compute level out: fit the rest, predict its points' (mean) losses."""
    out = []
    for level in range(int(levels.max()) + 1):
        held = levels == level
        try:
            pred = np.asarray(fit_predict(~held), float)
        except FitError as err:
            out.append({"level": level, "skipped": str(err)})
            continue
        errors = (pred - y[held]) / y[held]
        out.append({"level": level, "points": int(held.sum()),
                    "mean_abs_rel_error": float(np.mean(np.abs(errors))),
                    "mean_rel_error": float(np.mean(errors))})
    return out


def _stability_forecast(spec: LadderSpec, results: list[RunResult]) -> dict[str, Any]:
    """log(grad norm) and log(logit z) linear in log C over the trunks, at the target."""
    trunks = [r for r in results if r.stability and r.point in
              {p for p, runs in spec.points().items() if runs[0].parent is None}]
    by_point: dict[str, list[RunResult]] = {}
    for r in trunks:
        by_point.setdefault(r.point, []).append(r)
    if len(by_point) < 2:
        return {"skipped": "fewer than two rung trunks with grad-norm records"}
    c = np.log([runs[0].compute for runs in by_point.values()])
    out: dict[str, Any] = {"limit": GRAD_NORM_LIMIT, "compute": spec.target.compute,
                           "window": "last 10% of the stable phase (median)"}
    for key in ("grad_norm", "grad_norm_peak", "logit_z"):
        v = np.log([np.mean([r.stability[key] for r in runs]) for runs in by_point.values()])
        slope, intercept = np.polyfit(c, v, 1)
        out[key] = {"slope_per_log_compute": float(slope),
                    "predicted": float(np.exp(intercept + slope * math.log(
                        spec.target.compute))),
                    "rungs": [float(np.exp(x)) for x in v]}
    out["expect_grad_norm_above_limit"] = out["grad_norm_peak"]["predicted"] > GRAD_NORM_LIMIT
    return out


def _lr_check(spec: LadderSpec, results: list[RunResult],
              lr_results: list[RunResult]) -> dict[str, Any]:
    """Per probed rung: its loss at its lr (first seed) and at each probed lr."""
    if not lr_results:
        return {"skipped": "the spec has no lr_check"}
    by_name = {r.name: r for r in results}
    probes: dict[str, dict] = {}
    for rung, res in zip(spec.lr_runs, lr_results, strict=True):
        point = rung.name.rsplit("-lr", 1)[0]
        base = next(r for r in spec.rungs if r.point == point and r.parent is None)
        entry = probes.setdefault(point, {"lr": base.config.optim.lr, "loss":
                                          by_name[base.name].final_val_loss, "probes": {}})
        entry["probes"][f"{rung.config.optim.lr:.6g}"] = res.final_val_loss
    for entry in probes.values():
        entry["best_lr"] = min([(entry["loss"], entry["lr"]),
                                *((v, float(k)) for k, v in entry["probes"].items())])[1]
        entry["own_lr_is_best"] = entry["best_lr"] == entry["lr"]
    return probes


def _score_stage(stage: dict[str, Any], actual_at: dict[int, float]) -> dict[str, Any]:
    """One pre-registered stage end against the target's evaluation at that step."""
    y = actual_at.get(stage["end_step"])
    scored = {"name": stage["name"], "index": stage["index"], "end_step": stage["end_step"],
              "law": stage["law"], "predicted": stage["value"], "actual": y,
              "interval": {"low": stage["low"], "high": stage["high"],
                           "confidence": stage["confidence"]}}
    if y is None:
        return {**scored, "relative_error": None, "within_interval": None}
    return {**scored, "relative_error": (stage["value"] - y) / y,
            "within_interval": stage["low"] <= y <= stage["high"],
            "laws": {name: {"value": law["value"], "relative_error": (law["value"] - y) / y,
                            "within_interval": law["interval"]["low"] <= y
                            <= law["interval"]["high"]}
                     for name, law in stage["laws"].items() if "value" in law}}


def compare(record: dict[str, Any], actual: RunResult) -> dict[str, Any]:
    """The finished target against the record: final, per law, per evaluation, stability."""
    y = actual.final_val_loss
    p = record["prediction"]
    laws = {name: {"value": law["value"], "relative_error": (law["value"] - y) / y,
                   "within_interval": law["interval"]["low"] <= y <= law["interval"]["high"]}
            for name, law in record["laws"].items() if "value" in law}
    out: dict[str, Any] = {"relative_error": (p["value"] - y) / y,
                           "within_interval": p["low"] <= y <= p["high"], "laws": laws}
    curve = record["laws"].get("curve", {})
    actual_at = {int(e["step"]): e["loss"] for e in actual.curve}
    rows = [{**pt, "actual": actual_at[pt["step"]],
             "relative_error": (pt["predicted"] - actual_at[pt["step"]]) / actual_at[pt["step"]]}
            for pt in curve.get("points", []) if pt["step"] in actual_at]
    out["curve"] = rows
    out["curve_median_abs_rel_error"] = (float(np.median([abs(r["relative_error"])
                                                          for r in rows])) if rows else None)
    out["stages"] = [_score_stage(stage, actual_at) for stage in record.get("stages", [])]
    forecast_ = record.get("stability", {})
    if "grad_norm_peak" in forecast_ and actual.stability:
        out["stability"] = {
            "predicted_grad_norm_peak": forecast_["grad_norm_peak"]["predicted"],
            "actual_grad_norm_peak": actual.stability["grad_norm_peak"],
            "predicted_grad_norm": forecast_["grad_norm"]["predicted"],
            "actual_grad_norm": actual.stability["grad_norm"],
            "predicted_logit_z": forecast_["logit_z"]["predicted"],
            "actual_logit_z": actual.stability["logit_z"],
            "expected_above_limit": forecast_["expect_grad_norm_above_limit"],
            "above_limit": actual.stability["grad_norm_peak"] > forecast_["limit"]}
    return out
