"""Readable accounts of an experiment: a static HTML report with PNG plots, and a Markdown
summary to paste into a GitHub issue. The dashboard renders the same pieces live.

Every string a user typed (names, hypotheses, outcomes, messages) goes through html.escape
or _md before it reaches a page, so an experiment named "<script>" is shown, not run.
"""

from __future__ import annotations

import html
import io
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from moelab.lab.records import Event, Experiment, Prediction, Run
from moelab.lab.store import Store


@dataclass(frozen=True)
class PlotSpec:
    name: str  # file stem: loss -> loss.png
    title: str
    metric: str  # matches the metric itself and "<metric>/<layer or source>"
    marks: tuple[str, ...] = ()  # event kinds drawn as vertical lines
    log_y: bool = False


PLOTS = (
    PlotSpec("loss", "Training loss (predictions as bands)", "loss", marks=("restart", "resume")),
    PlotSpec("val_loss", "Validation loss per source", "val_loss"),
    PlotSpec("grad_norm", "Gradient norm (flagged steps marked)", "grad_norm",
             marks=("spike", "divergence", "nan"), log_y=True),
    PlotSpec("drop_frac", "Dropped-token fraction per layer", "drop_frac"),
    PlotSpec("expert_load", "Expert load, max / mean, per layer", "expert_load_max_over_mean"),
)


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
        return [spec for spec in PLOTS if any(_matches(name, spec.metric) for name in names)]

    def plot(self, name: str) -> PlotSpec | None:
        return next((spec for spec in self.plots() if spec.name == name), None)

    def observed(self, prediction: Prediction) -> float | None:
        """The predicted metric's last value in the latest run that logged it."""
        for run in reversed(self.runs):
            if prediction.metric in self.latest[run.id]:
                return self.latest[run.id][prediction.metric][1]
        return None


def load_view(store: Store, exp_id: str) -> ExperimentView:
    runs = store.runs(exp_id)
    return ExperimentView(
        experiment=store.get_experiment(exp_id),
        runs=runs,
        events=[event for run in runs for event in store.events(run.id)],
        predictions=store.predictions(exp_id),
        latest={run.id: store.latest(run.id) for run in runs},
    )


def write_report(store: Store, exp_id: str, out_dir: str | Path) -> list[Path]:
    """Write report.html, summary.md and one PNG per plot into out_dir; return the paths."""
    view = load_view(store, exp_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in view.plots():
        written.append(out / f"{spec.name}.png")
        written[-1].write_bytes(render_plot(store, view, spec))
    title = f"{view.experiment.name} ({exp_id})"
    page = html_page(title, render_html(view, lambda spec: f"{spec.name}.png"))
    (out / "report.html").write_text(page, encoding="utf-8")
    (out / "summary.md").write_text(render_markdown(view), encoding="utf-8")
    return [out / "report.html", out / "summary.md", *written]


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
    ax.set(title=spec.title, xlabel="step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=1 + len(ax.get_legend_handles_labels()[0]) // 8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _draw_curves(ax: Axes, store: Store, view: ExperimentView, spec: PlotSpec) -> None:
    for run in view.runs:
        for name in sorted(n for n in view.latest[run.id] if _matches(n, spec.metric)):
            steps, values = zip(*store.metrics(run.id, name), strict=True)
            label = name if len(view.runs) == 1 else f"{run.id} {name}"
            ax.plot(steps, values, linewidth=1.2, label=_tex_safe(label))


def _draw_predictions(ax: Axes, view: ExperimentView, spec: PlotSpec) -> None:
    """Each pre-registered prediction as its value (dashed) inside its [low, high] band."""
    for p in view.predictions:
        if _matches(p.metric, spec.metric):
            ax.axhline(p.value, color="black", linestyle="--", linewidth=1)
            label = f"predicted {p.name}: {p.value:.4g} [{p.low:.4g}, {p.high:.4g}]"
            ax.axhspan(p.low, p.high, color="gray", alpha=0.2, label=_tex_safe(label))


def _draw_events(ax: Axes, view: ExperimentView, spec: PlotSpec) -> None:
    labelled: set[str] = set()  # one legend entry per kind, however many events
    for event in (e for e in view.events if e.kind in spec.marks):
        label = None if event.kind in labelled else _tex_safe(event.kind)
        ax.axvline(event.step, color="tab:red", linestyle=":", linewidth=1, label=label)
        labelled.add(event.kind)


def _matches(name: str, metric: str) -> bool:
    return name == metric or name.startswith(metric + "/")


def _tex_safe(label: str) -> str:
    """Matplotlib parses $...$ as math; a stray $ in a user's name must not break the plot."""
    return label.replace("$", r"\$")


# ------------------------------------------------------------------------------ tables

Table = tuple[str, list[str], list[list[str]]]  # title, header, rows of plain text


def _tables(view: ExperimentView) -> list[Table]:
    """Runs, predictions and events as plain text; the HTML and Markdown renderers share them,
    so both say the same thing."""
    runs = [_run_row(run, view.latest[run.id]) for run in view.runs]
    predictions = [_prediction_row(p, view.observed(p)) for p in view.predictions]
    events = [[e.run_id, str(e.step), e.kind, e.message] for e in view.events]
    return [
        ("Runs", ["run", "status", "last step", "last loss", "directory", "message"], runs),
        ("Predictions", ["name", "metric", "value", "range", "observed", "within range",
                         "registered"], predictions),
        ("Events (restarts, spikes, config changes)", ["run", "step", "kind", "message"], events),
    ]


def last_step(latest: dict[str, tuple[int, float]]) -> int | None:
    """The last step a run logged anything at, from Store.latest()."""
    return max((step for step, _ in latest.values()), default=None)


def _run_row(run: Run, latest: dict[str, tuple[int, float]]) -> list[str]:
    step = last_step(latest)
    last_loss = latest["loss"][1] if "loss" in latest else None
    return [run.id, run.status, "" if step is None else str(step), _num(last_loss),
            run.run_dir, run.message]


def _prediction_row(p: Prediction, observed: float | None) -> list[str]:
    return [p.name, p.metric, _num(p.value), f"[{_num(p.low)}, {_num(p.high)}]",
            _num(observed), _within(p, observed), _when(p.created_at)]


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _within(prediction: Prediction, observed: float | None) -> str:
    if observed is None or math.isnan(observed):
        return "not yet"
    return "yes" if prediction.low <= observed <= prediction.high else "no"


def _when(timestamp: float | None) -> str:
    return "" if timestamp is None else time.strftime("%Y-%m-%d %H:%M UTC",
                                                      time.gmtime(timestamp))


def _facts(experiment: Experiment) -> list[tuple[str, str]]:
    return [
        ("Status", experiment.status),
        ("Hypothesis", experiment.hypothesis),
        ("Outcome", experiment.outcome or "(not ended yet)"),
        ("Code", experiment.git_commit or "(no git commit recorded)"),
        ("Planned", _when(experiment.created_at)),
        ("Ended", _when(experiment.finished_at) or "(not yet)"),
    ]


# -------------------------------------------------------------------------------- HTML

STYLE = """
body{font:15px/1.45 system-ui,sans-serif;max-width:72rem;margin:1.5rem auto;padding:0 1rem}
table{border-collapse:collapse;margin:.5rem 0 1rem}td,th{border:1px solid #ccc;padding:.2rem .5rem;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%}dt{font-weight:600}
.failed,.abandoned{color:#a00}.succeeded{color:#060}.running{color:#05a}figure{margin:0 0 1rem}"""


def html_page(title: str, body: str, head: str = "") -> str:
    """A whole HTML document; `head` is trusted markup from moelab itself (scripts, links)."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style>{head}</head>\n"
            f"<body>\n{body}\n</body></html>\n")


def html_table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A table of plain-text cells (escaped here); a caller needing markup uses html_cells."""
    return html_cells(header, ([html.escape(cell) for cell in row] for row in rows))


def html_cells(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(view: ExperimentView, image_url: Callable[[PlotSpec], str]) -> str:
    """The body of a report; image_url says where each plot's PNG lives (a file or a URL)."""
    e = view.experiment
    facts = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in _facts(e))
    figures = "".join(
        f'<figure><img src="{html.escape(image_url(spec))}" alt="{html.escape(spec.title)}">'
        f"</figure>" for spec in view.plots()
    ) or "<p>No metrics logged yet.</p>"
    tables = "".join(_html_section(*table) for table in _tables(view))
    config = html.escape(yaml.safe_dump(e.config, sort_keys=False))
    return (f'<h1>{html.escape(e.name)} <small>{html.escape(e.id)}</small></h1>'
            f'<dl class="{html.escape(e.status)}">{facts}</dl><h2>Plots</h2>{figures}{tables}'
            f"<h2>Config snapshot</h2><pre>{config}</pre>")


def _html_section(title: str, header: list[str], rows: list[list[str]]) -> str:
    return f"<h2>{html.escape(title)}</h2>" + (html_table(header, rows) if rows else "<p>None.</p>")


# ---------------------------------------------------------------------------- Markdown


def render_markdown(view: ExperimentView) -> str:
    """A summary for a GitHub issue (also what `moelab lab show` prints)."""
    e = view.experiment
    lines = [f"## {_md(e.name)} ({e.id}): {e.status}", ""]
    lines += [f"- **{key}:** {_md(value)}" for key, value in _facts(e)[1:]]
    for title, header, rows in _tables(view):
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
