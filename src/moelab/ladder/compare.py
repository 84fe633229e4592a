"""What a recipe change is worth in compute: `moelab ladder compare BASE VARIANT [MORE...]`.

Each spec's finished rungs (read, never retrained) give points (C, L) on the IsoFLOP
minima, as the ladder's own L(C) law uses them. All recipes are fitted *jointly* with one
shared irreducible loss (Marin's compute multiplier):

    L_i(C) = L_inf + A_i * (C / C0)^-alpha_i        (C0: the smallest point of any recipe)

L_inf is fitted jointly (the points of every recipe pin it down together) unless
`--l-inf` pins it. The compute the base needs to reach variant v's loss at budget C is
C_needed = C0 * (A_base / (L_v(C) - L_inf))^(1/alpha_base), and the multiplier is
C_needed / C. With one shared alpha it is ((L_base - L_inf) / (L_v - L_inf))^(1/alpha) =
(A_base / A_v)^(1/alpha), the same at every C.

- theoretical: C in model FLOPs (moelab.train.metrics.flops_per_token x tokens).
- realized: the same comparison in wall-clock: the seconds the base needs to spend
  C_needed over the seconds the variant needs to spend C. Each recipe's seconds at a
  FLOP budget come from a log-log line through its points' (C, tokens / measured tokens/s)
  (median of the logged steps): its measured throughput, extrapolated as it trends with
  size. (Refitting L against seconds instead was tried first and dropped: with per-point
  throughput noise it gave a narrower, spurious interval.)

Intervals: the ladder's parametric bootstrap (moelab.ladder.fit / predict): every point's
loss redrawn as fitted + N(0, seed sd / sqrt(replicates)), with each recipe's pooled seed
sd, and every point's log seconds redrawn about its recipe's log-log line with that line's
residual sd (the measured throughput's noise: without it, two recipes whose ladders took
the same wall time showed a realized 1.08x [1.07, 1.09] from the lines' slopes alone),
refitted, and the multiplier recomputed; no target noise is added (a multiplier is a
property of the laws, not of one run). The same draws give the interval of each
alpha_v - alpha_base. If it excludes 0 the alphas differ and the multiplier is reported as
a curve over C (its value at each `--at` budget); otherwise the headline is the
shared-alpha fit's single number (the free-alpha curve is still plotted). A difference
is "distinguishable from seed noise" when the multiplier's interval excludes 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moelab.errors import UserError
from moelab.ladder.fit import (
    ALPHA_MAX,
    ALPHA_MIN,
    LOG_A_BOUND,
    FitError,
    _pinned,
    _solve,
    compute_levels,
    isoflop_minima,
)
from moelab.ladder.predict import _curve_band, _safe, point_table, pooled_sd
from moelab.ladder.results import (
    FINAL_LOSS,
    check_run_dir,
    is_finished,
    metrics,
    result,
    run_dir,
)
from moelab.ladder.spec import MIN_POINTS, LadderSpec

GRID = 40  # compute values on the multiplier curve
# wall-clock ~ C^slope across a recipe's points; outside this range the time is not mostly
# model FLOPs at a steady throughput, and the report says the realized number is not either
SLOPE_RANGE = (0.5, 1.5)
COMPARE_FILE = "compare.json"


@dataclass(frozen=True)
class Recipe:
    """One ladder's points as the comparison uses them (the IsoFLOP minima)."""

    name: str
    metric: str  # what the loss measures; recipes must agree on it
    data: str  # the text the loss is scored on (dataset and mixture); must agree
    compute: np.ndarray  # model FLOPs of each point
    seconds: np.ndarray  # wall-clock of each point at its measured tokens/s
    loss: np.ndarray  # mean final loss over the point's replicates
    point_sd: np.ndarray  # seed sd / sqrt(replicates)
    seed_sd: float
    tokens_per_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def seconds_at(self, compute: np.ndarray | float) -> np.ndarray:
        """Wall-clock to spend `compute` FLOPs: a log-log line through the points (exact
        when the throughput in FLOPs/s does not change with size)."""
        slope, icept = self._seconds_line()
        return np.exp(icept + slope * np.log(np.asarray(compute, float)))

    def _seconds_line(self) -> tuple[float, float]:
        """(slope, intercept) of log(seconds) against log(C) over the points."""
        slope, icept = np.polyfit(np.log(self.compute), np.log(self.seconds), 1)
        return float(slope), float(icept)

    @property
    def seconds_sd(self) -> float:
        """Residual sd of log(seconds) about the log-log line: the throughput's own noise
        (and any bend the line misses), which the bootstrap draws the seconds with."""
        n = len(self.compute)
        if n < 3:
            return 0.0
        residual = np.log(self.seconds) - np.log(self.seconds_at(self.compute))
        return float(np.sqrt(np.sum(residual ** 2) / (n - 2)))

    @property
    def seconds_slope(self) -> float:
        """d log(seconds) / d log(C) over the points: 1 when wall-clock grows with model
        FLOPs; near 0 when throughput is bound by overhead or by other work on the machine
        (tiny models), and then a realized multiplier says nothing about compute."""
        return self._seconds_line()[0]


@dataclass(frozen=True)
class JointFit:
    """L_i(x) = E + A_i x^-alpha_i, x = C / x0, E shared (fitted or pinned)."""

    E: float
    A: tuple[float, ...]
    alpha: tuple[float, ...]
    x0: float
    pinned: bool  # E given, not fitted
    shared_alpha: bool
    rmse: float
    at_bound: tuple[str, ...] = ()

    def loss(self, i: int, c: np.ndarray | float) -> np.ndarray:
        return self.E + self.A[i] * (np.asarray(c, float) / self.x0) ** -self.alpha[i]

    def multiplier(self, i: int, c: np.ndarray | float, base: int = 0) -> np.ndarray:
        """C_needed by the base to reach recipe i's loss at c, over c (logs: no overflow)."""
        log_x = np.log(np.asarray(c, float) / self.x0)
        log_needed = (math.log(self.A[base]) - math.log(self.A[i])
                      + self.alpha[i] * log_x) / self.alpha[base]
        return np.exp(log_needed - log_x)

    def theta(self) -> np.ndarray:
        head = [] if self.pinned else [self.E]
        alphas = self.alpha[:1] if self.shared_alpha else self.alpha
        return np.array([*head, *np.log(self.A), *alphas])

    def to_dict(self, names: list[str]) -> dict[str, Any]:
        return {"L_inf": self.E, "L_inf_mode": "pinned" if self.pinned else "fitted jointly",
                "x0": self.x0, "shared_alpha": self.shared_alpha, "rmse": self.rmse,
                "at_bound": list(self.at_bound),
                "recipes": {n: {"A": a, "alpha": al} for n, a, al in
                            zip(names, self.A, self.alpha, strict=True)},
                "formula": "L_i = L_inf + A_i (C / x0)^-alpha_i"}


def fit_joint(xs: list[np.ndarray], ys: list[np.ndarray], shared_alpha: bool = False,
              l_inf: float | None = None, start: np.ndarray | None = None) -> JointFit:
    """Least squares over every recipe's points at once (the ladder's solver and bounds:
    0 <= E < every loss, alpha in (0, 2], |log A| <= 30). `start` replaces the grid of
    starts (bootstrap refits)."""
    k = len(xs)
    x0 = float(min(x.min() for x in xs))
    x = np.concatenate(xs) / x0
    y = np.concatenate(ys)
    group = np.concatenate([np.full(len(v), i) for i, v in enumerate(xs)])
    n_alpha = 1 if shared_alpha else k
    agroup = np.zeros_like(group) if shared_alpha else group
    pinned = l_inf is not None
    if pinned and not 0 <= l_inf < y.min():
        raise FitError(f"--l-inf {l_inf} must lie in [0, {y.min():.4f}) (below every loss)")
    log_x = np.log(x)

    def split(theta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        e = l_inf if pinned else theta[0]
        rest = theta if pinned else theta[1:]
        return e, rest[:k], rest[k:]

    def residuals(theta: np.ndarray) -> np.ndarray:
        e, log_a, alpha = split(theta)
        return e + np.exp(log_a[group] - alpha[agroup] * log_x) - y

    def jacobian(theta: np.ndarray) -> np.ndarray:
        _, log_a, alpha = split(theta)
        term = np.exp(log_a[group] - alpha[agroup] * log_x)
        cols = [] if pinned else [np.ones_like(x)]
        cols += [term * (group == j) for j in range(k)]
        cols += [-term * log_x * (agroup == j) for j in range(n_alpha)]
        return np.stack(cols, axis=1)

    lower = ([] if pinned else [0.0]) + [-LOG_A_BOUND] * k + [ALPHA_MIN] * n_alpha
    upper = ([] if pinned else [float(y.min())]) + [LOG_A_BOUND] * k + [ALPHA_MAX] * n_alpha
    if start is not None:
        starts = [start]
    else:
        starts = []
        for e_frac in ([0.0] if pinned else [0.0, 0.5, 0.9]):
            e = l_inf if pinned else e_frac * y.min()
            for alpha in (0.1, 0.3, 0.8):
                log_a = [math.log(max(float(np.mean((ys[i] - e) * (xs[i] / x0) ** alpha)),
                                      1e-12)) for i in range(k)]
                starts.append(np.array(([] if pinned else [e]) + log_a + [alpha] * n_alpha))
    theta, why = _solve((residuals, jacobian), starts, (lower, upper))
    if theta is None:
        raise FitError(f"the joint fit of L_i(C) = L_inf + A_i C^-alpha_i did not converge "
                       f"({why}); check that every recipe's losses fall with compute")
    e, log_a, alpha = split(theta)
    alphas = tuple(float(alpha[0]) for _ in range(k)) if shared_alpha else tuple(
        float(a) for a in alpha)
    at_bound = []
    if not pinned and _pinned(float(e), float(y.min())):
        at_bound.append("L_inf at the lowest loss")
    if not pinned and _pinned(float(e), 0.0):
        at_bound.append("L_inf at 0")
    at_bound += [f"alpha[{i}]" for i, a in enumerate(alphas)
                 if _pinned(a, ALPHA_MAX) or _pinned(a, ALPHA_MIN)]
    rmse = float(np.sqrt(np.mean(residuals(theta) ** 2)))
    return JointFit(E=float(e), A=tuple(float(v) for v in np.exp(log_a)), alpha=alphas,
                    x0=x0, pinned=pinned, shared_alpha=shared_alpha, rmse=rmse,
                    at_bound=tuple(at_bound))


# ------------------------------------------------------------------ reading ladders


def _data_identity(spec: LadderSpec) -> str:
    """The loss is scored on the val split of data.path, weighted by the training mixture
    (moelab.ladder.results), so both must agree for two losses to be comparable."""
    d = spec.rungs[0].config.data
    return f"{Path(d.path).resolve()} mixture {dict(sorted(d.mixture.items())) or 'by size'}"


def _tokens_per_s(path: Path) -> float:
    """Median logged throughput of a finished run, its first logged step (compile) left out."""
    rates = [r["tokens_per_s"] for r in metrics(path)[1:] if "tokens_per_s" in r]
    if not rates:
        raise UserError(f"{path} logged no tokens_per_s, so its wall-clock is unknown; "
                        "retrain it with a moelab that logs throughput")
    return float(np.median(rates))


def recipe_from_spec(spec: LadderSpec) -> Recipe:
    """A spec's finished rungs as a Recipe; a one-line error names any rung not trained."""
    missing = [r.name for r in spec.rungs if not is_finished(r, run_dir(spec, r))]
    if missing:
        raise UserError(f"ladder {spec.name}: rung(s) not trained in {spec.out}: "
                        f"{', '.join(missing)}; train them with `moelab ladder compare "
                        "--train` (rungs only) or `moelab ladder run` on its spec")
    for r in spec.rungs:
        check_run_dir(r, run_dir(spec, r))  # a directory of another config is not reused
    results = [result(r, run_dir(spec, r)) for r in spec.rungs]
    rows = point_table(spec, results)
    seed_sd, _ = pooled_sd([r["losses"] for r in rows])
    if seed_sd is None:
        seed_sd = spec.fit.noise_sd
    if seed_sd is None:
        raise UserError(f"ladder {spec.name} has no seed replicates and no fit.noise_sd, so "
                        "no interval can be drawn; add `seeds` or fit.noise_sd to its spec")
    tps = {r.name: _tokens_per_s(run_dir(spec, r)) for r in spec.rungs}
    rates = np.array([np.median([tps[n] for n in row["runs"]]) for row in rows])
    c = np.array([r["compute"] for r in rows], float)
    y = np.array([r["mean"] for r in rows], float)
    levels = compute_levels(c)
    if levels.max() + 1 < MIN_POINTS:
        raise UserError(f"ladder {spec.name} has {levels.max() + 1} compute level(s); L(C) has "
                        f"3 parameters and needs at least {MIN_POINTS}: add rungs of other "
                        "sizes or token counts")
    keep = isoflop_minima(c, y)
    n = np.array([len(r["losses"]) for r in rows], float)
    tokens = np.array([r["tokens"] for r in rows], float)
    return Recipe(name=spec.name, metric=getattr(spec, "metric", None) or FINAL_LOSS,
                  data=_data_identity(spec), compute=c[keep], seconds=(tokens / rates)[keep],
                  loss=y[keep], point_sd=(seed_sd / np.sqrt(n))[keep], seed_sd=seed_sd,
                  tokens_per_s=rates[keep])


def check_comparable(recipes: list[Recipe]) -> None:
    base = recipes[0]
    for r in recipes[1:]:
        if r.metric != base.metric:
            raise UserError(f"{r.name} is scored on {r.metric!r} but the base {base.name} on "
                            f"{base.metric!r}; a multiplier needs one metric for both")
        if r.data != base.data:
            raise UserError(f"{r.name} is scored on {r.data} but the base {base.name} on "
                            f"{base.data}; compare ladders on the same data and mixture")
        if r.name == base.name:
            raise UserError(f"two specs are both named {r.name}; give each its own name")
    for r in recipes:
        if len(r.compute) < MIN_POINTS:
            raise UserError(f"ladder {r.name} has {len(r.compute)} compute level(s); L(C) "
                            f"needs at least {MIN_POINTS}")


# ------------------------------------------------------------------ the comparison


def _fit(recipes: list[Recipe], y: list[np.ndarray], shared_alpha: bool,
         l_inf: float | None, start: np.ndarray | None = None) -> JointFit:
    return fit_joint([r.compute for r in recipes], y, shared_alpha, l_inf, start)


def _values(recipes: list[Recipe], fit: JointFit, at: np.ndarray) -> np.ndarray:
    """Per variant: theoretical multipliers at `at`, realized ones there (the base's
    wall-clock for the C_needed it needs over the variant's for C), alpha_v - alpha_b;
    flattened, so one bootstrap draws them all."""
    out = []
    for i in range(1, len(recipes)):
        theoretical = fit.multiplier(i, at)
        realized = recipes[0].seconds_at(theoretical * at) / recipes[i].seconds_at(at)
        out += [theoretical, realized, [fit.alpha[i] - fit.alpha[0]]]
    return np.concatenate(out)


def _band(recipes, fit, shared_alpha, l_inf, at, samples, confidence, seed):
    """The ladder's parametric bootstrap of every value `_values` returns. Each draw
    redraws every point's loss (its seed sd) and every point's wall-clock (log seconds
    about its recipe's log-log line, with that line's residual sd: the measured
    throughput's noise), refits the losses jointly and the seconds lines per recipe."""
    start = fit.theta()
    sizes = [len(r.loss) for r in recipes]
    split_at = np.cumsum(sizes + sizes)[:-1]

    def refit(v: np.ndarray) -> np.ndarray:
        parts = np.split(v, split_at)
        drawn = [dataclasses.replace(r, seconds=np.exp(log_s))
                 for r, log_s in zip(recipes, parts[len(recipes):], strict=True)]
        return _values(drawn, _fit(recipes, parts[:len(recipes)], shared_alpha, l_inf,
                                   start), at)

    lines = [np.log(r.seconds_at(r.compute)) for r in recipes]
    fitted = np.concatenate([fit.loss(i, r.compute) for i, r in enumerate(recipes)] + lines)
    sd = np.concatenate([r.point_sd for r in recipes]
                        + [np.full(len(r.loss), r.seconds_sd) for r in recipes])
    return _curve_band(_safe(refit), fitted, sd, 0.0, samples, confidence, seed)


def compare_recipes(recipes: list[Recipe], at: list[float] | None = None,
                    l_inf: float | None = None, samples: int = 1000, confidence: float = 0.9,
                    seed: int = 0) -> dict[str, Any]:
    """Every variant against recipes[0]: see the module docstring."""
    check_comparable(recipes)
    names = [r.name for r in recipes]
    y = [r.loss for r in recipes]
    lo_c = min(r.compute.min() for r in recipes)
    hi_c = max(r.compute.max() for r in recipes)
    at_list = list(at) if at else [float(recipes[1].compute.max())]
    grid = np.geomspace(lo_c, max(hi_c * 10, *at_list), GRID)
    points = np.concatenate([np.asarray(at_list, float), grid])
    n_at, n = len(at_list), len(points)
    free = _fit(recipes, y, False, l_inf)
    shared = _fit(recipes, y, True, l_inf)
    free_value, shared_value = _values(recipes, free, points), _values(recipes, shared, points)
    free_band = _band(recipes, free, False, l_inf, points, samples, confidence, seed)
    shared_band = _band(recipes, shared, True, l_inf, points, samples, confidence, seed)
    variants: dict[str, Any] = {}
    for v in range(1, len(recipes)):
        off = (v - 1) * (2 * n + 1)
        d_alpha = (free_value[off + 2 * n], free_band[0][off + 2 * n],
                   free_band[1][off + 2 * n])
        alphas_differ = not d_alpha[1] <= 0 <= d_alpha[2]
        entry: dict[str, Any] = {
            "alpha_difference": {"value": float(d_alpha[0]), "low": float(d_alpha[1]),
                                 "high": float(d_alpha[2]), "differ": alphas_differ},
            "varies_with_compute": alphas_differ}
        for kind, k in (("theoretical", 0), ("realized", 1)):
            sl = slice(off + k * n, off + (k + 1) * n)
            value, band = (free_value, free_band) if alphas_differ else (shared_value,
                                                                          shared_band)
            rows = [{"compute": float(c), "value": float(m), "low": float(lo),
                     "high": float(hi)}
                    for c, m, lo, hi in zip(points, value[sl], band[0][sl], band[1][sl],
                                            strict=True)]
            curve = [{"compute": float(c), "value": float(m), "low": float(lo),
                      "high": float(hi)}
                     for c, m, lo, hi in zip(grid, free_value[sl][n_at:], free_band[0][sl][n_at:],
                                             free_band[1][sl][n_at:], strict=True)]
            head = rows[0]
            entry[kind] = {
                "value": head["value"], "interval": [head["low"], head["high"]],
                "confidence": confidence, "at": rows[:n_at],
                "from": "free alphas (the multiplier changes with C)" if alphas_differ else
                        "one shared alpha (the same at every C)",
                "distinguishable": not head["low"] <= 1.0 <= head["high"],
                "curve": curve}
        variants[names[v]] = entry
    out: dict[str, Any] = {
        "base": names[0], "variants_of": names[1:], "metric": recipes[0].metric,
        "data": recipes[0].data,
        "l_inf": {"value": free.E, "mode": "pinned" if l_inf is not None else
                  "fitted jointly (shared by every recipe)"},
        "fits": {"free_alpha": free.to_dict(names), "shared_alpha": shared.to_dict(names)},
        "recipes": {r.name: {"points": [{"compute": float(c), "seconds": float(s),
                                         "loss": float(lo), "sd": float(sd),
                                         "tokens_per_s": float(t)}
                                        for c, s, lo, sd, t in zip(
                                            r.compute, r.seconds, r.loss, r.point_sd,
                                            r.tokens_per_s if len(r.tokens_per_s) else
                                            np.zeros(len(r.loss)), strict=True)],
                             "seed_sd": r.seed_sd,
                             "seconds_vs_compute_slope": r.seconds_slope,
                             "log_seconds_residual_sd": r.seconds_sd,
                             "flops_per_s": float(np.median(r.compute / r.seconds))}
                    for r in recipes},
        "variants": variants,
        "bootstrap": {"samples": samples, "confidence": confidence, "seed": seed,
                      "method": "parametric: each point's loss redrawn as fitted + N(0, seed "
                                "sd / sqrt(replicates)) per recipe and its log seconds about "
                                "its recipe's log-log line with that line's residual sd, both "
                                "joint fits and the seconds lines refitted, percentile "
                                "interval; no target noise"},
    }
    if len(recipes) == 2:  # the two-recipe headline at the top level
        only = variants[names[1]]
        out |= {"theoretical": {k: only["theoretical"][k] for k in ("value", "interval")},
                "realized": {k: only["realized"][k] for k in ("value", "interval")}}
    return out


# ------------------------------------------------------------------ report


def _fmt(e: dict[str, Any]) -> str:
    return f"{e['value']:.2f}x [{e['interval'][0]:.2f}, {e['interval'][1]:.2f}]"


def markdown(result_: dict[str, Any]) -> str:
    b = result_["bootstrap"]
    lines = [f"# Compute multipliers against `{result_['base']}`", "",
             f"Metric: {result_['metric']}.", "",
             f"L_inf {result_['l_inf']['value']:.4f}, {result_['l_inf']['mode']}. Intervals: "
             f"{b['confidence']:.0%}, {b['method']} ({b['samples']} draws).", "",
             "| variant | at C (FLOPs) | theoretical (model FLOPs) | realized (wall-clock) | "
             "distinguishable from seed noise (theoretical / realized) | "
             "alpha_v - alpha_base | reported as |",
             "|---|---|---|---|---|---|---|"]
    for name, v in result_["variants"].items():
        d = v["alpha_difference"]
        for i, (t, r) in enumerate(zip(v["theoretical"]["at"], v["realized"]["at"],
                                       strict=True)):
            te = {"value": t["value"], "interval": [t["low"], t["high"]]}
            re = {"value": r["value"], "interval": [r["low"], r["high"]]}
            dist = " / ".join("yes" if not e["low"] <= 1 <= e["high"] else "no"
                              for e in (t, r))
            tail = (f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] | "
                    + ("a curve over C (alphas differ)" if v["varies_with_compute"]
                       else "one number (shared alpha)")) if i == 0 else "| "
            lines.append(f"| {name} | {t['compute']:.3g} | {_fmt(te)} | {_fmt(re)} | {dist} | "
                         f"{tail} |")
    for name, r in result_["recipes"].items():
        if not SLOPE_RANGE[0] <= r["seconds_vs_compute_slope"] <= SLOPE_RANGE[1]:
            lines += ["", f"**Realized is not a compute statement here**: {name}'s wall-clock "
                      f"grows as C^{r['seconds_vs_compute_slope']:.2f} over its points, not "
                      "~C^1 (its throughput is bound by overhead or by other work on the "
                      "machine), so its realized multiplier mostly reflects that."]
    for model, fit in result_["fits"].items():
        if fit["at_bound"]:
            lines += ["", f"{model} fit: on a bound (not identified by the points): "
                      f"{', '.join(fit['at_bound'])}."]
    lines += ["", "| recipe | points (C: loss) | seed sd | model FLOPs/s |", "|---|---|---|---|"]
    for name, r in result_["recipes"].items():
        pts = ", ".join(f"{p['compute']:.3g}: {p['loss']:.4f}" for p in r["points"])
        lines.append(f"| {name} | {pts} | {r['seed_sd']:.4f} | {r['flops_per_s']:.3g} |")
    lines += ["", "![fits and multiplier vs compute](compare.png)", ""]
    return "\n".join(lines)


def plot(result_: dict[str, Any], path: Path) -> None:
    """Left: each recipe's points and its jointly fitted L(C); right: the multipliers
    (theoretical, realized) against the variant's compute, with their bands."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    fit = result_["fits"]["free_alpha"]
    all_c = [p["compute"] for r in result_["recipes"].values() for p in r["points"]]
    grid = np.geomspace(min(all_c) / 1.5, max(all_c) * 10, 200)
    for i, (name, r) in enumerate(result_["recipes"].items()):
        c = [p["compute"] for p in r["points"]]
        left.errorbar(c, [p["loss"] for p in r["points"]], yerr=[p["sd"] for p in r["points"]],
                      fmt="o", color=f"C{i}", capsize=3, label=f"{name} (IsoFLOP minima)")
        law = fit["recipes"][name]
        left.plot(grid, fit["L_inf"] + law["A"] * (grid / fit["x0"]) ** -law["alpha"],
                  color=f"C{i}", alpha=0.6, label=f"{name}: alpha {law['alpha']:.3f}")
    left.axhline(fit["L_inf"], color="0.5", ls=":", label=f"L_inf {fit['L_inf']:.3f}")
    for i, (name, v) in enumerate(result_["variants"].items()):
        for kind, style in (("theoretical", "-"), ("realized", "--")):
            curve = v[kind]["curve"]
            c = [p["compute"] for p in curve]
            right.plot(c, [p["value"] for p in curve], style, color=f"C{i + 1}",
                       label=f"{name} {kind}")
            right.fill_between(c, [p["low"] for p in curve], [p["high"] for p in curve],
                               color=f"C{i + 1}", alpha=0.12)
        for kind, marker in (("theoretical", "D"), ("realized", "s")):
            head = v[kind]["at"][0]  # the headline (shared alpha unless the alphas differ)
            right.errorbar([head["compute"]], [head["value"]], fmt=marker, color=f"C{i + 1}",
                           yerr=[[head["value"] - head["low"]], [head["high"] - head["value"]]],
                           capsize=3, label=f"{name} {kind} at C: {head['value']:.3g}x")
    right.axhline(1.0, color="0.5", ls=":")
    right.set_yscale("log")
    for ax, ylabel, xlabel in (
            (left, "final validation loss (nats/token)", "compute C (model FLOPs)"),
            (right, f"multiplier vs {result_['base']} (free alphas)",
             "compute C the variant spends (model FLOPs)")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: no overlaps
        ax.yaxis.set_minor_formatter(NullFormatter())
        if ax is right:  # multipliers near 1 span less than a decade: label them plainly
            low, high = ax.get_ylim()
            times = FuncFormatter(lambda y, _: f"{y:.3g}x")
            ax.yaxis.set_major_formatter(times)
            if high / low < 10:
                ax.yaxis.set_minor_formatter(times)
                ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"compute multipliers against {result_['base']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def record_in_lab(result_: dict[str, Any], out: Path, experiment: str) -> str:
    """The multipliers as a finished run of a lab experiment (metrics named as
    moelab.lab.report.MULTIPLIER says), so the findings page lists them with intervals."""
    from moelab.lab.report import MULTIPLIER
    from moelab.lab.store import Store, default_lab_path

    values = {}
    for name, v in result_["variants"].items():
        for kind in ("theoretical", "realized"):
            key, e = f"{kind}/{name} vs {result_['base']}", v[kind]
            values |= {f"{MULTIPLIER}/{key}": e["value"],
                       f"{MULTIPLIER}_low/{key}": e["interval"][0],
                       f"{MULTIPLIER}_high/{key}": e["interval"][1]}
    with Store(default_lab_path()) as store:
        run = store.start_run(experiment, str(out), {"compare": {
            "base": result_["base"], "variants": result_["variants_of"],
            "l_inf": result_["l_inf"], "at": result_["variants"][result_["variants_of"][0]][
                "theoretical"]["at"][0]["compute"]}})
        store.log_metrics(run, 0, values)
        store.finish_run(run, "succeeded", f"compute multipliers in {out / COMPARE_FILE}")
    return run


def train_rungs(specs: list[LadderSpec], ray: str | None = None, **ray_options: Any) -> None:
    """Train the rungs not finished yet through the ladder's runner (resuming half-done
    ones, never touching finished ones); a comparison needs no target or lr probes. With
    `ray`, every rung of every spec is a Ray task (`moelab.jobs`)."""
    from moelab.ladder.runner import train_runs

    train_runs([(spec, spec.rungs) for spec in specs], None, ray, **ray_options)


def compare_ladders(specs: list[LadderSpec], out: Path, at: list[float] | None = None,
                    l_inf: float | None = None, experiment: str | None = None,
                    train: bool = False, ray: str | None = None,
                    **ray_options: Any) -> dict[str, Any]:
    """Read every spec's finished rungs (with `train`, first train those missing),
    compare, write compare.json, report.md and compare.png under `out` (and, with
    `experiment`, record the multipliers in the lab); the bootstrap settings are the base
    spec's `fit`."""
    if len(specs) < 2:
        raise UserError("compare needs a base spec and at least one variant spec")
    if train:
        train_rungs(specs, ray, **ray_options)
    recipes = [recipe_from_spec(s) for s in specs]
    f = specs[0].fit
    result_ = compare_recipes(recipes, at, l_inf, f.bootstrap, f.confidence, f.seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPARE_FILE).write_text(json.dumps(result_, indent=1) + "\n")
    (out / "report.md").write_text(markdown(result_))
    plot(result_, out / "compare.png")
    if experiment:
        record_in_lab(result_, out, experiment)
    return result_
