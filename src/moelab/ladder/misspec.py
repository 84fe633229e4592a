"""Intervals that cover model error, not only seed noise (`fit.misspecification: true`).

A law's bootstrap interval says how far seed noise can move its value; it cannot say how
wrong the law's form is far from the rungs, and that is what missed outside its interval
on a held-out spec (a 6% miss against a ~2% band). The ladder measures that error itself:
its leave-one-compute-level-out backtests that *extrapolate* (the lowest and the highest
level held out, predicted from the others) give a relative error e_k at a distance d_k in
ln C from the nearest fitted level. The law's error grows with distance, so its rate is
taken as r = sqrt(mean((e_k / d_k)^2)), and at the target, d = ln(C_target / C_top) past
the top level, the relative misspecification sd is r d. The interval's half-widths add
z r d value in quadrature (z the normal quantile of fit.confidence).

Coverage: each extrapolating backtest is scored against the interval it would have had,
its rate estimated from the *other* extrapolating backtests (leave one out) and the seed
noise of its points: the share of held-out losses inside, over n backtests.

Off by default (on for a spec with fit.repetition: measured, spec.MEASURED_DEFAULTS):
specs written before it keep their numbers.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

from moelab.ladder.fit import FitError


def extrapolations(backtest: list[dict[str, Any]], levels: np.ndarray,
                   compute: np.ndarray) -> list[dict[str, Any]]:
    """The backtests that held out the lowest or the highest compute level: their mean
    relative error and distance in ln C from the nearest level left in the fit."""
    log_c = [float(np.log(compute[levels == k]).mean()) for k in range(int(levels.max()) + 1)]
    out = []
    for entry in backtest:
        k = entry["level"]
        if "points" not in entry or k not in (0, len(log_c) - 1) or len(log_c) < 3:
            continue
        distance = min(abs(log_c[k] - x) for j, x in enumerate(log_c) if j != k)
        out.append({"level": k, "rel_error": entry["mean_rel_error"], "distance": distance})
    return out


def rate(terms: list[dict[str, Any]]) -> float | None:
    """Relative error per unit of ln C: the root mean square of error / distance."""
    if not terms:
        return None
    return math.sqrt(float(np.mean([(t["rel_error"] / t["distance"]) ** 2 for t in terms])))


def widen(law: dict[str, Any], terms: list[dict[str, Any]], distance: float,
          confidence: float, point_rel_sd: float) -> None:
    """Add the misspecification term to `law`'s interval in place (its bootstrap interval
    kept under "interval_seed"); a law with no extrapolating backtest is left as it is,
    saying so. point_rel_sd: one point's seed sd over its loss, for the coverage."""
    r = rate(terms)
    if r is None:
        law["misspecification"] = {"skipped": "no extrapolating backtest (needs 3+ compute "
                                              "levels and a law fitted by levels)"}
        return
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    value, iv = law["value"], law["interval"]
    sd = r * max(distance, 0.0)
    half = z * sd * abs(value)
    law["interval_seed"] = dict(iv)
    law["interval"] = {**iv, "low": value - math.hypot(value - iv["low"], half),
                       "high": value + math.hypot(iv["high"] - value, half),
                       "method": iv["method"] + "; plus a misspecification term in "
                                 f"quadrature: z {z:.3f} x {r:.4f} per ln C x {distance:.3f} "
                                 "ln C past the top level (moelab.ladder.misspec)"}
    law["misspecification"] = {"rate_per_ln_compute": r, "distance_ln_compute": distance,
                               "relative_sd": sd, "terms": terms,
                               "coverage": coverage(terms, point_rel_sd, confidence)}


def coverage(terms: list[dict[str, Any]], point_rel_sd: float,
             confidence: float) -> dict[str, Any]:
    """Each extrapolating backtest against its leave-one-out interval: inside or not."""
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    rows = []
    for i, t in enumerate(terms):
        r = rate(terms[:i] + terms[i + 1:]) or 0.0
        half = z * math.hypot(point_rel_sd, r * t["distance"])
        rows.append({**t, "half_width_rel": half, "inside": abs(t["rel_error"]) <= half})
    inside = [row["inside"] for row in rows]
    return {"nominal": confidence, "n": len(rows),
            "measured": float(np.mean(inside)) if rows else None, "backtests": rows}


def disagreement(laws: dict[str, Any], chosen: str) -> dict[str, Any]:
    """How far the laws' values spread against the chosen law's interval width; `exceeds`
    when the spread is wider than the interval (the pre-registration then says so)."""
    values = {k: v["value"] for k, v in laws.items() if "value" in v}
    law = laws[chosen]
    spread = max(values.values()) - min(values.values())
    width = law["interval"]["high"] - law["interval"]["low"]
    return {"values": values, "spread": spread, "interval_width": width,
            "exceeds": spread > width,
            "note": (f"the laws spread {spread / law['value']:.1%} of the value, more than "
                     f"the {width / law['value']:.1%} wide interval of `{chosen}`: the choice "
                     "of law matters more than the interval says" if spread > width else
                     "the laws agree within the interval")}


def choose(laws: dict[str, Any]) -> str:
    """fit.law: backtest: the law with the smallest misspecification rate (ties: the
    first), among those with one."""
    rated = [(law["misspecification"]["rate_per_ln_compute"], name)
             for name, law in laws.items()
             if "rate_per_ln_compute" in law.get("misspecification", {})]
    if not rated:
        raise FitError("fit.law: backtest needs a law with an extrapolating backtest (3 or "
                       "more compute levels); name the law instead")
    return min(rated)[1]
