"""The lab as HTML pages: an index, one page per experiment, compare pages and the findings.

The dashboard serves these pages live and `moelab lab publish` writes them as a static site.
Both use one layout of relative links (index.html, findings.html, experiments/ID.html,
compare/ID.html, static/...), so a published copy works opened from disk or from any static
host, and `moelab lab report` writes a single experiment page the same way.

Escaping holds three ways. Every user string goes through html.escape. Chart data travels
in a <script type="application/json"> block whose <, > and & are written as JSON \\u
escapes, so no string (a run named "</script>") can end the block; charts.js reads it with
JSON.parse and hands plotly only escaped text. And every page carries a Content-Security-
Policy that runs scripts from the site's own files only, never inline, so even markup that
slipped past escaping could not run.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import yaml

from moelab.errors import UserError
from moelab.lab.records import ENDED, Prediction, Run
from moelab.lab.report import (
    PLOTS,
    X_LABEL,
    ExperimentView,
    facts,
    fmt_num,
    last_step,
    load_view,
    matches,
    multiplier_rows,
    prediction_row,
    render_markdown,
    render_plot,
    tables,
    y_label,
)
from moelab.lab.store import Store

CSP = "default-src 'self'; style-src 'unsafe-inline'; img-src 'self' data:"
STATIC_FILES = ("plotly.min.js", "PLOTLY-LICENSE.txt", "charts.js")
DATA_ID = "lab-data"  # the id of the JSON block charts.js reads

STYLE = """
body{font:15px/1.45 system-ui,sans-serif;max-width:76rem;margin:1.5rem auto;padding:0 1rem}
table{border-collapse:collapse;margin:.5rem 0 1rem}td,th{border:1px solid #ccc;padding:.2rem .5rem;
text-align:left;vertical-align:top}th{background:#f3f3f3}dt{font-weight:600}nav{margin-bottom:1rem}
.failed,.abandoned{color:#a00}.succeeded{color:#060}.running{color:#05a}
.controls{position:sticky;top:0;background:#fff;padding:.4rem 0;border-bottom:1px solid #ddd;
z-index:10}.controls label{margin-right:1rem}.chart{height:360px}.chart-box{margin:0 0 1.2rem}"""


# -------------------------------------------------------------------------- documents


def html_page(title: str, body: str, root: str = "", charts: bool = False,
              head: str = "") -> str:
    """A whole HTML document. root is the relative path back to the site's top ("" or
    "../"); charts loads plotly and charts.js; head is trusted markup from moelab itself."""
    scripts = "".join(f'<script src="{root}static/{name}" defer></script>'
                      for name in ("plotly.min.js", "charts.js")) if charts else ""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<link rel="icon" href="data:,">'  # no favicon request (a 404 in the log)
            f"<title>{html.escape(title)}</title><style>{STYLE}</style>{scripts}{head}</head>\n"
            f"<body>\n{body}\n</body></html>\n")


def html_table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A table of plain-text cells (escaped here); a caller needing markup uses html_cells."""
    return html_cells(header, ([html.escape(cell) for cell in row] for row in rows))


def html_cells(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_section(title: str, header: list[str], rows: list[list[str]]) -> str:
    return f"<h2>{html.escape(title)}</h2>" + (html_table(header, rows) if rows else "<p>None.</p>")


def json_script(payload: Any) -> str:
    """payload as a JSON data block that no string inside it can break out of: <, > and &
    become \\u escapes (JSON.parse turns them back), NaN is refused (use None)."""
    text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    return f'<script type="application/json" id="{DATA_ID}">{text}</script>'


def _nav(root: str) -> str:
    return (f'<nav><a href="{root}index.html">all experiments</a> · '
            f'<a href="{root}findings.html">findings and calibration</a></nav>')


def _link(root: str, folder: str, exp_id: str, text: str) -> str:
    return f'<a href="{root}{folder}/{html.escape(exp_id)}.html">{html.escape(text)}</a>'


# ----------------------------------------------------------------------------- charts


def chart_payload(store: Store, runs: list[Run], predictions: list[Prediction],
                  events: list[Any]) -> dict[str, Any]:
    """What charts.js draws: every metric of every run, the standard charts that have data,
    prediction bands and events. NaN/inf values become null (a gap in the curve)."""
    several = len({run.experiment_id for run in runs}) > 1
    series: dict[str, dict[str, list[list[Any]]]] = {}
    for run in runs:
        for name, points in store.all_metrics(run.id).items():
            steps, values = zip(*points, strict=True)
            series.setdefault(name, {})[run.id] = [
                list(steps), [v if math.isfinite(v) else None for v in values]]
    charts = []
    for spec in PLOTS:
        names = sorted(name for name in series if matches(name, spec.metric))
        if names:
            bands = [{"label": f"predicted {p.name}", "value": p.value, "low": p.low,
                      "high": p.high} for p in predictions if matches(p.metric, spec.metric)]
            charts.append({"id": spec.name, "title": spec.title, "y_label": spec.y_label,
                           "metrics": names, "bands": bands})
    labels = {run.id: f"{run.id} ({run.experiment_id})" if several else run.id for run in runs}
    return {
        "x_label": X_LABEL,
        "runs": [{"id": run.id, "label": labels[run.id]} for run in runs],
        "series": series,
        "units": {name: y_label(name) for name in series},
        "charts": charts,
        "events": [{"run": e.run_id, "label": labels.get(e.run_id, e.run_id), "step": e.step,
                    "kind": e.kind, "message": e.message} for e in events],
    }


def charts_html(payload: dict[str, Any], png_url: str | None = None) -> str:
    """Controls (smoothing, runs, log y per chart) and one box per chart, plus a chart of any
    metric; charts.js fills the boxes. png_url, if given, links each chart's static PNG."""
    if not payload["series"]:
        return "<p>No metrics logged yet.</p>"
    toggles = "".join(
        f'<label><input type="checkbox" class="run-toggle" data-run="{html.escape(r["id"])}" '
        f'checked> {html.escape(r["label"])}</label>' for r in payload["runs"])
    controls = (
        '<div class="controls"><label>smoothing (EMA) <input type="range" id="smoothing" '
        'min="0" max="0.99" step="0.01" value="0"> <output id="smoothing-value">0</output>'
        f"</label> runs: {toggles}</div>")
    log_default = {spec.name: spec.log_y for spec in PLOTS}
    boxes = []
    for chart in payload["charts"]:
        checked = " checked" if log_default[chart["id"]] else ""
        png = (f' · <a href="{html.escape(png_url.format(chart["id"]))}">PNG</a>'
               if png_url else "")
        boxes.append(f'<div class="chart-box"><label><input type="checkbox" class="log-y"'
                     f'{checked}> log y</label>{png}'
                     f'<div class="chart" data-chart="{chart["id"]}"></div></div>')
    charted = {name for chart in payload["charts"] for name in chart["metrics"]}
    names = sorted(payload["series"], key=lambda name: (name in charted, name))
    options = "".join(f'<option value="{html.escape(name)}">{html.escape(name)}</option>'
                      for name in names)  # first: a metric no other chart shows
    boxes.append('<div class="chart-box"><label>any metric <select class="metric-select">'
                 f'{options}</select></label> <label><input type="checkbox" class="log-y">'
                 ' log y</label><div class="chart" data-chart="any"></div></div>')
    return controls + "".join(boxes) + json_script(payload)


# ------------------------------------------------------------------------------ pages


def render_index(store: Store, compare_form: bool = False, head: str = "") -> str:
    """All experiments; compare_form adds a form choosing any runs (it needs the dashboard,
    which builds compare pages on request)."""
    rows = []
    for e in store.list_experiments():
        runs = store.runs(e.id)
        compare = _link("", "compare", e.id, "compare runs") if runs else ""
        rows.append([_link("", "experiments", e.id, e.id),
                     *map(html.escape, (e.name, e.status, e.hypothesis, e.outcome)),
                     str(len(runs)), compare])
    header = ["id", "question", "status", "hypothesis", "outcome", "runs", ""]
    body = html_cells(header, rows) if rows else "<p>No experiments yet.</p>"
    if compare_form and rows:
        choices = "".join(
            f'<label><input type="checkbox" name="run" value="{html.escape(run.id)}"> '
            f"{html.escape(run.id)} ({html.escape(e.id)} {html.escape(e.name)})</label><br>"
            for e in store.list_experiments() for run in store.runs(e.id))
        body += ('<h2>Compare any runs</h2><form action="compare.html" method="get">'
                 f'{choices}<button type="submit">compare</button></form>')
    return html_page("moelab lab", f"{_nav('')}<h1>moelab lab</h1>{body}", head=head)


def render_experiment(store: Store, exp_id: str, root: str = "../", standalone: bool = False,
                      head: str = "", png_url: str | None = None) -> str:
    """One experiment: facts, interactive charts, tables and config. standalone drops the
    links to the rest of the site (a report written on its own)."""
    view = load_view(store, exp_id)
    e = view.experiment
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in facts(view))
    payload = chart_payload(store, view.runs, view.predictions, view.events)
    links = "" if standalone else _nav(root) + (
        f"<p>{_link(root, 'compare', exp_id, 'compare these runs')}</p>" if view.runs else "")
    config = html.escape(yaml.safe_dump(e.config, sort_keys=False))
    body = (f'{links}<h1>{html.escape(e.name)} <small>{html.escape(e.id)}</small></h1>'
            f'<dl class="{html.escape(e.status)}">{dl}</dl><h2>Charts</h2>'
            f"{charts_html(payload, png_url)}"
            + "".join(html_section(*table) for table in tables(view))
            + f"<h2>Config snapshot</h2><pre>{config}</pre>")
    return html_page(f"{e.name} ({exp_id})", body, root, charts=True, head=head)


def render_compare(store: Store, run_ids: list[str], root: str = "../", head: str = "") -> str:
    """Any runs, from one experiment or several: overlaid curves with events marked, the
    config fields that differ, and validation loss per source side by side."""
    if not run_ids:
        raise UserError("choose at least one run to compare")
    runs = [store.get_run(run_id) for run_id in dict.fromkeys(run_ids)]
    experiments = {run.experiment_id: store.get_experiment(run.experiment_id) for run in runs}
    events = [event for run in runs for event in store.events(run.id)]
    predictions = [p for exp_id in experiments for p in store.predictions(exp_id)]
    latest = {run.id: store.latest(run.id) for run in runs}
    run_rows = [[html.escape(run.id),
                 _link(root, "experiments", run.experiment_id,
                       f"{run.experiment_id} {experiments[run.experiment_id].name}"),
                 html.escape(run.status), _step(last_step(latest[run.id])),
                 fmt_num(latest[run.id].get("loss", (0, None))[1]), html.escape(run.message)]
                for run in runs]
    header = [run.id for run in runs]
    diff = config_diff({run.id: run.config for run in runs})
    sources = sorted({n for values in latest.values() for n in values
                      if matches(n, "val_loss") or matches(n, "val_bpb") or n == "val_bpb_macro"})
    val_rows = [[name, *(fmt_num(latest[r.id][name][1]) if name in latest[r.id] else ""
                         for r in runs)] for name in sources]
    event_rows = [[e.run_id, str(e.step), e.kind, e.message] for e in events]
    title = "compare " + ", ".join(header)
    body = (f"{_nav(root)}<h1>{html.escape(title)}</h1>"
            + html_cells(["run", "experiment", "status", "last step", "last loss", "message"],
                         run_rows)
            + "<h2>Charts</h2>" + charts_html(chart_payload(store, runs, predictions, events))
            + (html_section("Config fields that differ", ["field", *header], diff)
               if len(runs) > 1 else "")
            + html_section("Validation loss and bits per byte per source (last value)",
                           ["metric", *header], val_rows)
            + html_section("Events (restarts, spikes, overfitting, config changes)",
                           ["run", "step", "kind", "message"], event_rows))
    return html_page(title, body, root, charts=True, head=head)


def _step(step: int | None) -> str:
    return "" if step is None else str(step)


def config_diff(configs: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Rows [dotted field, value per run] for the fields whose values are not all equal;
    a field one run lacks shows as "(unset)"."""
    flat = [_flatten(config) for config in configs.values()]
    rows = []
    for key in sorted(set().union(*flat)):
        shown = [_show(values[key]) if key in values else "(unset)" for values in flat]
        if len(set(shown)) > 1:
            rows.append([key, *shown])
    return rows


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


# --------------------------------------------------------------------------- findings


@dataclass(frozen=True)
class Calibration:
    """How well the lab's pre-registered predictions did, over those with an actual value."""

    total: int  # predictions registered
    resolved: int  # of which an actual value exists
    inside: int  # of which the actual fell inside [low, high]
    mean_abs_error: float | None  # mean |actual - predicted| over the resolved ones

    @property
    def fraction_inside(self) -> float | None:
        return self.inside / self.resolved if self.resolved else None


def calibration(pairs: list[tuple[Prediction, float | None]]) -> Calibration:
    """pairs: each prediction with its actual value (None or NaN: not known yet)."""
    resolved = [(p, actual) for p, actual in pairs
                if actual is not None and math.isfinite(actual)]
    errors = [abs(actual - p.value) for p, actual in resolved]
    return Calibration(
        total=len(pairs),
        resolved=len(resolved),
        inside=sum(p.low <= actual <= p.high for p, actual in resolved),
        mean_abs_error=sum(errors) / len(errors) if errors else None,
    )


def render_findings(store: Store, head: str = "") -> str:
    """Every experiment as question -> hypothesis -> outcome (failures and abandoned ones
    with their reason), every prediction against what happened, and the calibration."""
    views = [load_view(store, e.id) for e in store.list_experiments()]
    sections = []
    for title, statuses in (("Succeeded", ("succeeded",)), ("Failed", ("failed",)),
                            ("Abandoned", ("abandoned",)),
                            ("Not ended yet", tuple(s for s in ("planned", "running")))):
        rows = [[_link("", "experiments", v.experiment.id, v.experiment.id),
                 *map(html.escape, (v.experiment.name, v.experiment.hypothesis,
                                    v.experiment.outcome or "(not ended yet)"))]
                for v in views if v.experiment.status in statuses]
        sections.append(f"<h2>{title} ({len(rows)})</h2>" + (
            html_cells(["id", "question", "hypothesis", "outcome / reason"], rows)
            if rows else "<p>None.</p>"))
    # A prediction resolves when its experiment ends: a running one's last value is not
    # its outcome, and counting it would flatter (or smear) the calibration.
    scored = [(p, *(v.scored(p) if v.experiment.status in ENDED else
                    (None, v.scored(p)[1] + "; resolves when the experiment ends")))
              for v in views for p in v.predictions]
    pairs = [(p, actual) for p, actual, _ in scored]
    owner = {p.id: v.experiment.id for v in views for p in v.predictions}
    prediction_rows = [[_link("", "experiments", owner[p.id], owner[p.id]),
                        *map(html.escape, _finding_row(p, actual, basis))]
                       for p, actual, basis in scored]
    cal = calibration(pairs)
    summary = (f"<p>{cal.total} predictions registered, {cal.resolved} resolved (their "
               "experiment ended with an actual value). "
               + (f"Inside their interval: {cal.inside} of {cal.resolved} "
                  f"({cal.fraction_inside:.0%}); mean absolute error {cal.mean_abs_error:.4g}."
                  if cal.resolved else "None resolved yet.") + "</p>")
    predictions = (html_cells(["experiment", "name", "metric", "predicted", "interval",
                               "actual", "error (actual - predicted)", "inside", "registered",
                               "scored against"],
                              prediction_rows) if pairs else "<p>None registered.</p>")
    multipliers = [[_link("", "experiments", v.experiment.id, v.experiment.id),
                    html.escape(v.experiment.hypothesis), *map(html.escape, row)]
                   for v in views for row in multiplier_rows(v)]
    if multipliers:
        predictions += ("<h2>Compute multipliers (measured, with intervals)</h2>"
                        + html_cells(["experiment", "hypothesis", "run", "comparison", "kind",
                                      "multiplier", "interval", "distinguishable from 1"],
                                     multipliers))
    ended = sum(v.experiment.status in ENDED for v in views)
    body = (f"{_nav('')}<h1>Findings</h1><p>{len(views)} experiments, {ended} ended. "
            "Nothing is deleted: failed and abandoned work stays here with its reason.</p>"
            + "".join(sections) + "<h2>Pre-registered predictions and calibration</h2>"
            + f'<div id="calibration">{summary}</div>{predictions}')
    return html_page("moelab lab findings", body, head=head)


def _finding_row(p: Prediction, actual: float | None, basis: str) -> list[str]:
    name, metric, value, interval, observed, inside, registered, basis = prediction_row(
        p, actual, basis)
    known = actual is not None and math.isfinite(actual)
    return [name, metric, value, interval, observed,
            fmt_num(actual - p.value) if known else "", inside, registered, basis]


# ------------------------------------------------------------------------- writing out


def static_asset(name: str) -> bytes:
    """The bytes of one file under static/: plotly.js as shipped inside the plotly wheel (no
    CDN) with its license, and moelab's own charts.js."""
    if name == "charts.js":
        return (resources.files("moelab.lab") / "static" / "charts.js").read_bytes()
    try:
        if name == "plotly.min.js":
            return (resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
        if name == "PLOTLY-LICENSE.txt":
            license_text = next(
                (f.read_text() for f in metadata.files("plotly") or []
                 if f.name.upper().startswith("LICENSE")), "plotly.js is MIT-licensed.")
            return license_text.encode()
    except (ModuleNotFoundError, metadata.PackageNotFoundError) as err:
        raise UserError("interactive charts need plotly: pip install -e '.[lab]'") from err
    raise UserError(f"no static file {name!r}")


def write_static(out: Path) -> None:
    """Every file under static/; read first, so a missing extra leaves no empty folder."""
    assets = {name: static_asset(name) for name in STATIC_FILES}
    (out / "static").mkdir(parents=True, exist_ok=True)
    for name, data in assets.items():
        (out / "static" / name).write_bytes(data)


def publish(store: Store, out_dir: str | Path) -> list[Path]:
    """Write the whole lab as a static site into out_dir; return the pages written."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; publish needs a directory")
    write_static(out)
    pages = {"index.html": render_index(store), "findings.html": render_findings(store)}
    for e in store.list_experiments():
        pages[f"experiments/{e.id}.html"] = render_experiment(store, e.id)
        if runs := store.runs(e.id):
            pages[f"compare/{e.id}.html"] = render_compare(store, [r.id for r in runs])
    for relative, text in pages.items():
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_text(text, encoding="utf-8")
    return [out / relative for relative in pages]


def write_report(store: Store, exp_id: str, out_dir: str | Path) -> list[Path]:
    """report.html (interactive, with its static/ files), summary.md and one PNG per plot
    (for pasting into an issue) into out_dir; return the paths."""
    view: ExperimentView = load_view(store, exp_id)
    out = Path(out_dir)
    write_static(out)
    written = []
    for spec in view.plots():
        written.append(out / f"{spec.name}.png")
        written[-1].write_bytes(render_plot(store, view, spec))
    page = render_experiment(store, exp_id, root="", standalone=True, png_url="{}.png")
    (out / "report.html").write_text(page, encoding="utf-8")
    (out / "summary.md").write_text(render_markdown(view), encoding="utf-8")
    return [out / "report.html", out / "summary.md", *written]
