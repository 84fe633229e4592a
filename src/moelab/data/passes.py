"""Passes over each source's train tokens, counted where they happen: per stage of a plan,
as that stage's mixture draws them.

A corpus's total passes hide what repetition a run sees: a stage that up-weights a small
source repeats it far more than the total says (prose 385k of 1.79M tokens, drawn at 62.5%
for 700 steps, is passed over 3.5 times in that stage alone). So the count is per source
and per stage, with the run's cumulative passes at each stage's end, computed the way the
loaders draw: a staged run's rows are apportioned exactly (`StagedLoader`), a one-stage
run draws by weight, under data.max_epochs's cap when set (`Loader`), so its count is the
expectation.

The plan is passed in (its `.stages` and `.staged`), not built here: the plan lives in a
lower layer's config, and this module stays free of it.
"""

from __future__ import annotations

from typing import Any

from moelab.data.loader import apportion, resolve_mixture


def plan_passes(meta: dict, plan: Any, max_epochs: float | None = None) -> list[dict[str, Any]]:
    """Per stage of `plan`: {index, name, start, end, tokens: {component: train tokens the
    stage draws}, passes: {component: passes in the stage}, cumulative: {component: passes
    from step 0 to the stage's end}}. Components are the mixture's sources (or cells)."""
    out, seen = [], {}
    for stage in plan.stages:
        per_row = stage.seq_len  # a row trains seq_len tokens (its window is seq_len + 1)
        if plan.staged:
            mix = resolve_mixture(meta, "train", stage.mixture)
            drawn = (apportion(mix.weights, stage.rows) * per_row).tolist()
        else:
            run_tokens = stage.rows * per_row
            mix = resolve_mixture(meta, "train", stage.mixture, max_epochs, run_tokens)
            drawn = (mix.weights * run_tokens).tolist()
        tokens = dict(zip(mix.names, drawn, strict=True))
        size = dict(zip(mix.names, mix.tokens, strict=True))
        for name, t in tokens.items():
            seen[name] = seen.get(name, 0.0) + t
        out.append({"index": stage.index, "name": stage.name, "start": stage.start,
                    "end": stage.end, "tokens": tokens,
                    "passes": {n: t / max(size[n], 1) for n, t in tokens.items()},
                    "cumulative": {n: seen.get(n, 0.0) / max(size[n], 1) for n in size}})
    return out


def max_passes(stages: list[dict[str, Any]]) -> dict[str, float]:
    """{component: passes by the run's end} (the last stage's cumulative count)."""
    return dict(stages[-1]["cumulative"]) if stages else {}


def passes_lines(stages: list[dict[str, Any]]) -> list[str]:
    """One line per stage: each component's passes in the stage and by its end."""
    lines = []
    for st in stages:
        label = f"stage {st['index']}" + (f" ({st['name']})" if st["name"] else "")
        cells = ", ".join(f"{n} {p:.3g} (by its end {st['cumulative'][n]:.3g})"
                          for n, p in st["passes"].items())
        lines.append(f"{label}, steps {st['start']}..{st['end']}: passes {cells}")
    return lines
