"""Scaling ladder: train small rungs (with seed replicates and cooldown branches), fit,
pre-register the bigger target's final loss and whole curve, train it, report.

spec (YAML specs, expansion into runs, validation) -> runner (train, pre-register) with
evaluate (whole-val-split score at every eval point) -> predict (points, noise, laws,
backtest, curve, stability, lr check) on fit (approach 3, L(C), curve law, parametric
bootstrap) and curve (schedule areas) -> prereg (write-once record) -> report (JSON,
Markdown, PNG). results (each finished run's curve, loss and cost, read from its run
directory) is what predict, report and runner share, so none imports another's
orchestration. The CLI is `moelab ladder`.
"""
