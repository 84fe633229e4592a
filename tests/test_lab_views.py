"""What readers see: the static report, the Markdown summary, the dashboard over HTTP, and
the dashboard in a real headless Chromium."""

from __future__ import annotations

import http.client
import io
import json
import shutil
import threading
from pathlib import Path

import matplotlib.image
import pytest

from moelab.errors import UserError
from moelab.lab.dashboard import make_server
from moelab.lab.report import write_report
from moelab.lab.store import Store

EVIL = "<script>window.__pwned = 1</script>"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    """Two experiments: an MoE run with every metric the trainer logs, restarts and a spike;
    and a dense run with a hostile name that logs only loss."""
    path = tmp_path_factory.mktemp("lab") / "lab.sqlite"
    with Store(path) as store:
        moe = store.new_experiment("moe-baseline", "loss reaches 2.0", {}, "abc+dirty")
        store.add_prediction(moe, "final loss", 2.0, 1.8, 2.2, {"metric": "loss"})
        run = store.start_run(moe, "runs/moe", {})
        for step in range(40):
            store.log_metrics(run, step, {
                "loss": 5 / (1 + step / 8), "grad_norm": 9.0 if step == 20 else 1.0,
                "val_loss/web": 5.5 / (1 + step / 8), "drop_frac/layer_0": 0.1,
                "expert_load_max_over_mean/layer_0": 1.5, "expert_load_max_over_mean/layer_1": 1.2,
            })
        store.log_event(run, 20, "spike", "grad norm 9.0")
        store.log_event(run, 30, "restart", f"resumed from step 25 {EVIL}")
        store.finish_run(run, "failed", "preempted")
        dense = store.new_experiment(EVIL, f"escaping {EVIL}", {}, None)
        store.log_metrics(store.start_run(dense, "runs/dense", {}), 0, {"loss": 4.0})
    return path


def assert_png(path_or_bytes: Path | bytes) -> None:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else path_or_bytes.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    height, width, channels = matplotlib.image.imread(io.BytesIO(data)).shape
    assert height > 100 and width > 100 and channels in (3, 4)


# ---------------------------------------------------------------------------- report


def test_report_writes_html_markdown_and_valid_pngs(lab, tmp_path):
    with Store(lab, mode="ro") as store:
        paths = write_report(store, "exp-1", tmp_path)
    names = {p.name for p in paths}
    assert names == {"report.html", "summary.md", "loss.png", "val_loss.png", "grad_norm.png",
                     "drop_frac.png", "expert_load.png"}
    for path in paths:
        if path.suffix == ".png":
            assert_png(path)
    page = (tmp_path / "report.html").read_text()
    assert all(f'src="{name}"' in page for name in names if name.endswith(".png"))
    summary = (tmp_path / "summary.md").read_text()
    assert "| final loss | loss | 2 | [1.8, 2.2] | 0.8511 | no |" in summary
    assert "| run-1 | 30 | restart | resumed from step 25 \\<script>" in summary


def test_report_escapes_names_and_copes_with_missing_metrics(lab, tmp_path):
    with Store(lab, mode="ro") as store:
        paths = write_report(store, "exp-2", tmp_path)
    assert {p.name for p in paths} == {"report.html", "summary.md", "loss.png"}
    page = (tmp_path / "report.html").read_text()
    assert "<script>" not in page
    assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in page
    assert "\\<script>" in (tmp_path / "summary.md").read_text()


# ------------------------------------------------------------------------- dashboard


@pytest.fixture(scope="module")
def dashboard(lab):
    server = make_server(lab, port=0, refresh_ms=200)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def request(server, method: str, path: str) -> tuple[http.client.HTTPResponse, bytes]:
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    connection.request(method, path)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response, body


def test_dashboard_binds_loopback_by_default(dashboard):
    assert dashboard.server_address[0] == "127.0.0.1"


def test_dashboard_is_read_only(dashboard):
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        response, _ = request(dashboard, method, "/")
        assert response.status == 405 and response.getheader("Allow") == "GET"


def test_dashboard_escapes_names_and_forbids_inline_script(dashboard):
    response, body = request(dashboard, "GET", "/")
    page = body.decode()
    assert response.status == 200 and "moe-baseline" in page
    assert "&lt;script&gt;window.__pwned" in page and EVIL not in page
    assert "script-src" not in response.getheader("Content-Security-Policy")  # 'self' only
    assert EVIL not in request(dashboard, "GET", "/experiments/exp-2")[1].decode()


def test_dashboard_serves_plots_state_and_404s(dashboard):
    assert_png(request(dashboard, "GET", "/plot/exp-1/grad_norm.png")[1])
    state = json.loads(request(dashboard, "GET", "/api/experiments")[1])
    assert [(e["id"], e["runs"][0]["last_step"]) for e in state][:2] == [("exp-1", 39),
                                                                          ("exp-2", 0)]
    assert request(dashboard, "GET", "/plot/exp-2/drop_frac.png")[0].status == 404
    assert request(dashboard, "GET", "/experiments/exp-99")[0].status == 404
    assert request(dashboard, "GET", "/etc/passwd")[0].status == 404


def test_dashboard_refuses_missing_or_corrupt_lab(tmp_path):
    with pytest.raises(UserError, match="no lab database"):
        make_server(tmp_path / "missing.sqlite", port=0)
    (tmp_path / "bad.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(UserError, match="not a readable moelab lab database"):
        make_server(tmp_path / "bad.sqlite", port=0)


# --------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--no-proxy-server",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))
    yield browser
    browser.quit()


ALL_IMAGES_LOADED = """
const images = [...document.images];
return images.length > 0 && images.every(i => i.complete && i.naturalWidth > 0);"""


def wait_for_text(browser, text: str) -> None:
    """Wait until the page shows `text`; the page may be mid-reload when we look."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 10, ignored_exceptions=[StaleElementReferenceException])
    wait.until(lambda b: text in b.find_element("tag name", "body").text)


def test_browser_shows_experiments_plots_and_escaped_names(chromium, dashboard, lab):
    from selenium.webdriver.support.ui import WebDriverWait

    chromium.get(dashboard.url)
    wait_for_text(chromium, "moe-baseline")
    assert EVIL in chromium.find_element("tag name", "body").text  # shown as text...
    assert chromium.execute_script("return window.__pwned") is None  # ...and never run
    WebDriverWait(chromium, 10).until(lambda b: b.execute_script(ALL_IMAGES_LOADED))
    chromium.find_element("link text", "exp-1").click()
    wait_for_text(chromium, "loss reaches 2.0")
    WebDriverWait(chromium, 10).until(lambda b: b.execute_script(ALL_IMAGES_LOADED))
    assert len(chromium.find_elements("tag name", "img")) == 5

    chromium.get(dashboard.url)
    wait_for_text(chromium, "moe-baseline")
    with Store(lab) as store:  # a run writes; the open page notices and reloads
        store.new_experiment("arrived-while-watching", "refresh works", {}, None)
    wait_for_text(chromium, "arrived-while-watching")
