"""Intervals that cover model error: fit.misspecification adds a term estimated from the
rungs' own extrapolating backtests; fit.law: backtest picks the law by them; coverage and
the laws' disagreement are stated. Off (the default) nothing changes."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
from test_ladder_stages import law, staged_spec, synthetic_results

from moelab.config import ConfigError
from moelab.ladder import misspec
from moelab.ladder.predict import forecast
from moelab.ladder.spec import spec_from_dict


def drifting(n: float, d0: float, d: float) -> float:
    """The last stage's law times a drift in ln D that L(N, D) cannot represent: the
    backtests that extrapolate see it, as a held-out target would."""
    return law(1, n, d) * (1 + 0.004 * math.log(d / 1e4) ** 2)


def small_spec(path) -> dict:
    """The staged synthetic ladder at its cheapest: one branch per rung, 10 resamples."""
    raw = staged_spec(path, branches=(50,))
    raw["fit"]["bootstrap"] = 10
    return raw


def test_the_misspecification_term_widens_each_law_by_its_own_backtests(tmp_path):
    """With the drift, every law's interval is its seed-only interval with z r d value
    added in quadrature (r: the RMS of error / distance over the extrapolating backtests,
    d: the target's ln C past the top level) - exactly, as the record states; the default
    spec's record has none of it and the same seed-only interval."""
    raw = small_spec(tmp_path / "data")
    plain = spec_from_dict(raw, "plain", tmp_path / "a")
    results = synthetic_results(plain, drifting)
    base = forecast(plain, results, [])
    raw["fit"]["misspecification"] = True
    spec = spec_from_dict(raw, "wide", tmp_path / "b")
    record = forecast(spec, results, [])
    assert "coverage" not in base and "laws_disagree" not in base["prediction"]
    z = NormalDist().inv_cdf(0.95)
    for name in ("chinchilla", "curve"):
        law_, before = record["laws"][name], base["laws"][name]
        m = law_["misspecification"]
        assert law_["interval_seed"]["low"] == pytest.approx(before["interval"]["low"], rel=1e-12)
        terms = m["terms"]
        assert {t["level"] for t in terms} == {0, max(t["level"] for t in terms)}
        r = math.sqrt(np.mean([(t["rel_error"] / t["distance"]) ** 2 for t in terms]))
        assert m["rate_per_ln_compute"] == pytest.approx(r, rel=1e-12) and r > 0
        half = z * r * m["distance_ln_compute"] * law_["value"]
        seed = law_["interval_seed"]
        assert law_["interval"]["low"] == pytest.approx(
            law_["value"] - math.hypot(law_["value"] - seed["low"], half), rel=1e-12)
        assert law_["interval"]["high"] - law_["interval"]["low"] > \
            seed["high"] - seed["low"]
    # the chinchilla law's term grows with the target's distance: ln(C_t / C_top)
    top = max(r.compute for r in spec.rungs)
    assert record["laws"]["chinchilla"]["misspecification"]["distance_ln_compute"] == \
        pytest.approx(math.log(spec.target.compute / top), rel=1e-9)
    assert record["coverage"]["n"] == 2 and record["coverage"]["nominal"] == 0.9
    assert record["prediction"]["laws_disagree"]["exceeds"] in (True, False)


def test_law_backtest_picks_the_smallest_rate_and_needs_the_term(tmp_path):
    raw = small_spec(tmp_path / "data")
    raw["fit"].update(misspecification=True, law="backtest")
    spec = spec_from_dict(raw, "choose", tmp_path / "a")
    record = forecast(spec, synthetic_results(spec, drifting), [])
    rates = record["law_choice"]["rates"]
    chosen = min((r, k) for k, r in rates.items() if r is not None)[1]
    assert record["prediction"]["law"] == record["law_choice"]["chosen"] == chosen
    assert record["stages"][0]["law"] == chosen  # the stage ends follow the same law
    raw["fit"]["misspecification"] = False
    with pytest.raises(ConfigError, match=r"^fit.law: backtest chooses by"):
        spec_from_dict(raw, "bad", tmp_path)


def test_coverage_scores_each_backtest_against_its_leave_one_out_interval():
    """Two backtests at errors 1% and 4%, distance 0.5 each: each one's interval uses the
    other's rate (2%/0.5 and 8%/0.5 per ln C): the 1% one is inside the 4%-rate interval,
    the 4% one outside the 1%-rate one (z 1.645 x 1% = 1.6% < 4%)."""
    terms = [{"level": 0, "rel_error": 0.01, "distance": 0.5},
             {"level": 3, "rel_error": -0.04, "distance": 0.5}]
    cov = misspec.coverage(terms, 0.0, 0.9)
    assert [row["inside"] for row in cov["backtests"]] == [True, False]
    assert cov["measured"] == 0.5 and cov["n"] == 2
    laws = {"a": {"value": 3.0, "interval": {"low": 2.9, "high": 3.1}},
            "b": {"value": 3.3, "interval": {"low": 3.2, "high": 3.4}}}
    assert misspec.disagreement(laws, "a")["exceeds"]  # 0.3 apart, interval 0.2 wide
    laws["b"]["value"] = 3.1
    assert not misspec.disagreement(laws, "a")["exceeds"]


def synthetic_report(ratio: float, stages: list[tuple[str, float, float, float, float]],
                     backtests: list[bool]) -> dict:
    """A ladder report as build_report writes it: (name, predicted, actual, low, high) per
    stage end, and the rungs' backtests inside their intervals or not."""
    scored = [{"name": n, "index": i, "predicted": p, "actual": a,
               "interval": {"low": lo, "high": hi, "confidence": 0.9},
               "relative_error": (p - a) / a, "within_interval": lo <= a <= hi}
              for i, (n, p, a, lo, hi) in enumerate(stages)]
    return {"compute_ratio": ratio, "law": "chinchilla", "stages": scored,
            "curve_median_abs_rel_error": 0.01, "preregistration": {"sha256": "x"},
            "coverage": {"backtests": [{"inside": b} for b in backtests]},
            "passes": {"target_max": 0.4}, "corpus": {"content_sha256": "c0ffee"}}


def test_the_heldout_table_has_the_issues_schema_and_keeps_old_entries():
    """Two specs: 2 + 3 stage ends (4 of 5 inside) and 2 + 1 backtests (2 of 3 inside):
    coverage 6 of 8. Run again, a spec replaces its own entry; the other stays."""
    from moelab.ladder import heldout

    a = heldout.entry("a", synthetic_report(16.3, [("", 3.0, 3.03, 2.9, 3.1),
                                                   ("decay", 2.8, 2.9, 2.7, 2.85)],
                                            [True, False]))
    b = heldout.entry("b", synthetic_report(30.5, [("s0", 3.0, 3.0, 2.9, 3.1),
                                                   ("s1", 2.9, 2.95, 2.8, 3.0),
                                                   ("s2", 2.7, 2.72, 2.6, 2.8)], [True]))
    t = heldout.table([a, b])
    assert [s["name"] for s in t["specs"]] == ["a", "b"]
    first = t["specs"][0]
    assert first["target_over_largest_rung"] == 16.3 and first["corpus"] == "c0ffee"
    assert first["stages"][0]["name"] == "stage 0" and first["stages"][1]["name"] == "decay"
    assert set(first["stages"][1]) >= {"name", "predicted", "actual", "interval",
                                       "relative_error"}
    assert first["stages"][1]["interval"] == {"low": 2.7, "high": 2.85}
    assert first["stages"][1]["relative_error"] == pytest.approx((2.8 - 2.9) / 2.9)
    assert first["curve_median_abs_rel_error"] == 0.01
    assert t["coverage"] == {"nominal": 0.9, "n": 8, "measured": 6 / 8, "n_backtests": 3,
                             "n_targets": 5}
    again = heldout.entry("a", synthetic_report(16.3, [("", 3.0, 3.0, 2.9, 3.1)], []))
    t2 = heldout.table([again], t)
    assert [s["name"] for s in t2["specs"]] == ["a", "b"] and len(t2["specs"][0]["stages"]) == 1
    assert t2["coverage"]["n"] == 5
