"""Scaling-law fits: L(N, D) (Chinchilla approach 3), L(C) on IsoFLOP minima, and a
schedule-aware law for whole loss curves; parametric-bootstrap intervals from measured noise.

Raw compute spans many decades (1e11 .. 1e14 FLOPs), so fitting A * C^-alpha directly
pits an A of 1e3 against an alpha of 0.1 and the solver stalls. Every fit therefore works
in normalized units (x = C / C0 with C0 the smallest point's, N / N0, D / D0) and fits
log A, so every free parameter is O(1). Bounds keep the laws meaningful: 0 <= E < min(L)
(the irreducible loss lies below every observed loss), exponents in (0, 2]. A parameter
that ends on a bound is *flagged* (`at_bound`): the data did not identify it.

L(N, D) and the curve law are fitted as Chinchilla's approach 3 does: Huber loss (delta
1e-3) on log L, from a grid of starting points, with untied exponents.

The interval is a *parametric* bootstrap: the seed noise is measured (replicates of each
point), so each refit draws every point's loss as fitted + N(0, sd / sqrt(replicates)),
refits, and adds the target's own seed noise N(0, sd) to the refit's prediction. The
interval then says how far a new ladder + target run could land, not only how well the
curve fits these points (a residual bootstrap with 5 points and sd 0.1 understated that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import least_squares

from moelab.errors import UserError

ALPHA_MAX = 2.0
ALPHA_MIN = 1e-3
LOG_A_BOUND = 30.0
PINNED = 1e-4  # a parameter within this (relative) distance of a bound is "at the bound"
HUBER_DELTA = 1e-3  # on log L, as in Chinchilla's approach 3
C_MAX = 5.0  # the curve law's annealing gain; q <= ~0.2, so 1 - C q stays > 0
CONDITION_LIMIT = 1e8  # ~ 1/sqrt(float64 eps): a direction the points do not determine
LEVEL_TOLERANCE = 0.05  # points within 5% of each other's compute share a compute level

Residuals = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray] | str]


class FitError(UserError):
    """The scaling law could not be fitted to the rungs (names why and what to change).
    `detail`: what the refusing check computed (a law's fit and interval), for the record
    a refusal leaves (runner.write_refusal); None when there is nothing beyond the line."""

    def __init__(self, message: str, detail: dict | None = None):
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class PowerLawFit:
    """L(C) = E + A * (C / C0)^-alpha, fitted to n rungs."""

    E: float
    A: float  # in units of C0: the loss above E at the smallest rung's compute
    alpha: float
    C0: float
    rmse: float  # of the fit's residuals, in loss units
    n: int
    at_bound: tuple[str, ...] = ()  # "E" when the irreducible loss sits at its bound 0

    def predict(self, compute: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A * (np.asarray(compute, float) / self.C0) ** -self.alpha

    @property
    def A_raw(self) -> float:
        """A in raw FLOPs: L = E + A_raw * C^-alpha."""
        return self.A * self.C0**self.alpha

    def to_dict(self) -> dict:
        return {**asdict(self), "A_raw": self.A_raw, "at_bound": list(self.at_bound),
                "formula": "L(C) = E + A * (C / C0)^-alpha = E + A_raw * C^-alpha"}


@dataclass(frozen=True)
class ChinchillaFit:
    """L(N, D) = E + A * (N / N0)^-a + B * (D / D0)^-b."""

    E: float
    A: float
    a: float
    B: float
    b: float
    N0: float
    D0: float
    rmse: float  # of the fit's residuals, in loss units
    n: int
    at_bound: tuple[str, ...]  # parameters pinned to a bound: not identified by the points
    condition: float = 1.0  # of the fit's Jacobian; > CONDITION_LIMIT: terms not separable

    def predict(self, n_params: float | np.ndarray, tokens: float | np.ndarray):
        n = np.asarray(n_params, float) / self.N0
        d = np.asarray(tokens, float) / self.D0
        return self.E + self.A * n**-self.a + self.B * d**-self.b

    def to_dict(self) -> dict:
        return {**asdict(self), "at_bound": list(self.at_bound),
                "unidentified": self.condition > CONDITION_LIMIT,
                "formula": "L(N, D) = E + A * (N / N0)^-a + B * (D / D0)^-b"}


@dataclass(frozen=True)
class CurveFit:
    """A schedule-aware law of the whole curve (moelab.ladder.curve), `form` one of
    CURVE_FORMS: "q" L = E + A (N/N0)^-a + B (S1/D0)^-b (1 - C q), "tissue"
    L = E + A (N/N0)^-a + B (S1/D0)^-b - C S2/D0."""

    E: float
    A: float
    a: float
    B: float
    b: float
    C: float
    N0: float
    D0: float
    rmse: float
    n: int
    at_bound: tuple[str, ...]
    condition: float = 1.0
    form: str = "q"

    def predict(self, n_params, s1, s2):
        return CURVE_FORMS[self.form].law(curve_theta(self), _curve_features(
            self.form, n_params, s1, s2, self.N0, self.D0))[0]

    def to_dict(self) -> dict:
        return {**asdict(self), "at_bound": list(self.at_bound),
                "unidentified": self.condition > CONDITION_LIMIT,
                "formula": CURVE_FORMS[self.form].formula}


@dataclass(frozen=True)
class Interval:
    """A parametric-bootstrap interval of one prediction."""

    low: float
    high: float
    confidence: float
    samples: int  # refits that converged
    requested: int
    method: str

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- L(C)


def _power_residuals(x: np.ndarray, loss: np.ndarray) -> Residuals:
    """Residuals of (E, log A, alpha) and their analytic Jacobian [n, 3]."""
    def residuals(theta: np.ndarray) -> np.ndarray:
        e, log_a, alpha = theta
        return e + np.exp(log_a) * x**-alpha - loss

    def jacobian(theta: np.ndarray) -> np.ndarray:
        _, log_a, alpha = theta
        term = np.exp(log_a) * x**-alpha
        return np.stack([np.ones_like(x), term, -term * np.log(x)], axis=1)

    return residuals, jacobian


def _power_bounds(loss: np.ndarray) -> tuple[list[float], list[float]]:
    return [0.0, -LOG_A_BOUND, ALPHA_MIN], [float(loss.min()), LOG_A_BOUND, ALPHA_MAX]


def _power_starts(x: np.ndarray, loss: np.ndarray) -> list[np.ndarray]:
    """A small grid of starts; A follows from (E, alpha) by matching the mean excess."""
    starts = []
    for e_frac in (0.0, 0.5, 0.9):
        e = e_frac * loss.min()
        for alpha in (0.1, 0.3, 0.8):
            a = float(np.mean((loss - e) * x**alpha))
            starts.append(np.array([e, math.log(max(a, 1e-12)), alpha]))
    return starts


def _solve(problem: Residuals, starts, bounds, robust: bool = False
           ) -> tuple[np.ndarray | None, str]:
    """The lowest-cost converged least_squares solution over the starts, or (None, why).
    `robust`: Huber loss with delta HUBER_DELTA on the residuals (approach 3)."""
    residuals, jacobian = problem
    best, why = None, "no start converged"
    lower, upper = np.array(bounds[0]), np.array(bounds[1])
    for x0 in starts:
        x0 = np.clip(x0, lower + 1e-9 * (1 + abs(lower)), upper - 1e-9 * (1 + abs(upper)))
        try:
            result = least_squares(residuals, x0, jac=jacobian, bounds=bounds, method="trf",
                                   x_scale="jac", max_nfev=500,
                                   loss="huber" if robust else "linear", f_scale=HUBER_DELTA)
        except ValueError as err:  # e.g. non-finite residuals at the start
            why = str(err)
            continue
        if result.status <= 0 or not np.all(np.isfinite(result.x)):
            why = f"least_squares status {result.status}: {result.message}"
            continue
        if best is None or result.cost < best.cost:
            best = result
    return (None, why) if best is None else (best.x, "")


def _pinned(value: float, bound: float) -> bool:
    return abs(value - bound) <= PINNED * max(1.0, abs(bound))


def _check_points(loss: np.ndarray, params: int, *inputs: np.ndarray) -> None:
    if any(len(v) != len(loss) for v in inputs):
        raise FitError(f"got {[len(v) for v in inputs]} inputs but {len(loss)} losses")
    if len(loss) < params:
        raise FitError(f"the fit has {params} parameters and needs at least {params} rungs, "
                       f"got {len(loss)}; add rungs to the ladder")
    values = np.concatenate([loss, *inputs])
    if not np.all(np.isfinite(values)):
        raise FitError(f"non-finite values among the rungs (losses {loss.tolist()}); a rung "
                       "diverged: fix it (e.g. lower optim.lr) and re-run it")
    if np.any(values <= 0):
        raise FitError(f"compute, sizes and losses must be > 0 to fit a power law, got "
                       f"losses {loss.tolist()}")


def power_law_refit(fit: PowerLawFit, compute: Sequence[float], at: float
                    ) -> Callable[[np.ndarray], float | None]:
    """y -> the prediction at `at` of L(C) refitted to losses y from `fit` (bootstrap)."""
    x = np.asarray(compute, float) / fit.C0
    start = np.array([fit.E, math.log(fit.A), fit.alpha])

    def refit(y: np.ndarray) -> float | None:
        theta, _ = _solve(_power_residuals(x, y), [start], _power_bounds(y))
        if theta is None:
            return None
        return float(theta[0] + math.exp(theta[1]) * (at / fit.C0) ** -theta[2])

    return refit


def fit_power_law(compute: Sequence[float], loss: Sequence[float]) -> PowerLawFit:
    """Least-squares fit of L = E + A (C/C0)^-alpha; raises FitError if it fails or degenerates."""
    c, y = np.asarray(compute, float), np.asarray(loss, float)
    _check_points(y, 3, c)
    listed = ", ".join(f"C={ci:.3g}: L={li:.4f}" for ci, li in zip(c, y, strict=True))
    if y[np.argmax(c)] >= y[np.argmin(c)]:
        raise FitError(f"the losses do not fall with compute (rungs: {listed}), so no power "
                       "law fits; check the rungs' training (a too-high optim.lr, too few steps)")
    c0 = float(c.min())
    x = c / c0
    problem = _power_residuals(x, y)
    theta, why = _solve(problem, _power_starts(x, y), _power_bounds(y))
    if theta is None:
        raise FitError(f"the fit of L(C) = E + A*C^-alpha did not converge ({why}); rungs: "
                       f"{listed}. Check that the losses fall with compute; add or spread rungs")
    e, log_a, alpha = (float(v) for v in theta)
    degenerate = []
    if _pinned(alpha, ALPHA_MAX):
        degenerate.append(f"alpha hit its upper bound {ALPHA_MAX} (the loss falls faster than "
                          "any power law with an offset, then flattens)")
    if _pinned(alpha, ALPHA_MIN):
        degenerate.append("alpha hit 0 (the losses barely change with compute)")
    if _pinned(e, float(y.min())):
        degenerate.append("E reached the best rung's loss (the losses stopped falling)")
    if degenerate:
        raise FitError(f"the fit of L(C) = E + A*C^-alpha is degenerate: {'; '.join(degenerate)}; "
                       f"rungs: {listed}. The rungs do not follow a power law: make sure each "
                       "rung trains long enough to improve on the one before, or spread them "
                       "over a wider compute range")
    rmse = float(np.sqrt(np.mean(problem[0](theta) ** 2)))
    # E at 0 still extrapolates, but only because the bound stopped it: flagged, not fatal
    return PowerLawFit(E=e, A=math.exp(log_a), alpha=alpha, C0=c0, rmse=rmse, n=len(c),
                       at_bound=("E",) if _pinned(e, 0.0) else ())


def parametric_interval(
    refit: Callable[[np.ndarray], float | None],
    fitted: np.ndarray,
    point_sd: np.ndarray,
    target_sd: float,
    value: float,
    samples: int = 1000,
    confidence: float = 0.9,
    seed: int = 0,
) -> Interval:
    """Parametric-bootstrap interval of a prediction (see the module docstring).

    refit(y) refits the law to losses y and returns its prediction for the target (None if
    it failed); fitted are the law's values at the points, point_sd each point's noise (sd
    of its replicate mean), target_sd the target's own seed noise."""
    if not 0 < confidence < 1:
        raise FitError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    preds = []
    for _ in range(samples):
        pred = refit(fitted + point_sd * rng.standard_normal(len(fitted)))
        if pred is not None and np.isfinite(pred):
            preds.append(pred + target_sd * rng.standard_normal())
    if len(preds) < samples / 2:
        raise FitError(f"only {len(preds)} of {samples} bootstrap refits converged; the "
                       "interval is undefined")
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(preds, [tail, 100 - tail])
    method = (f"parametric bootstrap: {samples} refits to fitted + N(0, sd_point) (sd_point "
              f"= seed sd / sqrt(replicates), {np.min(point_sd):.4f}..{np.max(point_sd):.4f}), "
              f"each prediction plus the target's own seed noise N(0, {target_sd:.4f}); "
              "percentile interval")
    return Interval(low=min(float(low), value), high=max(float(high), value),
                    confidence=confidence, samples=len(preds), requested=samples, method=method)


def compute_levels(compute: Sequence[float]) -> np.ndarray:
    """An integer level per point: points within LEVEL_TOLERANCE in compute share one."""
    c = np.asarray(compute, float)
    order = np.argsort(c)
    levels, level, anchor = np.empty(len(c), int), -1, -np.inf
    for i in order:
        if c[i] > anchor * (1 + LEVEL_TOLERANCE):
            level, anchor = level + 1, c[i]
        levels[i] = level
    return levels


def isoflop_minima(compute: Sequence[float], loss: Sequence[float]) -> list[int]:
    """Index of the lowest-loss point at each compute level (the IsoFLOP minima)."""
    levels, y = compute_levels(compute), np.asarray(loss, float)
    return [int(np.flatnonzero(levels == k)[np.argmin(y[levels == k])])
            for k in range(levels.max() + 1)]


# ----------------------------------------------------------- approach 3 (Huber, log L)


def _approach3(features: np.ndarray, y: np.ndarray, law: Callable, names: tuple[str, ...],
               bounds, starts) -> tuple[np.ndarray, tuple[str, ...], float, float]:
    """Huber on log L from every start, keeping the best (Hoffmann et al.'s approach 3; they
    used L-BFGS, here trust-region least squares with the same robust loss, ~10x faster).
    law(theta, features) -> (prediction [n], d prediction / d theta [p, n]).
    Returns (theta, parameters at a bound, rmse in loss units, condition number of the
    log-residuals' Jacobian: huge when the points cannot tell parameters apart)."""
    log_y = np.log(y)

    def residuals(theta: np.ndarray) -> np.ndarray:
        pred = law(theta, features)[0]
        return np.log(np.maximum(pred, 1e-300)) - log_y

    def jacobian(theta: np.ndarray) -> np.ndarray:
        pred, grad = law(theta, features)
        return (grad / np.maximum(pred, 1e-300)).T

    theta, why = _solve((residuals, jacobian), starts, bounds, robust=True)
    if theta is None:
        raise FitError(f"the approach-3 fit did not converge ({why})")
    pred, grad = law(theta, features)
    at_bound = tuple(name for name, v, lo, hi in zip(names, theta, *bounds, strict=True)
                     if _pinned(v, lo) or _pinned(v, hi))
    singular = np.linalg.svd(grad / pred, compute_uv=False)
    condition = float(singular[0] / max(singular[-1], 1e-300))
    rmse = float(np.sqrt(np.mean((pred - y) ** 2)))
    return theta, at_bound, rmse, condition


def _two_term(theta, f):
    e, log_a, a, log_b, b = theta[:5]
    n_term, d_term = np.exp(log_a) * f[0] ** -a, np.exp(log_b) * f[1] ** -b
    grad = np.stack([np.ones_like(n_term), n_term, -n_term * np.log(f[0]), d_term,
                     -d_term * np.log(f[1])])
    return e + n_term + d_term, grad


def _q_law(theta, f):
    e, log_a, a, log_b, b, c = theta
    n_term, s_term = np.exp(log_a) * f[0] ** -a, np.exp(log_b) * f[1] ** -b
    keep = 1 - c * f[2]
    grad = np.stack([np.ones_like(n_term), n_term, -n_term * np.log(f[0]), s_term * keep,
                     -s_term * keep * np.log(f[1]), -s_term * f[2]])
    return e + n_term + s_term * keep, grad


def _tissue_law(theta, f):
    e, log_a, a, log_b, b, c = theta
    n_term, s_term = np.exp(log_a) * f[0] ** -a, np.exp(log_b) * f[1] ** -b
    grad = np.stack([np.ones_like(n_term), n_term, -n_term * np.log(f[0]), s_term,
                     -s_term * np.log(f[1]), -f[2]])
    return e + n_term + s_term - c * f[2], grad


@dataclass(frozen=True)
class CurveForm:
    """One law of the whole curve: its function of (theta, features), the annealing
    feature it reads (f[2]: "q" = S2/S1, "s2" = S2/D0), C's upper bound, its formula."""

    law: Callable
    anneal: str
    c_max: float
    formula: str


CURVE_FORMS = {
    "q": CurveForm(_q_law, "q", C_MAX, "L = E + A (N/N0)^-a + B (S1/D0)^-b (1 - C q); S1 = "
                   "lr-weighted tokens, q = annealing area / S1"),
    # C S2/D0 is a drop in nats per D0 tokens of annealing area; 50 allows a drop of the
    # whole loss after ~0.1 D0 of area, far more than any run shows
    "tissue": CurveForm(_tissue_law, "s2", 50.0, "L = E + A (N/N0)^-a + B (S1/D0)^-b - C "
                        "S2/D0 (Tissue et al. 2024); S1 = lr-weighted tokens, S2 = annealing "
                        "area"),
}


def _curve_features(form: str, n_params, s1, s2, n0: float, d0: float) -> np.ndarray:
    from moelab.ladder.curve import annealed_fraction

    n, s1, s2 = np.broadcast_arrays(*(np.asarray(v, float) for v in (n_params, s1, s2)))
    anneal = annealed_fraction(s1, s2) if CURVE_FORMS[form].anneal == "q" else s2 / d0
    return np.stack([n / n0, s1 / d0, anneal])


def _grid(y: np.ndarray, extra: tuple[float, ...] = ()) -> list[np.ndarray]:
    """Starts: E at 0/50/85% of the lowest loss, exponents 0.15/0.5, the excess split 1:3
    or 3:1 between the two terms (24 starts; x `extra` values)."""
    starts = []
    for e_frac in (0.0, 0.5, 0.85):
        excess = float(y.min()) * (1 - e_frac)
        for a in (0.15, 0.5):
            for b in (0.15, 0.5):
                for share in (0.25, 0.75):
                    head = [e_frac * y.min(), math.log(excess * share), a,
                            math.log(excess * (1 - share)), b]
                    starts += [np.array(head + [c]) for c in extra] or [np.array(head)]
    return starts


def _two_term_bounds(y: np.ndarray, extra: int = 0):
    lower = [0.0, -LOG_A_BOUND, ALPHA_MIN, -LOG_A_BOUND, ALPHA_MIN] + [0.0] * extra
    upper = [float(y.min()), LOG_A_BOUND, ALPHA_MAX, LOG_A_BOUND, ALPHA_MAX] + [C_MAX] * extra
    return lower, upper


def fit_chinchilla(n_params: Sequence[float], tokens: Sequence[float], loss: Sequence[float],
                   start: np.ndarray | None = None) -> ChinchillaFit:
    """L(N, D) = E + A/N^a + B/D^b over active params N and tokens D (approach 3, untied).

    Needs five distinct points; points whose log N and log D move in lockstep cannot tell
    the terms apart, and the parameters that then end at a bound are listed in at_bound.
    `start` (a previous fit's parameters) replaces the grid, for bootstrap refits."""
    n_arr, d_arr, y = (np.asarray(v, float) for v in (n_params, tokens, loss))
    _check_points(y, 5, n_arr, d_arr)
    n0, d0 = float(n_arr.min()), float(d_arr.min())
    features = np.stack([n_arr / n0, d_arr / d0])
    starts = _grid(y) if start is None else [start]
    theta, at_bound, rmse, condition = _approach3(
        features, y, _two_term, ("E", "log_A", "a", "log_B", "b"), _two_term_bounds(y), starts)
    e, log_a, a, log_b, b = (float(v) for v in theta)
    return ChinchillaFit(E=e, A=math.exp(log_a), a=a, B=math.exp(log_b), b=b, N0=n0, D0=d0,
                         rmse=rmse, n=len(y), at_bound=at_bound, condition=condition)


def chinchilla_theta(fit: ChinchillaFit) -> np.ndarray:
    return np.array([fit.E, math.log(fit.A), fit.a, math.log(fit.B), fit.b])


def fit_curve(n_params: Sequence[float], s1: Sequence[float], s2: Sequence[float],
              loss: Sequence[float], start: np.ndarray | None = None,
              form: str = "q") -> CurveFit:
    """A schedule-aware law (moelab.ladder.curve, `form` in CURVE_FORMS) fitted to every
    evaluation point: S1 lr-weighted tokens, S2 the annealing area at each."""
    if form not in CURVE_FORMS:
        raise FitError(f"fit.curve_law: {form!r} is not one of {sorted(CURVE_FORMS)}")
    n_arr, s1_arr, s2_arr, y = (np.asarray(v, float) for v in (n_params, s1, s2, loss))
    _check_points(y, 6, n_arr, s1_arr)
    n0, d0 = float(n_arr.min()), float(s1_arr.min())
    features = _curve_features(form, n_arr, s1_arr, s2_arr, n0, d0)
    starts = _grid(y, (0.0, 1.0)) if start is None else [start]
    lower, upper = _two_term_bounds(y, 1)
    upper[-1] = CURVE_FORMS[form].c_max
    theta, at_bound, rmse, condition = _approach3(
        features, y, CURVE_FORMS[form].law, ("E", "log_A", "a", "log_B", "b", "C"),
        (lower, upper), starts)
    e, log_a, a, log_b, b, c = (float(v) for v in theta)
    return CurveFit(E=e, A=math.exp(log_a), a=a, B=math.exp(log_b), b=b, C=c, N0=n0, D0=d0,
                    rmse=rmse, n=len(y), at_bound=at_bound, condition=condition, form=form)


def curve_theta(fit: CurveFit) -> np.ndarray:
    return np.array([fit.E, math.log(fit.A), fit.a, math.log(fit.B), fit.b, fit.C])
