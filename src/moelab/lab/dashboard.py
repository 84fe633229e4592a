"""A read-only dashboard: the lab's pages (moelab.lab.site) served live on localhost.

Read-only three ways: each request opens the lab with SQLite mode=ro, only GET is served
(other methods get 405), and pages carry a Content-Security-Policy that allows no inline
script. It binds 127.0.0.1 unless told otherwise, and answers only requests whose Host
header names an allowed host (localhost, the bound address, and any given): a web page
that DNS-rebinds its own name to 127.0.0.1 sends its own name as Host and is refused, so
it cannot read the lab through the browser of whoever runs the dashboard.

Under load: one thread per connection with a listen backlog of 1024 (Python's default of 5
reset connections when 200 arrived at once), and rendered pages and PNGs cached per
(experiment, state of its runs), so N requests for one unchanged page render it once.
Pages poll a JSON endpoint and reload when a run writes.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from moelab.errors import UserError
from moelab.lab.report import last_step, load_view, render_plot
from moelab.lab.site import (
    CSP,
    STATIC_FILES,
    render_compare,
    render_experiment,
    render_findings,
    render_index,
    static_asset,
)
from moelab.lab.store import Store

HEADERS = {
    "Cache-Control": "no-store",  # curves change as runs write
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": CSP,
}
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")

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


class RenderCache:
    """Rendered bodies keyed by what they depend on, least recently used dropped first.

    Concurrent requests for one key wait for a single render rather than each rendering:
    a PNG costs about a second of CPU, and a page open in many tabs asks at once."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.renders = 0  # how many times render() ran: what the tests count
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, render: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            key_lock = self._pending.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._items:
                    return self._items[key]
            try:
                value = render()
            finally:
                with self._lock:
                    self._pending.pop(key, None)
            with self._lock:
                self.renders += 1
                self._items[key] = value
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        return value


class Dashboard(ThreadingHTTPServer):
    daemon_threads = True  # a stuck browser tab must not keep `serve` from exiting
    request_queue_size = 1024  # the listen backlog: bursts of connections wait, not reset

    def __init__(self, address: tuple[str, int], lab_path: Path, refresh_ms: int,
                 allowed_hosts: set[str]) -> None:
        super().__init__(address, DashboardHandler)
        self.lab_path = lab_path
        self.refresh_ms = refresh_ms
        self.allowed_hosts = allowed_hosts
        self.cache = RenderCache()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def handle_error(self, request: Any, client_address: tuple[str, int]) -> None:
        """A client that goes away mid-reply is normal (a closed tab): one line, no
        traceback. Anything else is a bug and keeps its traceback."""
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError | TimeoutError):
            print(f"dashboard: client {client_address[0]}:{client_address[1]} disconnected "
                  f"before the reply was sent ({type(err).__name__})", file=sys.stderr)
            return
        super().handle_error(request, client_address)


def make_server(
    lab_path: str | Path, host: str = "127.0.0.1", port: int = 8765, refresh_ms: int = 5000,
    allowed_hosts: tuple[str, ...] | list[str] = (),
) -> Dashboard:
    """A dashboard bound to host:port (port 0 picks a free one); call .serve_forever().

    allowed_hosts: names (besides localhost and the bound address) that may appear in the
    Host header, e.g. the machine's name when binding 0.0.0.0. The lab is opened once
    first, so a missing or corrupt file fails here with a clear message."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: a TCP port is 0..65535 (0 picks a free one)")
    Store(lab_path, mode="ro").close()
    static_asset("plotly.min.js")  # fail now, with the install hint, if plotly is missing
    allowed = {name.lower().strip("[]") for name in (*LOOPBACK_NAMES, host, *allowed_hosts)}
    try:
        return Dashboard((host, port), Path(lab_path), refresh_ms, allowed)
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port} ({err.strerror}); pick another "
                        "--port, or 0 for any free one") from err


class DashboardHandler(BaseHTTPRequestHandler):
    server: Dashboard
    timeout = 60  # seconds a silent client may hold its thread

    def do_GET(self) -> None:
        if not self._host_allowed():
            return self._send(403, "text/plain", b"this dashboard answers only requests "
                              b"addressed to localhost or an allowed host (--allow-host)")
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/") if url.path.strip("/") else ["index.html"]
        if parts[0] == "static" and len(parts) == 2 and parts[1] in (*STATIC_FILES,
                                                                       "refresh.js"):
            return self._static(parts[1])
        try:
            store = Store(self.server.lab_path, mode="ro")
        except UserError as err:
            return self._send(503, "text/plain", str(err).encode())
        with store:
            try:
                content_type, body = self._route(store, parts, parse_qs(url.query))
            except UserError as err:
                return self._send(404, "text/plain", str(err).encode())
        self._send(200, content_type, body)

    def _route(self, store: Store, parts: list[str],
               query: dict[str, list[str]]) -> tuple[str, bytes]:
        cache, head = self.server.cache, self._refresh_script(len(parts) - 1)
        match parts:
            case ["index.html"]:
                return _html(render_index(store, compare_form=True, head=head))
            case ["findings.html"]:
                return _html(render_findings(store, head=head))
            case ["compare.html"]:
                runs = query.get("run", [])
                key = ("chosen", tuple(runs),
                       tuple(_fingerprint(store, store.get_run(r).experiment_id) for r in runs))
                return cache.get(key, lambda: _html(render_compare(store, runs, "", head)))
            case ["experiments", page] if page.endswith(".html"):
                exp_id, png_url = page[:-5], f"../plot/{page[:-5]}/{{}}.png"
                return cache.get(("experiment", _fingerprint(store, exp_id)), lambda: _html(
                    render_experiment(store, exp_id, head=head, png_url=png_url)))
            case ["compare", page] if page.endswith(".html"):
                exp_id = page[:-5]
                runs = [run.id for run in store.runs(exp_id)]
                return cache.get(("compare", _fingerprint(store, exp_id)), lambda: _html(
                    render_compare(store, runs, head=head)))
            case ["plot", exp_id, name] if name.endswith(".png"):
                key = ("plot", name, _fingerprint(store, exp_id))
                return cache.get(key, lambda: ("image/png", _png(store, exp_id, name[:-4])))
            case ["api", "experiments"]:
                return "application/json", json.dumps(_state(store)).encode()
        raise UserError(f"no page {'/'.join(parts)}")

    def _refresh_script(self, depth: int) -> str:
        return (f'<script src="{"../" * depth}static/refresh.js" '
                f'data-refresh-ms="{self.server.refresh_ms}"></script>')

    def _static(self, name: str) -> None:
        if name == "refresh.js":
            return self._send(200, "text/javascript", REFRESH_JS)
        content_type = "text/javascript" if name.endswith(".js") else "text/plain"
        # Static files do not change while the server runs: let the browser keep them.
        self._send(200, content_type, self.server.cache.get(("static", name),
                                                            lambda: static_asset(name)),
                   {"Cache-Control": "max-age=3600"})

    def _host_allowed(self) -> bool:
        host = self.headers.get("Host")
        try:
            name = urlsplit(f"//{host}").hostname if host else None
        except ValueError:  # e.g. "[" or a port that is not a number
            return False
        return name is not None and name in self.server.allowed_hosts

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


def _html(page: str) -> tuple[str, bytes]:
    return "text/html; charset=utf-8", page.encode()


def _png(store: Store, exp_id: str, name: str) -> bytes:
    view = load_view(store, exp_id)
    if (spec := view.plot(name)) is None:
        raise UserError(f"experiment {exp_id} has no {name} plot")
    return render_plot(store, view, spec)


def _fingerprint(store: Store, exp_id: str) -> tuple[Any, ...]:
    """What an experiment's pages depend on: its status and outcome, each run's status and
    last step, and how many events and predictions it has. Equal fingerprints, equal pages."""
    view = load_view(store, exp_id)
    e = view.experiment
    return (e.id, e.status, e.outcome, len(view.events), len(view.predictions),
            tuple((run.id, run.status, last_step(view.latest[run.id])) for run in view.runs))


def _state(store: Store) -> list[dict[str, Any]]:
    """What the pages poll: enough to notice any new step, status or outcome."""
    return [
        {"id": e.id, "name": e.name, "status": e.status, "outcome": e.outcome,
         "runs": [{"id": run.id, "status": run.status,
                   "last_step": last_step(store.latest(run.id))} for run in store.runs(e.id)]}
        for e in store.list_experiments()
    ]
