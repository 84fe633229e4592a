"""A small read-only dashboard: the lab's experiments and their live curves, on localhost.

Read-only three ways: each request opens the lab with SQLite mode=ro, only GET is served
(other methods get 405), and pages carry a Content-Security-Policy that allows no inline
script, so even a string that slipped past escaping could not run. It binds 127.0.0.1
unless told otherwise. Pages poll a JSON endpoint and reload when a run writes.
"""

from __future__ import annotations

import html
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from moelab.errors import UserError
from moelab.lab.report import (
    html_cells,
    html_page,
    last_step,
    load_view,
    render_html,
    render_plot,
)
from moelab.lab.store import Store

HEADERS = {
    "Cache-Control": "no-store",  # curves change as runs write
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'",
}

# Polls /api/experiments and reloads the page when the state it describes changes.
REFRESH_JS = b"""
const every = Number(document.currentScript.dataset.refreshMs);
let seen = null;
async function poll() {
  try {
    const state = await (await fetch("/api/experiments", {cache: "no-store"})).text();
    if (seen !== null && state !== seen) location.reload();
    seen = state;
  } catch (err) {}  // server stopped: keep showing the last page
  setTimeout(poll, every);
}
poll();
"""


class Dashboard(ThreadingHTTPServer):
    daemon_threads = True  # a stuck browser tab must not keep `serve` from exiting

    def __init__(self, address: tuple[str, int], lab_path: Path, refresh_ms: int) -> None:
        super().__init__(address, DashboardHandler)
        self.lab_path = lab_path
        self.refresh_ms = refresh_ms

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


def make_server(
    lab_path: str | Path, host: str = "127.0.0.1", port: int = 8765, refresh_ms: int = 5000
) -> Dashboard:
    """A dashboard bound to host:port (port 0 picks a free one); call .serve_forever().

    The lab is opened once first, so a missing or corrupt file fails here with a clear
    message rather than on every page."""
    Store(lab_path, mode="ro").close()
    return Dashboard((host, port), Path(lab_path), refresh_ms)


class DashboardHandler(BaseHTTPRequestHandler):
    server: Dashboard
    ROUTES = (
        (re.compile(r"/"), "index"),
        (re.compile(r"/experiments/([\w.-]+)"), "experiment"),
        (re.compile(r"/plot/([\w.-]+)/(\w+)\.png"), "plot"),
        (re.compile(r"/api/experiments"), "state"),
    )

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/refresh.js":
            return self._send(200, "text/javascript", REFRESH_JS)
        route = next(((m, name) for p, name in self.ROUTES if (m := p.fullmatch(path))), None)
        if route is None:
            return self._send(404, "text/plain", b"not found")
        try:
            store = Store(self.server.lab_path, mode="ro")
        except UserError as err:
            return self._send(503, "text/plain", str(err).encode())
        with store:
            match, name = route
            try:
                content_type, body = getattr(self, name)(store, *match.groups())
            except UserError as err:
                return self._send(404, "text/plain", str(err).encode())
        self._send(200, content_type, body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Log only failures: open pages poll every few seconds, which would flood the log."""
        if not str(code).startswith(("2", "3")):
            super().log_request(code, size)

    def _refuse(self) -> None:
        self._send(405, "text/plain", b"the dashboard is read-only", {"Allow": "GET"})

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _refuse

    def _send(self, status: int, content_type: str, body: bytes,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in {**HEADERS, **(extra or {}), "Content-Type": content_type,
                           "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    # ------------------------------------------------------------------------- pages

    def _page(self, title: str, body: str) -> tuple[str, bytes]:
        script = f'<script src="/refresh.js" data-refresh-ms="{self.server.refresh_ms}"></script>'
        return "text/html; charset=utf-8", html_page(title, body, head=script).encode()

    def index(self, store: Store) -> tuple[str, bytes]:
        rows = []
        for experiment in store.list_experiments():
            view = load_view(store, experiment.id)
            curve = (f'<img src="/plot/{experiment.id}/loss.png" alt="loss curve" width="420">'
                     if view.plot("loss") else "no curve yet")
            rows.append([f'<a href="/experiments/{experiment.id}">{experiment.id}</a>',
                         *map(html.escape, (experiment.name, experiment.status,
                                            experiment.hypothesis, experiment.outcome)),
                         curve])
        header = ["id", "name", "status", "hypothesis", "outcome", "loss"]
        table = html_cells(header, rows) if rows else "<p>No experiments yet.</p>"
        return self._page("moelab lab", f"<h1>moelab lab</h1>{table}")

    def experiment(self, store: Store, exp_id: str) -> tuple[str, bytes]:
        view = load_view(store, exp_id)
        body = ('<p><a href="/">all experiments</a></p>'
                + render_html(view, lambda spec: f"/plot/{exp_id}/{spec.name}.png"))
        return self._page(f"{view.experiment.name} ({exp_id})", body)

    def plot(self, store: Store, exp_id: str, name: str) -> tuple[str, bytes]:
        view = load_view(store, exp_id)
        if (spec := view.plot(name)) is None:
            raise UserError(f"experiment {exp_id} has no {name} plot")
        return "image/png", render_plot(store, view, spec)

    def state(self, store: Store) -> tuple[str, bytes]:
        """What the pages poll: enough to notice any new step, status or outcome."""
        state = [
            {"id": e.id, "name": e.name, "status": e.status, "outcome": e.outcome,
             "runs": [{"id": run.id, "status": run.status,
                       "last_step": last_step(store.latest(run.id))} for run in store.runs(e.id)]}
            for e in store.list_experiments()
        ]
        return "application/json", json.dumps(state).encode()
