"""What repetition a ladder's runs see, and the refusal to extrapolate past it.

Every run's passes over each source's train tokens, per stage as its mixtures draw them
(`moelab.data.passes`), and the corpus they are drawn from (its content sha256). A target
that passes over some source more often than any rung did would be predicted in a regime
the rungs never measured: the published decay (Muennighoff et al., `fit.repetition`)
makes a repeated token worth less, never worth harm, while a small model on few unique
tokens overfits and its validation loss rises. So pre-registration refuses such a target
unless the spec accepts it explicitly (`fit.accept_repetition: true`, recorded). Rungs
that repeat the corpus raise what the rungs measured, and
`fit.repetition: measured` predicts from the law fitted on them (moelab.ladder.overfit);
it is refused before any rung trains when fewer than two pass counts above 1 are measured,
or when the target's parameters per unique token (N/U, the ratio the law's penalty grows
with) lie past the repeating rungs' largest: the penalty's exponent in N/U is then
extrapolated, and the repetition ladder (configs/ladder/dev/repetition.yaml), pre-registered
before this check, missed by -14% with its target at N/U 22 against rungs at most 3.4.

Passes up to one are not repetition: a target under one pass over every source is never
refused, however few passes its rungs made.
"""

from __future__ import annotations

from typing import Any

from moelab.config import data_dir
from moelab.data.loader import read_meta, restrict
from moelab.data.passes import max_passes, plan_passes
from moelab.data.prepare import check_preset_prepared
from moelab.errors import UserError
from moelab.ladder.spec import LadderSpec, Rung

# A target may pass over a source up to this factor more often than the rungs' most before
# it is "past the rungs": the rungs' counts are exact, so this is room for a spec whose
# target is meant to match them, not noise.
MARGIN = 0.1


def run_passes(rung: Rung) -> list[dict[str, Any]]:
    """Per stage of the run's plan: its passes over each source (moelab.data.passes)."""
    cfg = rung.config
    check_preset_prepared(cfg.data.path)
    meta = restrict(read_meta(data_dir(cfg.data.path)), cfg.data.unique_tokens)
    return plan_passes(meta, cfg.plan, cfg.data.max_epochs or None)


def most_passes(rung: Rung) -> float:
    """The run's largest passes over any one source (where moelab.ladder.overfit places it)."""
    return max(max_passes(run_passes(rung)).values(), default=0.0)


def params_per_unique(rung: Rung, passes: float) -> float:
    """N/U: active parameters per unique token, U = D / R with R the run's largest passes
    over any source (as moelab.ladder.overfit places a run)."""
    return rung.active_params * passes / rung.tokens


def corpus(spec: LadderSpec) -> dict[str, Any]:
    """The target's corpus: where, its content sha256, its train tokens per source."""
    path = spec.target.config.data.path
    meta = read_meta(data_dir(path))
    return {"path": path, "content_sha256": meta.get("content_sha256"),
            "train_tokens": dict(meta["train_tokens"])}


def repetition(spec: LadderSpec) -> dict[str, Any]:
    """Every run's passes per stage and source, the rungs' most and the target's per
    source, which sources the target passes over beyond the rungs, and whether the spec
    accepts that. Needs the data prepared (read_meta's UserError says how otherwise)."""
    runs = {r.name: run_passes(r) for r in spec.runs()}
    per_rung = {r.name: max_passes(runs[r.name]) for r in spec.rungs}
    rungs_max: dict[str, float] = {}
    for passes in per_rung.values():
        for source, p in passes.items():
            rungs_max[source] = max(rungs_max.get(source, 0.0), p)
    target = max_passes(runs[spec.target.name])
    target_max = max(target.values(), default=0.0)
    beyond = sorted(s for s, p in target.items()
                    if p > max(1.0, rungs_max.get(s, 0.0) * (1 + MARGIN)))
    most = {name: max(p.values(), default=0.0) for name, p in per_rung.items()}
    repeated = sorted({round(m, 2) for m in most.values()} - {0.0})
    ratio = [params_per_unique(r, most[r.name]) for r in spec.rungs if most[r.name] > 1.0]
    return {"runs": runs, "rungs_max": rungs_max, "target": target,
            "params_per_unique": {"rungs_max": max(ratio, default=None),
                                  "target": params_per_unique(spec.target, max(target_max, 1.0))},
            "target_max": target_max, "margin": MARGIN,
            "beyond_rungs": beyond, "accepted": spec.fit.accept_repetition,
            "measured": spec.fit.repetition == "measured",
            "rung_passes": [p for p in repeated if p > 1.0],
            "prefix_subsets": sorted(r.name for r in spec.runs()
                                     if r.config.data.unique_tokens
                                     and r.config.data.unique_sample == "first"),
            "identified": identification(spec)}


def identification(spec: LadderSpec) -> dict[str, Any]:
    """The rungs' distinct token counts and active parameter counts beside the target's,
    and whether fit.require_identified asks that each law term be pinned by them."""
    return {"required": spec.fit.require_identified,
            "tokens": sorted({r.tokens for r in spec.rungs}),
            "active_params": sorted({r.active_params for r in spec.rungs}),
            "target_tokens": spec.target.tokens,
            "target_active_params": spec.target.active_params}


# The measured law's terms in one variable: E + A (N/N0)^-a + B (D/D0)^-b; each has three
# parameters with E, so it needs three distinct values of its variable among the rungs
IDENTIFYING_TERMS = (("tokens", "token counts", "B (D/D0)^-b", "E, B and b",
                      "target_tokens", "tokens", "train.steps"),
                     ("active_params", "active parameter counts", "A (N/N0)^-a",
                      "E, A and a", "target_active_params", "active parameters", "widths"))


def identification_refusal(rep: dict[str, Any]) -> str | None:
    """The one-line reason a measured spec whose rungs cannot pin a term of the law at
    the target is refused before any rung trains, or None. With two token counts the data
    term's three parameters (E, B, b) meet two values, so one direction of them is exactly
    flat on every rung; a target at another D moves along it, and its value is then set
    by where the fit stops, not by the rungs (repetition_v2-v9 all trained at 2; the
    Jacobian's smallest singular value was 2e-10 of its largest on v5's rungs)."""
    ident = rep.get("identified") or {}
    if not (rep.get("measured") and ident.get("required")):
        return None
    for key, what, term, params, target_key, unit, fix in IDENTIFYING_TERMS:
        values = ident[key]
        if len(values) >= 3 or ident[target_key] in values:
            continue
        shown = " and ".join(f"{v:,}" for v in values)
        return (f"fit.repetition: measured fits {term} to the rungs' {what}, but they have "
                f"{len(values)} ({shown}): {params} then trade off exactly, and the target "
                f"at {ident[target_key]:,} {unit} moves along that trade, which no rung's loss "
                f"shows; add rungs at a third value (other {fix}), or set "
                "fit.require_identified: false to pre-register anyway")
    return None


def prefix_refusal(rep: dict[str, Any]) -> str | None:
    """The one-line reason a measured spec with runs on the *first* data.unique_tokens of
    a source is refused, or None (fit.accept_repetition lifts it, for a corpus whose order
    is already random). A prefix is a few files, narrower than the corpus, so its loss
    mixes that narrowness with repetition and the law charges both to repetition:
    bench/repetition_subset measured it at one pass, where nothing repeats, 5.41 nats on
    the first 400K tokens against 4.76 on the whole corpus, and repetition_v4, whose 25
    rungs the law fitted to 0.25%, missed by 11% so. The check came after that result
    (v2-v4 ran on prefixes; their records stand)."""
    names = rep.get("prefix_subsets") or []
    if not (rep.get("measured") and names) or rep["accepted"]:
        return None
    return (f"fit.repetition: measured on prefix subsets: {len(names)} run(s) read the "
            f"first data.unique_tokens of each source ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}), a few files narrower than the corpus, "
            "whose extra loss the law would count as repetition; set data.unique_sample: "
            "spread, or fit.accept_repetition: true if the corpus order is already random")


def refusal(rep: dict[str, Any]) -> str | None:
    """The one-line reason pre-registration refuses, or None."""
    if reason := prefix_refusal(rep) or identification_refusal(rep):
        return reason
    if rep.get("measured") and len(rep["rung_passes"]) < 2:
        return (f"fit.repetition: measured fits the law that can rise with passes on the "
                f"rungs, but they repeat their data at {len(rep['rung_passes'])} pass "
                f"count(s) above 1 ({rep['rung_passes']}); add rungs trained for 2 to 16 "
                "passes over the corpus, or set fit.repetition: "
                "muennighoff")
    ratio = rep.get("params_per_unique") or {}
    if (rep.get("measured") and not rep["accepted"] and ratio.get("rungs_max")
            and ratio["target"] > ratio["rungs_max"] * (1 + MARGIN)):
        return (f"fit.repetition: measured extrapolates the penalty in parameters per unique "
                f"token: the target's N/U is {ratio['target']:.3g}, the repeating rungs' at "
                f"most {ratio['rungs_max']:.3g}; add repeating rungs at the target's N/U "
                "(wider, or on a smaller unique subset), or set fit.accept_repetition: true "
                "to pre-register anyway")
    if not rep["beyond_rungs"] or rep["accepted"]:
        return None
    cells = ", ".join(f"{s} {rep['target'][s]:.2f} (rungs at most "
                      f"{rep['rungs_max'].get(s, 0.0):.2f})" for s in rep["beyond_rungs"])
    return (f"the target passes over {cells} times, past what the rungs measured, where the "
            "published repetition decay cannot see overfitting; train it on more unique "
            "tokens (a larger corpus, `moelab data prepare --preset ladder`, or another "
            "mixture), or set fit.accept_repetition: true to pre-register anyway")


def check(spec: LadderSpec) -> dict[str, Any]:
    """`repetition(spec)`, raising a UserError with the refusal's reason if it refuses."""
    rep = repetition(spec)
    reason = refusal(rep)
    if reason:
        raise UserError(f"ladder {spec.name}: {reason}")
    return rep
