"""What every view of an experiment shares: the data read from the store once, its tables,
PNG plots and a Markdown summary to paste into a GitHub issue. The HTML pages (report,
dashboard, published site) are built from these pieces in moelab.lab.site.

Every string a user typed (names, hypotheses, outcomes, messages) goes through html.escape
or _md before it reaches a page, so an experiment named "<script>" is shown, not run.
"""

from __future__ import annotations

import io
import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from moelab.lab.records import Event, Experiment, Prediction, Run
from moelab.lab.store import Store
from moelab.train.health import DEAD_METRIC


@dataclass(frozen=True)
class PlotSpec:
    name: str  # file stem: loss -> loss.png
    title: str
    metric: str  # matches the metric itself and "<metric>/<layer or source>"
    y_label: str  # what the y axis measures, with its unit
    marks: tuple[str, ...] = ()  # event kinds drawn as vertical lines on the PNG
    log_y: bool = False


X_LABEL = "step (optimizer updates)"
PLOTS = (
    PlotSpec("loss", "Training loss (predictions as bands)", "loss", "loss (nats/token)",
             marks=("restart", "resume", "config_change", "stage", "branch", "plan_change")),
    PlotSpec("val_loss", "Validation loss per source (overfitting marked)", "val_loss",
             "validation loss (nats/token)", marks=("overfit",)),
    PlotSpec("val_bpb", "Validation bits per byte per domain (tokenizer-independent)",
             "val_bpb", "bits per byte"),
    PlotSpec("task_acc", "Held-out task accuracy (`moelab eval`, ranked classification)",
             "task_acc", "accuracy (fraction correct)"),
    PlotSpec("grad_norm", "Gradient norm (flagged steps marked)", "grad_norm",
             "global gradient L2 norm", marks=("spike", "divergence", "nan"), log_y=True),
    PlotSpec("drop_frac", "Dropped-token fraction per layer", "drop_frac",
             "dropped tokens (fraction of routed)"),
    PlotSpec("expert_load", "Expert load, max / mean, per layer", "expert_load_max_over_mean",
             "busiest expert's tokens / mean (ratio)"),
    # balance health (train/health.py): deaths and revivals marked
    PlotSpec("dead_experts", "Dead experts per layer (no token for train.dead_expert_window "
             "steps)", DEAD_METRIC, "dead experts (count)",
             marks=("expert_dead", "expert_revived")),
    PlotSpec("router_entropy", "Router entropy per layer", "router_entropy",
             "mean routing entropy (nats)"),
)
# Units of the other metrics the trainer logs, for charts of any metric.
UNITS = {"lr": "learning rate", "tokens_per_s": "throughput (tokens/s)",
         "mfu": "model FLOPs utilization (fraction of peak)",
         "val_bpb_macro": "bits per byte, mean over domains",
         "train_val_gap": "validation minus training loss (nats/token)"}


def y_label(metric: str) -> str:
    """The y-axis label (with unit) for a metric name such as "val_loss/code" or "lr"."""
    spec = next((spec for spec in PLOTS if matches(metric, spec.metric)), None)
    return spec.y_label if spec else UNITS.get(metric, metric)


@dataclass(frozen=True)
class ExperimentView:
    """Everything a report shows, read from the store once."""

    experiment: Experiment
    runs: list[Run]
    events: list[Event]
    predictions: list[Prediction]
    latest: dict[str, dict[str, tuple[int, float]]]  # run id -> metric -> last (step, value)

    def metric_names(self) -> set[str]:
        return {name for metrics in self.latest.values() for name in metrics}

    def plots(self) -> list[PlotSpec]:
        """The plots with something to draw; missing metrics (a dense model) just drop out."""
        names = self.metric_names()
        return [spec for spec in PLOTS if any(matches(name, spec.metric) for name in names)]

    def plot(self, name: str) -> PlotSpec | None:
        return next((spec for spec in self.plots() if spec.name == name), None)

    def observed(self, prediction: Prediction) -> float | None:
        return self.scored(prediction)[0]

    def scored(self, prediction: Prediction) -> tuple[float | None, str]:
        """(the value the prediction is scored against, which run or rule gave it): the
        named run's last value of the metric, else the prediction's rule over the runs
        that logged it (Prediction.scored_by)."""
        metric, (kind, which) = prediction.metric, prediction.scored_by
        logged = [run for run in self.runs if metric in self.latest[run.id]]
        last = {run.id: self.latest[run.id][metric][1] for run in logged}
        if kind == "run":
            named = [run for run in self.runs if which == run.id
                     or os.path.normpath(which) == os.path.normpath(run.run_dir)]
            if not named:
                return None, f"run {which} (not started)"
            return last.get(named[-1].id), f"run {named[-1].id} (named)"
        if not logged:
            return None, f"{which} of the runs (none has logged {metric} yet)"
        if which == "best":
            best = min(logged, key=lambda run: last[run.id])
            return last[best.id], f"best of {len(logged)} runs ({best.id})"
        if which == "mean":
            return (sum(last.values()) / len(last),
                    f"mean of {len(logged)} runs ({', '.join(last)})")
        return last[logged[-1].id], (f"last run that logged it ({logged[-1].id}; no run or "
                                     "rule named at registration)")


def load_view(store: Store, exp_id: str) -> ExperimentView:
    runs = store.runs(exp_id)
    return ExperimentView(
        experiment=store.get_experiment(exp_id),
        runs=runs,
        events=[event for run in runs for event in store.events(run.id)],
        predictions=store.predictions(exp_id),
        latest={run.id: store.latest(run.id) for run in runs},
    )


# ------------------------------------------------------------------------------ plots


def render_plot(store: Store, view: ExperimentView, spec: PlotSpec) -> bytes:
    """One plot as PNG bytes. Uses Figure directly (not pyplot): thread-safe for the
    dashboard, and no GUI backend is ever touched."""
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    _draw_curves(ax, store, view, spec)
    _draw_predictions(ax, view, spec)
    _draw_events(ax, view, spec)
    if spec.log_y:
        ax.set_yscale("log")
    ax.set(title=spec.title, xlabel=X_LABEL, ylabel=spec.y_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=1 + len(ax.get_legend_handles_labels()[0]) // 8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _draw_curves(ax: Axes, store: Store, view: ExperimentView, spec: PlotSpec) -> None:
    for run in view.runs:
        for name in sorted(n for n in view.latest[run.id] if matches(n, spec.metric)):
            steps, values = zip(*store.metrics(run.id, name), strict=True)
            label = name if len(view.runs) == 1 else f"{run.id} {name}"
            ax.plot(steps, values, linewidth=1.2, label=_tex_safe(label))


def _draw_predictions(ax: Axes, view: ExperimentView, spec: PlotSpec) -> None:
    """Each pre-registered prediction as its value (dashed) inside its [low, high] band."""
    for p in view.predictions:
        if matches(p.metric, spec.metric):
            ax.axhline(p.value, color="black", linestyle="--", linewidth=1)
            label = f"predicted {p.name}: {p.value:.4g} [{p.low:.4g}, {p.high:.4g}]"
            ax.axhspan(p.low, p.high, color="gray", alpha=0.2, label=_tex_safe(label))


def _draw_events(ax: Axes, view: ExperimentView, spec: PlotSpec) -> None:
    labelled: set[str] = set()  # one legend entry per kind, however many events
    for event in (e for e in view.events if e.kind in spec.marks):
        label = None if event.kind in labelled else _tex_safe(event.kind)
        ax.axvline(event.step, color="tab:red", linestyle=":", linewidth=1, label=label)
        labelled.add(event.kind)


def matches(name: str, metric: str) -> bool:
    return name == metric or name.startswith(metric + "/")


def _tex_safe(label: str) -> str:
    """Matplotlib parses $...$ as math; a stray $ in a user's name must not break the plot."""
    return label.replace("$", r"\$")


# Compute multipliers recorded by `moelab ladder compare --experiment`: metrics named
# "multiplier/<theoretical|realized>/<variant> vs <base>", their interval's ends under
# "multiplier_low/..." and "multiplier_high/..." (not ".../low": that would read as a
# sub-series of the multiplier).
MULTIPLIER = "multiplier"


def multiplier_rows(view: ExperimentView) -> list[list[str]]:
    """[run, comparison, kind, value, interval, distinguishable from 1] per recorded one."""
    rows = []
    for run in view.runs:
        latest = view.latest[run.id]
        for name in sorted(n for n in latest if n.startswith(MULTIPLIER + "/")):
            _, kind, pair = name.split("/", 2)
            low = latest.get(f"{MULTIPLIER}_low/{kind}/{pair}", (0, math.nan))[1]
            high = latest.get(f"{MULTIPLIER}_high/{kind}/{pair}", (0, math.nan))[1]
            rows.append([run.id, pair, kind, f"{latest[name][1]:.3g}x",
                         f"[{low:.3g}, {high:.3g}]", "no" if low <= 1 <= high else "yes"])
    return rows


# ------------------------------------------------------------------------------ tables

Table = tuple[str, list[str], list[list[str]]]  # title, header, rows of plain text


def tables(view: ExperimentView) -> list[Table]:
    """Runs, predictions and events as plain text; the HTML and Markdown renderers share them,
    so both say the same thing."""
    runs = [_run_row(run, view.latest[run.id]) for run in view.runs]
    predictions = [prediction_row(p, *view.scored(p)) for p in view.predictions]
    events = [[e.run_id, str(e.step), e.kind, e.message] for e in view.events]
    return [
        ("Runs", ["run", "status", "last step", "last loss", "directory", "message"], runs),
        ("Predictions", ["name", "metric", "value", "range", "observed", "within range",
                         "registered", "scored against"], predictions),
        ("Events (restarts, spikes, overfitting, config changes)",
         ["run", "step", "kind", "message"], events),
    ]


def last_step(latest: dict[str, tuple[int, float]]) -> int | None:
    """The last step a run logged anything at, from Store.latest()."""
    return max((step for step, _ in latest.values()), default=None)


def _run_row(run: Run, latest: dict[str, tuple[int, float]]) -> list[str]:
    step = last_step(latest)
    last_loss = latest["loss"][1] if "loss" in latest else None
    return [run.id, run.status, "" if step is None else str(step), fmt_num(last_loss),
            run.run_dir, run.message]


def prediction_row(p: Prediction, observed: float | None, basis: str) -> list[str]:
    return [p.name, p.metric, fmt_num(p.value), f"[{fmt_num(p.low)}, {fmt_num(p.high)}]",
            fmt_num(observed), within(p, observed), fmt_time(p.created_at), basis]


def fmt_num(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def within(prediction: Prediction, observed: float | None) -> str:
    if observed is None or math.isnan(observed):
        return "not yet"
    return "yes" if prediction.low <= observed <= prediction.high else "no"


def fmt_time(timestamp: float | None) -> str:
    return "" if timestamp is None else time.strftime("%Y-%m-%d %H:%M UTC",
                                                      time.gmtime(timestamp))


def measured(view: ExperimentView) -> str:
    """The outcome as measured: each prediction against the value it is scored on. Kept
    apart from the conclusion (the words of whoever ended the experiment), so a reader
    sees what happened before what was made of it."""
    parts = []
    for p in view.predictions:
        observed, basis = view.scored(p)
        verdict = {"yes": "inside", "no": "outside", "not yet": "not known yet"}[
            within(p, observed)]
        parts.append(f"{p.name}: predicted {fmt_num(p.value)} [{fmt_num(p.low)}, "
                     f"{fmt_num(p.high)}], observed {fmt_num(observed) or '-'} ({basis}): "
                     f"{verdict}")
    return "; ".join(parts) or "(no predictions registered)"


def facts(view: ExperimentView) -> list[tuple[str, str]]:
    experiment = view.experiment
    return [
        ("Status", experiment.status),
        ("Hypothesis", experiment.hypothesis),
        ("Outcome (measured)", measured(view)),
        ("Conclusion", experiment.outcome or "(not ended yet)"),
        ("Code", experiment.git_commit or "(no git commit recorded)"),
        ("Planned", fmt_time(experiment.created_at)),
        ("Ended", fmt_time(experiment.finished_at) or "(not yet)"),
    ]


# ---------------------------------------------------------------------------- Markdown


def render_markdown(view: ExperimentView) -> str:
    """A summary for a GitHub issue (also what `moelab lab show` prints)."""
    e = view.experiment
    lines = [f"## {_md(e.name)} ({e.id}): {e.status}", ""]
    lines += [f"- **{key}:** {_md(value)}" for key, value in facts(view)[1:]]
    for title, header, rows in tables(view):
        lines += ["", f"### {title}", ""]
        if not rows:
            lines.append("None.")
            continue
        lines += [_md_row(header), _md_row(["---"] * len(header))]
        lines += [_md_row(row) for row in rows]
    plots = ", ".join(f"{spec.name}.png" for spec in view.plots())
    lines += ["", f"Plots (in the report directory): {plots or 'none yet'}", ""]
    return "\n".join(lines)


def _md_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(_md(cell) for cell in cells) + " |"


def _md(text: str) -> str:
    """Text that Markdown shows as typed: no raw HTML, math or table breaks (each of <, $
    and | gets a backslash), on one line."""
    return re.sub(r"([<$|])", r"\\\1", " ".join(text.split()))
