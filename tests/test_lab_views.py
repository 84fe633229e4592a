"""What readers see, without a browser: the report, the static site's pages, the JSON the
charts read, findings and calibration, and the dashboard over HTTP (Host check, load,
caching, disconnects). tests/test_lab_browser.py drives the same pages in Chromium."""

from __future__ import annotations

import html.parser
import http.client
import io
import json
import socket
import struct
import threading
import time
from pathlib import Path

import matplotlib.image
import pytest
from conftest import EVIL

from moelab.errors import UserError
from moelab.lab.dashboard import make_server
from moelab.lab.records import Prediction
from moelab.lab.site import DATA_ID, calibration, config_diff, json_script, publish, write_report
from moelab.lab.store import Store

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Scripts(html.parser.HTMLParser):
    """Collects each <script> element's attributes and text as a browser would parse them."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self._open: dict[str, str | None] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._open = dict(attrs)
            self.scripts.append((self._open, ""))

    def handle_data(self, data):
        if self._open is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def handle_endtag(self, tag):
        if tag == "script":
            self._open = None


def assert_safe_page(page: str) -> dict | None:
    """The page runs no inline script and no script from elsewhere, and its chart data (if
    any) parses back as JSON. Returns that data."""
    parser = Scripts()
    parser.feed(page)
    data = None
    for attrs, text in parser.scripts:
        if attrs.get("type") == "application/json":
            assert attrs["id"] == DATA_ID and data is None
            data = json.loads(text)
        else:  # code: only moelab's own files, relative to the site
            assert text == "" and attrs["src"].lstrip("./").startswith("static/"), attrs
    return data


def assert_png(data: bytes) -> None:
    assert data.startswith(PNG_SIGNATURE)
    height, width, channels = matplotlib.image.imread(io.BytesIO(data)).shape
    assert height > 100 and width > 100 and channels in (3, 4)


# ----------------------------------------------------------------- escaping and units


def test_json_script_cannot_be_closed_by_any_string():
    payload = {"name": EVIL, "other": "<!-- <script> & ]]>", "uni": "\u2028"}
    block = json_script(payload)
    inner = block[block.index(">") + 1: -len("</script>")]
    assert "<" not in inner and ">" not in inner and "&" not in inner
    assert json.loads(inner) == payload
    with pytest.raises(ValueError):  # NaN is not JSON: the payload must say null
        json_script({"x": float("nan")})


def test_config_diff_lists_only_differing_fields():
    rows = config_diff({
        "run-1": {"optim": {"lr": 1e-3, "b1": 0.9}, "train": {"steps": 10}, "tag": "a"},
        "run-2": {"optim": {"lr": 3e-3, "b1": 0.9}, "train": {"steps": 10}},
    })
    assert rows == [["optim.lr", "0.001", "0.003"], ["tag", "a", "(unset)"]]


def test_calibration_counts_inside_and_mean_abs_error():
    def p(value, low, high):
        return Prediction(0, "exp-1", "p", value, low, high, {}, 0.0)

    cal = calibration([(p(2.0, 1.8, 2.2), 2.1), (p(3.0, 2.9, 3.1), 3.5),
                       (p(1.0, 0.5, 1.5), None), (p(1.0, 0.5, 1.5), float("nan"))])
    assert (cal.total, cal.resolved, cal.inside) == (4, 2, 1)
    assert cal.fraction_inside == 0.5
    assert cal.mean_abs_error == pytest.approx((0.1 + 0.5) / 2)  # |2.1-2.0|, |3.5-3.0|
    assert calibration([]).fraction_inside is None


# ---------------------------------------------------------------------- report, site


def test_report_writes_interactive_html_markdown_and_pngs(sample_lab, tmp_path):
    with Store(sample_lab, mode="ro") as store:
        paths = write_report(store, "exp-1", tmp_path)
    names = {p.name for p in paths}
    assert names == {"report.html", "summary.md", "loss.png", "val_loss.png", "grad_norm.png",
                     "drop_frac.png", "expert_load.png"}
    for path in paths:
        if path.suffix == ".png":
            assert_png(path.read_bytes())
    assert (tmp_path / "static/plotly.min.js").stat().st_size > 1_000_000
    assert "MIT" in (tmp_path / "static/PLOTLY-LICENSE.txt").read_text()
    data = assert_safe_page((tmp_path / "report.html").read_text())
    assert [c["id"] for c in data["charts"]] == ["loss", "val_loss", "grad_norm", "drop_frac",
                                                 "expert_load"]
    assert data["charts"][0]["y_label"] == "loss (nats/token)"
    assert data["charts"][0]["bands"] == [{"label": "predicted final loss", "value": 2.0,
                                           "low": 1.8, "high": 2.2}]
    steps, values = data["series"]["loss"]["run-2"]
    assert steps == list(range(30)) and values[3] == pytest.approx(4.5 / (1 + 3 / 8))
    summary = (tmp_path / "summary.md").read_text()
    assert summary.endswith(".png\n")  # one final newline
    observed = 4.5 / (1 + 29 / 8)  # run-2's last loss: the latest run that logged it
    assert f"| final loss | loss | 2 | [1.8, 2.2] | {observed:.4g} | no |" in summary
    assert "| run-1 | 30 | restart | resumed from step 25 \\</script>" in summary


def test_every_published_page_escapes_names_and_chart_json(sample_lab, tmp_path):
    with Store(sample_lab, mode="ro") as store:
        pages = publish(store, tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in pages} == {
        "index.html", "findings.html", "experiments/exp-1.html", "experiments/exp-2.html",
        "compare/exp-1.html", "compare/exp-2.html"}
    for page in pages:
        text = page.read_text()
        assert_safe_page(text)
        assert 'http-equiv="Content-Security-Policy"' in text
    dense = assert_safe_page((tmp_path / "experiments/exp-2.html").read_text())
    assert dense["events"][0]["message"] == EVIL  # the data holds it; the page shows it
    assert html.escape(EVIL) in (tmp_path / "index.html").read_text()


def test_compare_page_diffs_configs_and_lists_val_loss_per_source(sample_lab, tmp_path):
    with Store(sample_lab, mode="ro") as store:
        publish(store, tmp_path)
    page = (tmp_path / "compare/exp-1.html").read_text()
    data = assert_safe_page(page)
    assert [r["id"] for r in data["runs"]] == ["run-1", "run-2"]
    assert "<tr><td>optim.lr</td><td>0.001</td><td>0.003</td></tr>" in page
    assert "train.steps" not in page.split("Config fields that differ")[1]  # equal: left out
    last = [1.1 * 5 / (1 + 39 / 8), 1.1 * 4.5 / (1 + 29 / 8)]  # each run's last val loss
    assert f"<tr><td>val_loss/web</td><td>{last[0]:.4g}</td><td>{last[1]:.4g}</td></tr>" in page
    assert [(e["run"], e["step"], e["kind"]) for e in data["events"]] == [
        ("run-1", 20, "spike"), ("run-1", 30, "restart")]


def test_findings_page_lists_outcomes_and_calibration(tmp_path):
    with Store(tmp_path / "lab.sqlite") as store:
        for i, (actual, status) in enumerate([(2.1, "succeeded"), (3.5, "failed")]):
            exp = store.new_experiment(f"q{i}", f"h{i}", {}, None)
            store.add_prediction(exp, "final loss", 2.0 + i, 1.8 + i, 2.2 + i, {})
            store.log_metrics(store.start_run(exp, "r", {}), 5, {"loss": actual})
            store.finish_experiment(exp, status, f"reason {i}")
        store.finish_experiment(store.new_experiment("q2", "h2", {}, None), "abandoned",
                                "no compute left")
        running = store.new_experiment("q3", "h3", {}, None)  # not ended: not resolved
        store.add_prediction(running, "final loss", 2.0, 1.9, 2.1, {})
        store.log_metrics(store.start_run(running, "r", {}), 1, {"loss": 9.0})
        publish(store, tmp_path / "site")
    page = (tmp_path / "site/findings.html").read_text()
    assert "<h2>Failed (1)</h2>" in page and "reason 1" in page
    assert "<h2>Abandoned (1)</h2>" in page and "no compute left" in page
    assert "3 predictions registered, 2 resolved" in page
    assert "Inside their interval: 1 of 2 (50%); mean absolute error 0.3." in page
    assert "<td>3.5</td><td>0.5</td><td>no</td>" in page  # actual, error, inside


# ------------------------------------------------------------------------- dashboard


@pytest.fixture(scope="module")
def dashboard(sample_lab):
    server = make_server(sample_lab, port=0, refresh_ms=200, allowed_hosts=["lab.internal"])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def request(server, method: str, path: str,
            host: str | None = None) -> tuple[http.client.HTTPResponse, bytes]:
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    headers = {"Host": host} if host else {}
    connection.request(method, path, headers=headers)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response, body


def test_dashboard_answers_only_allowed_hosts(dashboard):
    port = dashboard.server_address[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "[",
                 f"localhost.:{port}"):
        response, body = request(dashboard, "GET", "/", host=host)
        assert response.status == 403 and b"moe-baseline" not in body, host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "lab.internal"):
        assert request(dashboard, "GET", "/", host=host)[0].status == 200, host


def test_dashboard_is_read_only_and_safe(dashboard):
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        response, _ = request(dashboard, method, "/")
        assert response.status == 405 and response.getheader("Allow") == "GET"
    for path in ("/", "/experiments/exp-2.html", "/compare/exp-2.html", "/findings.html",
                 "/compare.html?run=run-1&run=run-3"):
        response, body = request(dashboard, "GET", path)
        assert response.status == 200, path
        assert "script-src" not in response.getheader("Content-Security-Policy")
        assert_safe_page(body.decode())


def test_dashboard_compares_runs_of_several_experiments(dashboard):
    data = assert_safe_page(request(dashboard, "GET", "/compare.html?run=run-2&run=run-3")[1]
                            .decode())
    assert [r["label"] for r in data["runs"]] == ["run-2 (exp-1)", "run-3 (exp-2)"]
    assert set(data["series"]["loss"]) == {"run-2", "run-3"}


def test_dashboard_serves_plots_static_state_and_404s(dashboard):
    assert_png(request(dashboard, "GET", "/plot/exp-1/grad_norm.png")[1])
    assert request(dashboard, "GET", "/static/plotly.min.js")[1].startswith(b"/**\n* plotly.js")
    state = json.loads(request(dashboard, "GET", "/api/experiments")[1])
    assert [(e["id"], [r["last_step"] for r in e["runs"]]) for e in state][:2] == [
        ("exp-1", [39, 29]), ("exp-2", [0])]
    for path in ("/plot/exp-2/drop_frac.png", "/experiments/exp-99.html", "/etc/passwd",
                 "/static/../lab.sqlite", "/compare.html", "/compare.html?run=run-99"):
        assert request(dashboard, "GET", path)[0].status == 404, path


def test_dashboard_answers_200_concurrent_requests_with_one_render_each(sample_lab):
    """200 connections are made while the server is not yet accepting (the listen backlog
    must hold them all: Python's default of 5 would leave the 7th hanging), then served at
    once; every one is answered, and each distinct page renders once however many ask."""
    if int(Path("/proc/sys/net/core/somaxconn").read_text()) < 256:
        pytest.skip("net.core.somaxconn < 256 caps any server's listen backlog below 200")
    server = make_server(sample_lab, port=0)
    serving = threading.Thread()  # not started until every connection is made
    paths = ["/plot/exp-1/loss.png", "/experiments/exp-1.html", "/compare/exp-1.html",
             "/api/experiments"]
    try:
        sockets = [socket.create_connection(server.server_address[:2], timeout=5)
                   for _ in range(200)]
        for i, sock in enumerate(sockets):
            sock.sendall(f"GET {paths[i % 4]} HTTP/1.1\r\nHost: localhost\r\n"
                         "Connection: close\r\n\r\n".encode())
        serving = threading.Thread(target=server.serve_forever, daemon=True)
        serving.start()
        answers = []
        deadline = time.monotonic() + 60  # generous: a few seconds on an idle machine
        for sock in sockets:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            response = http.client.HTTPResponse(sock)
            response.begin()
            answers.append((response.status, len(response.read())))
            sock.close()
    finally:
        if serving.is_alive():
            server.shutdown()
        server.server_close()
    assert [status for status, _ in answers] == [200] * 200
    assert all(size > 0 for _, size in answers)
    assert server.cache.renders == 3  # png, experiment page, compare page; JSON is live


def test_dashboard_logs_a_client_disconnect_as_one_line(sample_lab, capfd):
    server = make_server(sample_lab, port=0)
    # A small send buffer on the listening socket, which accepted sockets inherit, so
    # the reply cannot sit whole in the kernel's buffers at the reset.
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    logged = []
    try:
        # A reset that reaches the server after its last write has nothing to report, and
        # on a busy machine that happens now and then (about 1 in 5 here), so a few
        # disconnects are made until one is reported; none may print a traceback.
        for _ in range(4):
            # A small receive window, set before connecting (afterwards the window is
            # already negotiated), keeps most of plotly.min.js (~4.8 MB) unsent at the reset.
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(server.server_address[:2])
            sock.sendall(b"GET /static/plotly.min.js HTTP/1.1\r\nHost: localhost\r\n\r\n")
            sock.recv(1024)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # linger 0: a reset, as when a tab is closed mid-download
            err, deadline = "", time.time() + 5
            while "\n" not in err and time.time() < deadline:
                time.sleep(0.1)
                err += capfd.readouterr().err
            logged.append(err)
            if err:
                break
    finally:
        server.shutdown()
        server.server_close()
    assert not any("Traceback" in err for err in logged), logged
    lines = [line for line in logged[-1].splitlines() if line.strip()]
    assert len(lines) == 1 and "disconnected before the reply was sent" in lines[0], logged


def test_dashboard_refuses_bad_port_missing_lab_and_busy_port(sample_lab, tmp_path):
    with pytest.raises(UserError, match="no lab database"):
        make_server(tmp_path / "missing.sqlite", port=0)
    (tmp_path / "bad.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(UserError, match="not a readable moelab lab database"):
        make_server(tmp_path / "bad.sqlite", port=0)
    with pytest.raises(UserError, match="0..65535"):
        make_server(sample_lab, port=99999)
    server = make_server(sample_lab, port=0)
    try:
        with pytest.raises(UserError, match="cannot listen on"):
            make_server(sample_lab, port=server.server_address[1])
    finally:
        server.server_close()


def test_static_report_assets_match_the_dashboard(dashboard, tmp_path):
    with Store(dashboard.lab_path, mode="ro") as store:
        write_report(store, "exp-1", tmp_path)
    served = request(dashboard, "GET", "/static/charts.js")[1]
    assert served == (tmp_path / "static/charts.js").read_bytes()
    assert Path(tmp_path / "report.html").read_text().count('src="static/') == 2
