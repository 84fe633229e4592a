"""A scaling law that can rise with repetition, fitted to rungs that repeat their data.

The law (after Lovelace et al. 2026, "Prescriptive Scaling Laws for Data Constrained
Training": the Chinchilla form plus an overfitting penalty, a power law in repetitions and
in the parameters-to-unique-data ratio):

    L(N, D, R) = E + A (N/N0)^-a + B (D/D0)^-b + P (R - 1)^r ((N/U) / Q0)^s   for R > 1

with N active parameters, D tokens trained, U = D / R unique tokens, R passes over them
(the penalty is 0 at R <= 1), and N0, D0, Q0 the smallest N, D and N/U among the points.
P, the loss the penalty adds at two passes and the smallest ratio, sets the repetition
cost; its interval comes from the fit's Jacobian (the delta method, residual variance over
n - p degrees of freedom), as the interval of every prediction does.

Beside it, Muennighoff et al. 2023's decay ("Scaling Data-Constrained Language Models"),
fitted to the same points with its R* free (published: 15.39, `curve.REPEAT_DECAY`):

    L = E + A (N/N0)^-a + B (D'/D0)^-b,   D' = U + U R* (1 - exp(-(R - 1) / R*))

D' grows with R, so this law makes a repeated token worth less, never harmful: its loss
cannot turn up with passes, which is why it cannot describe a small model that overfits.
A run over several sources is placed at its largest passes over any source (R), with
U = D / R.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import norm

from moelab.ladder.curve import REPEAT_DECAY
from moelab.ladder.fit import ALPHA_MAX, ALPHA_MIN, LOG_A_BOUND, FitError, _check_points, _solve

NAMES = ("E", "A", "a", "B", "b", "P", "r", "s")
# A direction of the parameters whose singular value is under this fraction of the largest
# is one the points leave flat: its sd would be 1e5 times the best-pinned direction's, and
# the delta method's pseudo-inverse drops it (an exact trade, as E, B and b with two token
# counts, comes out near 1e-10; the next direction on those rungs near 1e-2)
NULL_TOL = 1e-5
PENALTY_EXP_MAX = 3.0  # bounds of r and s: a penalty steeper than cubic is not identified
FORMULA = ("L(N, D, R) = E + A (N/N0)^-a + B (D/D0)^-b + P (R-1)^r ((N/U)/Q0)^s for R > 1, "
           "U = D/R (Lovelace et al. 2026)")
MUENNIGHOFF = ("L = E + A (N/N0)^-a + B (D'/D0)^-b, D' = U + U R* (1 - exp(-(R-1)/R*)) "
               "(Muennighoff et al. 2023)")


def _features(n, d, r, n0, d0, q0):
    n, d, r = (np.asarray(v, float) for v in (n, d, r))
    return n / n0, d / d0, np.maximum(r - 1.0, 0.0), (n * r / d) / q0


def _law(theta, feats):
    e, log_a, a, log_b, b, log_p, r, s = theta
    xn, xd, rep, q = feats
    return (e + np.exp(log_a) * xn**-a + np.exp(log_b) * xd**-b
            + np.exp(log_p) * rep**r * q**s)


def _muennighoff(theta, feats):
    e, log_a, a, log_b, b, log_r = theta
    xn, xd, rep, _ = feats
    r_star = np.exp(log_r)
    unique = xd / (1.0 + rep)
    effective = unique * (1.0 + r_star * (1.0 - np.exp(-rep / r_star)))
    return e + np.exp(log_a) * xn**-a + np.exp(log_b) * effective**-b


@dataclass(frozen=True)
class OverfitFit:
    E: float
    A: float
    a: float
    B: float
    b: float
    P: float
    r: float
    s: float
    N0: float
    D0: float
    Q0: float
    rmse: float
    n: int
    P_interval: tuple[float, float]  # of P, at `confidence`
    confidence: float
    muennighoff: dict  # the decay fitted to the same points: R*, rmse, the published R*
    cov: tuple = ()  # of (E, log A, a, log B, b, log P, r, s), residual variance scaled
    # unit directions of those parameters along which no fitted point's loss changes (the
    # Jacobian's singular values under NULL_TOL of its largest): the fit cannot place them
    null_space: tuple = ()

    def _theta(self) -> np.ndarray:
        return np.array([self.E, math.log(self.A), self.a, math.log(self.B), self.b,
                         math.log(self.P), self.r, self.s])

    def predict(self, n_params, tokens, passes):
        return _law(self._theta(), _features(n_params, tokens, passes, self.N0, self.D0,
                                             self.Q0))

    def _gradient(self, n_params: float, tokens: float, passes: float
                  ) -> tuple[float, np.ndarray]:
        """The law's value at one run and its gradient in the parameters."""
        theta, feats = self._theta(), _features(n_params, tokens, passes, self.N0, self.D0,
                                                self.Q0)
        value = float(_law(theta, feats))
        return value, np.array([(float(_law(theta + h, feats)) - value) / 1e-6
                                for h in np.eye(len(theta)) * 1e-6])

    def unpinned(self, n_params: float, tokens: float, passes: float) -> dict:
        """How far the prediction at one run moves, as a fraction of its value, per unit
        step along a direction of the parameters that leaves every fitted point's loss
        unchanged (`shift`, 0 when the points pin every direction), and the parameters
        that direction is mostly made of."""
        if not self.null_space:
            return {"shift": 0.0, "parameters": []}
        value, grad = self._gradient(n_params, tokens, passes)
        moves = [abs(float(grad @ np.array(v))) / abs(value) for v in self.null_space]
        worst = self.null_space[int(np.argmax(moves))]
        weights = np.abs(np.array(worst))
        names = [name for name, w in zip(NAMES, weights, strict=True)
                 if w >= 0.15 * weights.max()]
        return {"shift": max(moves), "parameters": names}

    def interval(self, n_params: float, tokens: float, passes: float) -> dict:
        """The prediction at one run with its delta-method interval: the parameters'
        covariance through the law's gradient, plus one run's own residual noise."""
        value, grad = self._gradient(n_params, tokens, passes)
        sd = math.sqrt(float(grad @ np.array(self.cov) @ grad) + self.rmse**2)
        z = norm.ppf(0.5 + self.confidence / 2)
        return {"value": value, "low": value - z * sd, "high": value + z * sd,
                "confidence": self.confidence,
                "method": "delta method on the fit's Jacobian plus the residual sd"}

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("cov", "null_space")}
        out["P_interval"] = {"low": self.P_interval[0], "high": self.P_interval[1]}
        return {**out, "formula": FORMULA}


def _starts(y: np.ndarray, p: int) -> list[np.ndarray]:
    e = 0.5 * float(y.min())
    excess = math.log(max(float(np.mean(y)) - e, 1e-6))
    starts = []
    for a in (0.3, 0.8):
        for tail in ((0.0, 1.0, 1.0), (-2.0, 0.5, 0.5), (math.log(REPEAT_DECAY),)):
            if len(tail) + 5 == p:
                starts.append(np.array([e, excess, a, excess, a, *tail]))
    return starts


def fit_overfit(n_params, tokens, passes, loss, confidence: float = 0.9) -> OverfitFit:
    """Fit the law above (least squares on L) to runs (N, D, R, loss), and beside it
    Muennighoff's decay with its R* free. Raises FitError when the points cannot fit it."""
    n, d, r, y = (np.asarray(v, float) for v in (n_params, tokens, passes, loss))
    if not np.any(r > 1.0) or len(np.unique(np.round(r[r > 1], 3))) < 2:
        raise FitError("the repetition law needs runs at two or more pass counts above 1 "
                       f"(got passes {sorted(set(np.round(r, 2).tolist()))}); train rungs on "
                       "a small unique subset for 1 to 16 passes")
    _check_points(y, len(NAMES), n, d, r)
    n0, d0, q0 = float(n.min()), float(d.min()), float((n * r / d).min())
    feats = _features(n, d, r, n0, d0, q0)
    high = float(y.min())

    def problem(law):
        return (lambda t: law(t, feats) - y), "2-point"

    exp = [ALPHA_MIN, ALPHA_MAX]
    bounds = ([0.0, -LOG_A_BOUND, exp[0], -LOG_A_BOUND, exp[0], -LOG_A_BOUND, exp[0], 0.0],
              [high, LOG_A_BOUND, exp[1], LOG_A_BOUND, exp[1], LOG_A_BOUND, PENALTY_EXP_MAX,
               PENALTY_EXP_MAX])
    theta, why = _solve(problem(_law), _starts(y, 8), bounds)
    if theta is None:
        raise FitError(f"the repetition law {FORMULA} did not converge ({why})")
    resid = _law(theta, feats) - y
    dof = max(len(y) - len(theta), 1)
    jac = np.array([(_law(theta + h, feats) - _law(theta, feats)) / 1e-6
                    for h in np.eye(len(theta)) * 1e-6]).T
    cov = float(resid @ resid) / dof * np.linalg.pinv(jac.T @ jac)
    _, singular, directions = np.linalg.svd(jac, full_matrices=False)
    null_space = tuple(tuple(v.tolist()) for v, sv in zip(directions, singular, strict=True)
                       if sv < NULL_TOL * singular[0])
    z = norm.ppf(0.5 + confidence / 2)
    half = z * math.sqrt(max(cov[5, 5], 0.0))
    m_theta, m_why = _solve(problem(_muennighoff), _starts(y, 6),
                            ([0.0, -LOG_A_BOUND, exp[0], -LOG_A_BOUND, exp[0], math.log(0.1)],
                             [high, LOG_A_BOUND, exp[1], LOG_A_BOUND, exp[1], math.log(1e3)]))
    muennighoff = ({"skipped": m_why} if m_theta is None else
                   {"r_star": float(math.exp(m_theta[5])), "published_r_star": REPEAT_DECAY,
                    "rmse": float(np.sqrt(np.mean((_muennighoff(m_theta, feats) - y) ** 2))),
                    "formula": MUENNIGHOFF})
    e, log_a, a, log_b, b, log_p, rr, s = (float(v) for v in theta)
    return OverfitFit(E=e, A=math.exp(log_a), a=a, B=math.exp(log_b), b=b, P=math.exp(log_p),
                      r=rr, s=s, N0=n0, D0=d0, Q0=q0,
                      rmse=float(np.sqrt(np.mean(resid**2))), n=len(y),
                      P_interval=(math.exp(log_p - half), math.exp(log_p + half)),
                      confidence=confidence, muennighoff=muennighoff,
                      cov=tuple(map(tuple, cov.tolist())), null_space=null_space)
