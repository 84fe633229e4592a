"""Scaling-law fits: L(C) = E + A * C^-alpha (the prediction) and L(N, D) = E + A/N^a + B/D^b.

Raw compute spans many decades (1e11 .. 1e14 FLOPs), so fitting A * C^-alpha directly
pits an A of 1e3 against an alpha of 0.1 and the solver stalls. Both fits therefore work in
normalized units, x = C / C0 with C0 the smallest rung's compute (N / N0 and D / D0 for the
second fit), and fit log A, so every free parameter is O(1). Bounds keep the law meaningful:
0 <= E < min(L) (the irreducible loss lies below every observed loss) and 0 < alpha <= 2.

The interval is a *residual* bootstrap: with 4-6 rungs, resampling rungs would often drop
the ends of the range and refit on 2-3 distinct points, so instead the fitted curve is kept
and its residuals (inflated by sqrt(n / (n - p)) for the degrees of freedom the fit used)
are resampled onto it and refitted. With n == p rungs the residuals are zero and so is the
interval's width; that is reported, not hidden.
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

Residuals = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray] | str]


class FitError(UserError):
    """The scaling law could not be fitted to the rungs (names why and what to change)."""


@dataclass(frozen=True)
class PowerLawFit:
    """L(C) = E + A * (C / C0)^-alpha, fitted to n rungs."""

    E: float
    A: float  # in units of C0: the loss above E at the smallest rung's compute
    alpha: float
    C0: float
    rmse: float  # of the fit's residuals, in loss units
    n: int

    def predict(self, compute: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A * (np.asarray(compute, float) / self.C0) ** -self.alpha

    @property
    def A_raw(self) -> float:
        """A in raw FLOPs: L = E + A_raw * C^-alpha."""
        return self.A * self.C0**self.alpha

    def to_dict(self) -> dict:
        return {**asdict(self), "A_raw": self.A_raw,
                "formula": "L(C) = E + A * (C / C0)^-alpha = E + A_raw * C^-alpha"}


@dataclass(frozen=True)
class ChinchillaFit:
    """L(N, D) = E + A * (N / N0)^-a + B * (D / D0)^-b (a == b when `tied`)."""

    E: float
    A: float
    a: float
    B: float
    b: float
    N0: float
    D0: float
    rmse: float
    n: int
    tied: bool
    at_bound: tuple[str, ...]  # parameters pinned to a bound: that split of N vs D is unidentified

    def predict(self, n_params: float | np.ndarray, tokens: float | np.ndarray):
        n = np.asarray(n_params, float) / self.N0
        d = np.asarray(tokens, float) / self.D0
        return self.E + self.A * n**-self.a + self.B * d**-self.b

    def to_dict(self) -> dict:
        return {**asdict(self), "at_bound": list(self.at_bound),
                "formula": "L(N, D) = E + A * (N / N0)^-a + B * (D / D0)^-b"}


@dataclass(frozen=True)
class Interval:
    """A bootstrap interval of the prediction at one compute, with the refits it used."""

    low: float
    high: float
    confidence: float
    samples: int  # refits that converged
    requested: int
    method: str
    params: np.ndarray  # [samples, 3]: (E, log A, alpha) of each refit, for plotting bands

    def band(self, compute: np.ndarray, fit: PowerLawFit) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) of the refits' predictions at each compute."""
        x = np.asarray(compute, float)[None, :] / fit.C0
        e, log_a, alpha = (self.params[:, i : i + 1] for i in range(3))
        curves = e + np.exp(log_a) * x**-alpha
        tail = (1 - self.confidence) / 2 * 100
        return np.percentile(curves, tail, axis=0), np.percentile(curves, 100 - tail, axis=0)

    def to_dict(self) -> dict:
        return {"low": self.low, "high": self.high, "confidence": self.confidence,
                "samples": self.samples, "requested": self.requested, "method": self.method}


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


def _solve(problem: Residuals, starts, bounds) -> tuple[np.ndarray | None, str]:
    """The lowest-cost converged least_squares solution over the starts, or (None, why)."""
    residuals, jacobian = problem
    best, why = None, "no start converged"
    lower, upper = np.array(bounds[0]), np.array(bounds[1])
    for x0 in starts:
        x0 = np.clip(x0, lower + 1e-9 * (1 + abs(lower)), upper - 1e-9 * (1 + abs(upper)))
        try:
            result = least_squares(residuals, x0, jac=jacobian, bounds=bounds, method="trf",
                                   x_scale="jac", max_nfev=500)
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
    return PowerLawFit(E=e, A=math.exp(log_a), alpha=alpha, C0=c0, rmse=rmse, n=len(c))


def bootstrap_interval(
    fit: PowerLawFit,
    compute: Sequence[float],
    loss: Sequence[float],
    at: float,
    samples: int = 1000,
    confidence: float = 0.9,
    seed: int = 0,
) -> Interval:
    """Residual-bootstrap interval of fit.predict(at) (see the module docstring)."""
    if not 0 < confidence < 1:
        raise FitError(f"confidence must be in (0, 1), got {confidence}")
    c, y = np.asarray(compute, float), np.asarray(loss, float)
    x = c / fit.C0
    fitted = fit.predict(c)
    n, p = len(c), 3
    residual = (y - fitted) * (math.sqrt(n / (n - p)) if n > p else 0.0)
    rng = np.random.default_rng(seed)
    start = np.array([fit.E, math.log(fit.A), fit.alpha])
    if not residual.any():  # n == p: the fit is exact and there is nothing to resample
        kept = [start] * samples
    else:
        kept = []
        for _ in range(samples):
            y_star = fitted + rng.choice(residual, size=n, replace=True)
            theta, _ = _solve(_power_residuals(x, y_star), [start], _power_bounds(y_star))
            if theta is not None:
                kept.append(theta)
    if not kept:
        raise FitError("no bootstrap refit converged; the interval is undefined")
    params = np.array(kept)
    preds = params[:, 0] + np.exp(params[:, 1]) * (at / fit.C0) ** -params[:, 2]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(preds, [tail, 100 - tail])
    value = float(fit.predict(at))
    method = (f"residual bootstrap, {samples} resamples of the {n} rungs' residuals "
              f"(scaled by sqrt(n/(n-p)), p=3), percentile interval")
    if n == p:
        method += "; with 3 rungs the fit is exact and the interval has zero width"
    return Interval(low=min(float(low), value), high=max(float(high), value),
                    confidence=confidence, samples=len(kept), requested=samples,
                    method=method, params=params)


# ------------------------------------------------------------------------- L(N, D)


def fit_chinchilla(
    n_params: Sequence[float], tokens: Sequence[float], loss: Sequence[float]
) -> ChinchillaFit:
    """L(N, D) = E + A/N^a + B/D^b over active params N and tokens D.

    Five parameters need at least six rungs; with exactly five the exponents are tied
    (a == b) to leave one degree of freedom. Rungs that grow N and D in lockstep cannot
    tell the two terms apart; such parameters end at a bound and are listed in at_bound.
    """
    n_arr, d_arr, y = (np.asarray(v, float) for v in (n_params, tokens, loss))
    _check_points(y, 5, n_arr, d_arr)
    tied = len(y) < 6
    n0, d0 = float(n_arr.min()), float(d_arr.min())
    nx, dx = n_arr / n0, d_arr / d0

    def unpack(theta: np.ndarray) -> tuple[float, ...]:
        if tied:
            e, log_a, log_b, exp_ = theta
            return e, log_a, exp_, log_b, exp_
        return tuple(theta)

    def residuals(theta: np.ndarray) -> np.ndarray:
        e, log_a, a, log_b, b = unpack(theta)
        return e + np.exp(log_a) * nx**-a + np.exp(log_b) * dx**-b - y

    lb_exp, ub_exp = ALPHA_MIN, ALPHA_MAX
    if tied:
        bounds = ([0.0, -LOG_A_BOUND, -LOG_A_BOUND, lb_exp],
                  [float(y.min()), LOG_A_BOUND, LOG_A_BOUND, ub_exp])
    else:
        bounds = ([0.0, -LOG_A_BOUND, lb_exp, -LOG_A_BOUND, lb_exp],
                  [float(y.min()), LOG_A_BOUND, ub_exp, LOG_A_BOUND, ub_exp])
    starts = []
    for e_frac in (0.0, 0.5, 0.8):
        excess = max(float(y.min()) * (1 - e_frac) / 2, 1e-6)
        for exp_ in (0.1, 0.3, 0.7):
            la = math.log(excess)
            starts.append(np.array([e_frac * y.min(), la, la, exp_] if tied
                                   else [e_frac * y.min(), la, exp_, la, exp_]))
    theta, why = _solve((residuals, "2-point"), starts, bounds)
    if theta is None:
        raise FitError(f"the fit of L(N, D) did not converge ({why})")
    names = ("E", "log_A", "log_B", "a=b") if tied else ("E", "log_A", "a", "log_B", "b")
    at_bound = tuple(name for name, v, lo, hi in zip(names, theta, *bounds, strict=True)
                     if _pinned(v, lo) or _pinned(v, hi))
    e, log_a, a, log_b, b = (float(v) for v in unpack(theta))
    rmse = float(np.sqrt(np.mean(residuals(theta) ** 2)))
    return ChinchillaFit(E=e, A=math.exp(log_a), a=a, B=math.exp(log_b), b=b, N0=n0, D0=d0,
                         rmse=rmse, n=len(y), tied=tied, at_bound=at_bound)
