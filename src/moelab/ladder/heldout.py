"""The held-out table: every held-out ladder's stage ends, predicted against actual, and the
coverage of the 90% intervals over the rungs' backtests and the held-out targets.

One entry per spec, built from its report (moelab.ladder.report.build_report). The table
keeps every entry it ever held: a spec run again replaces its own entry, the others stay
(a changed method gets new held-out specs, and the old results stay in the table), and the
coverage is recomputed over all of them.
"""

from __future__ import annotations

from typing import Any

KIND = "moelab.ladder.heldout/1"


def entry(spec_name: str, report: dict[str, Any]) -> dict[str, Any]:
    """A spec's row: its stage ends (the last is the final), the curve's median error, and
    what its coverage counts: each extrapolating backtest of the rungs (inside its
    leave-one-out interval or not) and each stage end of the target (inside or not)."""
    stages = report["stages"] or [{
        "name": "final", "predicted": report["predicted"], "actual": report["actual"],
        "interval": report["interval"], "relative_error": report["relative_error"],
        "within_interval": report["within_interval"], "index": 0}]
    rows = [{"name": s["name"] or f"stage {s.get('index', i)}", "predicted": s["predicted"],
             "actual": s["actual"],
             "interval": {"low": s["interval"]["low"], "high": s["interval"]["high"]},
             "relative_error": s["relative_error"], "within_interval": s["within_interval"]}
            for i, s in enumerate(stages)]
    backtests = (report.get("coverage") or {}).get("backtests", [])
    passes = report.get("passes") or {}
    return {"name": spec_name, "target_over_largest_rung": report["compute_ratio"],
            "law": report["law"], "stages": rows,
            "curve_median_abs_rel_error": report["curve_median_abs_rel_error"],
            "passes_max": passes.get("target_max"),
            # the LR the target's matrices trained at (the width rule of its method)
            "target_matrix_lr": (report.get("target") or {}).get("matrix_lr"),
            "corpus": (report.get("corpus") or {}).get("content_sha256"),
            "preregistration_sha256": report["preregistration"]["sha256"],
            "coverage_items": {
                "backtests": [bool(b["inside"]) for b in backtests],
                "targets": [bool(r["within_interval"]) for r in rows
                            if r["within_interval"] is not None]}}


def table(entries: list[dict[str, Any]], previous: dict[str, Any] | None = None,
          nominal: float = 0.9) -> dict[str, Any]:
    """The table over `previous`'s entries with `entries` replacing those of their names."""
    kept = {e["name"]: e for e in (previous or {}).get("specs", [])}
    kept.update({e["name"]: e for e in entries})
    specs = list(kept.values())
    inside = [x for e in specs for part in ("backtests", "targets")
              for x in e["coverage_items"][part]]
    return {"kind": KIND, "specs": specs,
            "coverage": {"nominal": nominal, "n": len(inside),
                         "measured": sum(inside) / len(inside) if inside else None,
                         "n_backtests": sum(len(e["coverage_items"]["backtests"])
                                            for e in specs),
                         "n_targets": sum(len(e["coverage_items"]["targets"]) for e in specs)}}
