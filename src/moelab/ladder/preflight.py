"""Everything a ladder run can be refused for, checked before the first rung trains.

`load_spec` checks what a spec is (its shape, its rungs' configs, the compute ratio); this
checks what `ladder run` needs to reach its end: a pre-registered law with enough points
to fit, measured or stated noise for its interval, stage mixtures naming sources the
corpus has, a lab experiment that exists and an output directory it may write. Each of
these otherwise fails after rungs have trained (hours, on a real ladder).
"""

from __future__ import annotations

from moelab import outputs
from moelab.config import ConfigError, data_dir
from moelab.config.plan import check_sources
from moelab.errors import UserError
from moelab.ladder.fit import compute_levels
from moelab.ladder.prereg import PREREG_FILE
from moelab.ladder.spec import LadderSpec

# points each law is fitted to (fit.py's _check_points): L(N, D) has 5 parameters, L(C)
# 3, fitted to one IsoFLOP minimum per compute level
LAW_MINIMUM = {"chinchilla": ("distinct points (rungs or branches)", 5),
               "compute": ("compute levels (its IsoFLOP minima)", 3)}


# fit.law: backtest picks the law whose backtests that hold out the lowest or the highest
# compute level extrapolate best (moelab.ladder.misspec): with two levels, holding one out
# leaves a single level, and there is nothing to extrapolate from
BACKTEST_LEVELS = 3


def check_spec(spec: LadderSpec) -> None:
    """Raise a one-line UserError for the first reason the spec itself could not reach its
    pre-registration (whoever runs it: `ladder run`, a benchmark, a Ray driver)."""
    _check_law(spec)
    _check_noise(spec)
    _check_sources(spec)


def check_ladder_run(spec: LadderSpec, experiment: str | None) -> None:
    """Raise a one-line UserError for the first reason `ladder run` could not finish."""
    check_spec(spec)
    if experiment:
        from moelab.lab.store import Store, default_lab_path

        with Store(default_lab_path(), mode="ro") as store:
            store.get_experiment(experiment)  # a UserError naming it if unknown
    legacy = any((spec.out / r.name).is_dir() for r in spec.runs()) or (
        spec.out / PREREG_FILE).exists()  # a ladder directory from before the marker
    outputs.check_dir(spec.out, ours=True if legacy else None, made_by=("ladder run",))


def _levels(spec: LadderSpec) -> int:
    return int(compute_levels([runs[0].compute for runs in spec.points().values()]).max()) + 1


def _check_law(spec: LadderSpec) -> None:
    law = spec.fit.law
    if law == "backtest" and (have := _levels(spec)) < BACKTEST_LEVELS:
        raise ConfigError(f"fit.law: backtest chooses the law by backtests that hold out the "
                          f"lowest or the highest compute level, which needs at least "
                          f"{BACKTEST_LEVELS} compute levels among the rungs; the spec has "
                          f"{have}; add rungs at another compute or name the law")
    if law not in LAW_MINIMUM:
        return  # the curve law fits every evaluation of every rung: dozens of points
    what, needed = LAW_MINIMUM[law]
    points = spec.points()
    have = len(points) if law == "chinchilla" else _levels(spec)
    if have < needed:
        raise ConfigError(f"fit.law: {law} needs at least {needed} {what}, the spec has "
                          f"{have}; add rungs or choose another fit.law")


def _check_noise(spec: LadderSpec) -> None:
    replicated = any(len(runs) > 1 for runs in spec.points().values())
    if not replicated and spec.fit.noise_sd is None:
        raise ConfigError("the spec has no seed replicates (`seeds: [..]`) and no "
                          "fit.noise_sd, so the prediction's interval would have no measured "
                          "noise; add seeds, or state fit.noise_sd from an earlier measurement")


def _check_sources(spec: LadderSpec) -> None:
    """Stage mixtures against the corpus, where it is prepared already (a default corpus
    prepared by the first rung is checked by the trainer, before it trains)."""
    from moelab.data.loader import META_FILE, read_meta

    for rung in spec.runs():
        path = data_dir(rung.config.data.path)
        if not (path / META_FILE).is_file():
            continue
        try:
            sources = list(read_meta(path)["sources"])
        except UserError:
            continue  # a damaged corpus: the trainer says what is wrong with it
        try:
            check_sources(rung.config.plan, sources)
        except ConfigError as err:
            raise ConfigError(f"{rung.name}: {err}") from None
