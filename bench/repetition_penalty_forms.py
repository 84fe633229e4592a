"""Which overfitting penalty describes the measured-repetition rungs? A development study
(issue 47) on `repetition_v2`'s 23 rungs: the library's law (moelab.ladder.overfit, after
Lovelace et al. 2026) beside penalties that grow with the tokens spent repeating.

    python3 bench/repetition_penalty_forms.py       # reads the kept report, trains nothing

Every form is the Chinchilla base E + A (N/N0)^-a + B (D/D0)^-b plus a penalty that is 0 at
one pass (R <= 1):

- `lovelace`:            P (R-1)^r ((N/U)/Q0)^s, s >= 0 (the library's law)
- `lovelace_s_free`:     the same with s of either sign
- `repeat_steps`:        P (R-1)^r (D/D0)^t: at fixed passes, more tokens (steps) spent
                         on the repeated subset cost more, which the rungs suggested
                         (at 16 passes the 12.5K-token subset ended below the 25K one)
- `repeat_steps_nu`:     P (R-1)^r (D/D0)^t ((N/U)/Q0)^s, both
- `repeated_tokens`:     P ((D-U)/D0)^r: only the count of tokens seen again

For each: rmse, the residual sd as a share of the rungs' mean loss (what
`fit.max_rung_residual` compares with its 2% cap), the largest relative residual, and each
rung left out in turn (fitted on the other 22, the error at the one left out). The
target's loss is known (7.099), so each form's value there is printed as **hindsight**:
a form chosen on it would have to be tried on a new target before it counts.

Writes bench/results/repetition_penalty_forms/repetition_penalty_forms.json. It times
nothing, so it does not wait for a quiet machine (~3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np

from moelab.ladder.fit import ALPHA_MAX, ALPHA_MIN, LOG_A_BOUND, _solve
from moelab.ladder.overfit import PENALTY_EXP_MAX
from moelab.ladder.overfit import _features as library_features
from moelab.ladder.spec import FitOptions

HERE = Path(__file__).parent / "results"
REPORT = HERE / "ladder_repetition" / "repetition_v2" / "report.json"
RESULTS = HERE / "repetition_penalty_forms" / "repetition_penalty_forms.json"
EXP = PENALTY_EXP_MAX
# (penalty, bounds of its exponents after log P); the features are the library's:
# xn = N/N0, xd = D/D0, rep = max(R-1, 0), q = (N/U)/Q0
FORMS = {
    "lovelace": (lambda p, xn, xd, rep, q: p[0] * rep ** p[1] * q ** p[2],
                 [(ALPHA_MIN, EXP), (0.0, EXP)]),
    "lovelace_s_free": (lambda p, xn, xd, rep, q: p[0] * rep ** p[1] * q ** p[2],
                        [(ALPHA_MIN, EXP), (-EXP, EXP)]),
    "repeat_steps": (lambda p, xn, xd, rep, q: p[0] * rep ** p[1] * xd ** p[2],
                     [(ALPHA_MIN, EXP), (-EXP, EXP)]),
    "repeat_steps_nu": (lambda p, xn, xd, rep, q: p[0] * rep ** p[1] * xd ** p[2] * q ** p[3],
                        [(ALPHA_MIN, EXP), (-EXP, EXP), (-EXP, EXP)]),
    "repeated_tokens": (lambda p, xn, xd, rep, q: p[0] * (xd * rep / (1.0 + rep)) ** p[1],
                        [(ALPHA_MIN, EXP)]),
}


def features(n, d, r, ref):
    return library_features(n, d, r, *ref)


def law(penalty):
    def value(theta, feats):
        e, log_a, a, log_b, b, log_p, *rest = theta
        xn, xd, rep, q = feats
        return (e + math.exp(log_a) * xn ** -a + math.exp(log_b) * xd ** -b
                + penalty([math.exp(log_p), *rest], xn, xd, rep, q))
    return value


def fit(form: str, n, d, r, y, ref):
    """Least squares over a grid of starts (the library's solver and bounds)."""
    penalty, extra = FORMS[form]
    f, feats = law(penalty), features(n, d, r, ref)
    lower = [0.0, -LOG_A_BOUND, ALPHA_MIN, -LOG_A_BOUND, ALPHA_MIN, -LOG_A_BOUND]
    upper = [float(y.min()), LOG_A_BOUND, ALPHA_MAX, LOG_A_BOUND, ALPHA_MAX, LOG_A_BOUND]
    lower += [lo for lo, _ in extra]
    upper += [hi for _, hi in extra]
    level = math.log(max(float(y.mean()) - 0.5 * float(y.min()), 1e-6))
    starts = [np.array([0.5 * float(y.min()), level, a, level, a, log_p, *tail])
              for a in (0.3, 0.8) for log_p in (-2.0, 0.0)
              for tail in itertools.product(*[(0.5, 1.5)] * len(extra))]
    theta, why = _solve(((lambda t: f(t, feats) - y), "2-point"), starts, (lower, upper))
    if theta is None:
        raise SystemExit(f"error: the {form} form did not converge ({why})")
    return f, theta


def study(points: list[dict], passes: list[float], target: dict) -> dict:
    n = np.array([p["active_params"] for p in points], float)
    d = np.array([p["tokens"] for p in points], float)
    r = np.array(passes, float)
    y = np.array([p["mean"] for p in points], float)
    ref = (float(n.min()), float(d.min()), float((n * r / d).min()))
    t_n, t_d = float(target["active_params"]), float(target["tokens"])
    t_r, t_y = float(target["passes"]), float(target["final_val_loss"])
    forms = {}
    for form in FORMS:
        f, theta = fit(form, n, d, r, y, ref)
        resid = f(theta, features(n, d, r, ref)) - y
        rmse = float(np.sqrt(np.mean(resid ** 2)))
        left_out = []
        for i in range(len(y)):
            keep = np.arange(len(y)) != i
            f_i, theta_i = fit(form, n[keep], d[keep], r[keep], y[keep], ref)
            left_out.append(abs(float(f_i(theta_i, features(n[i:i + 1], d[i:i + 1],
                                                               r[i:i + 1], ref))[0]) - y[i])
                            / y[i])
        at_target = float(f(theta, features(np.array([t_n]), np.array([t_d]),
                                             np.array([t_r]), ref))[0])
        forms[form] = {
            "parameters_after_P": [float(v) for v in theta[6:]], "P": math.exp(theta[5]),
            "rmse": rmse, "relative_rmse": rmse / float(y.mean()),
            "max_relative_residual": float(np.max(np.abs(resid) / y)),
            "leave_one_out_median": float(np.median(left_out)),
            "leave_one_out_max": float(np.max(left_out)),
            "hindsight_target": at_target,
            "hindsight_target_relative_error": (at_target - t_y) / t_y}
        row = forms[form]
        print(f"{form:16s} rmse {rmse:.3f} ({row['relative_rmse']:.1%} of the loss), largest "
              f"{row['max_relative_residual']:.1%}, left out median "
              f"{row['leave_one_out_median']:.1%} / max {row['leave_one_out_max']:.1%}; "
              f"hindsight target {at_target:.3f} ({row['hindsight_target_relative_error']:+.1%})")
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", type=Path, default=REPORT)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.report.is_file():
        raise SystemExit(f"error: no report at {args.report}; run `python3 "
                         "bench/ladder_repetition.py` after repetition_v2 finishes")
    report = json.loads(args.report.read_text())
    measured = report["repetition_measured"]
    # a run sits at its largest passes over any source, as the library places it
    target = {**report["target"], "passes": max(report["passes"]["target"].values())}
    forms = study(report["points"], measured["passes"], target)
    cap = FitOptions().max_rung_residual
    report_path = args.report.resolve()
    root = Path(__file__).resolve().parents[1]
    shown = report_path.relative_to(root) if report_path.is_relative_to(root) else report_path
    out = {"kind": "moelab.bench.repetition_penalty_forms/1", "report": shown.as_posix(),
           "n_rungs": len(report["points"]), "target_actual": target["final_val_loss"],
           "target_passes": target["passes"], "library_rmse": measured["rmse"],
           "max_rung_residual_cap": cap, "forms": forms,
           "any_within_cap": any(f["relative_rmse"] <= cap for f in forms.values())}
    # the bench's `lovelace` form is the library's law: the same least squares must land
    # on the same optimum (1e-3 nats: both stop at least_squares' default tolerances)
    out["library_agrees"] = abs(forms["lovelace"]["rmse"] - measured["rmse"]) < 1e-3
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"library's law rmse {measured['rmse']:.3f} (agrees: {out['library_agrees']}); "
          f"a form within fit.max_rung_residual's {cap:.0%}: {out['any_within_cap']} "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
