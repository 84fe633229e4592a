"""The repetition law that can rise (moelab.ladder.overfit), on synthetic rungs only."""

import numpy as np
import pytest

from moelab.ladder.fit import FitError
from moelab.ladder.overfit import fit_overfit

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
