"""The lab's pages in a real headless Chromium: the live dashboard over HTTP and the
published static site opened from file://. Charts must draw, controls must act on them,
hostile names must show as text and never run, and the console must stay free of errors
(a CSP violation or a script error is logged there)."""

from __future__ import annotations

import threading

import pytest
from conftest import EVIL

from moelab.lab.dashboard import make_server
from moelab.lab.site import publish
from moelab.lab.store import Store

# [chart id, traces drawn, traces hidden, run ids drawn, x range] for every chart div, or
# null while the page has no chart or one is not drawn yet.
CHARTS = """
const divs = [...document.querySelectorAll('.chart')];
if (!divs.length || !divs.every(d => d._fullLayout)) return null;
return divs.map(d => [
  d.dataset.chart, d.querySelectorAll('.scatterlayer .trace').length,
  d.data.filter(t => t.visible === false).length,
  [...new Set(d.data.filter(t => t.visible !== false).map(t => t.meta))].sort(),
  d._fullLayout.xaxis.range]);"""


def wait_for(browser, condition, timeout: float = 20):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, timeout, ignored_exceptions=[StaleElementReferenceException])
    return wait.until(condition)


def charts_drawn(browser) -> list:
    """Wait until the page's charts are all drawn with traces; return CHARTS for them."""
    return wait_for(browser, lambda b: (c := b.execute_script(CHARTS))
                    and all(traces > 0 for _, traces, *_ in c) and c)


def open_fresh(browser, url: str) -> None:
    """Open url with the charts' saved control state (sessionStorage) cleared."""
    browser.get(url)
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()


def body_text(browser) -> str:
    return browser.find_element("tag name", "body").text


def assert_no_console_errors(browser) -> None:
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


@pytest.fixture(scope="module")
def dashboard(sample_lab):
    server = make_server(sample_lab, port=0, refresh_ms=200)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def site(sample_lab, tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    with Store(sample_lab, mode="ro") as store:
        publish(store, out)
    return out


def test_static_site_from_file_draws_charts_and_toggles_runs(chromium, site):
    open_fresh(chromium, (site / "index.html").as_uri())
    wait_for(chromium, lambda b: "moe-baseline" in body_text(b))
    chromium.find_element("link text", "exp-1").click()
    charts = charts_drawn(chromium)
    assert [c[0] for c in charts] == ["loss", "val_loss", "grad_norm", "drop_frac",
                                      "expert_load", "any"]
    loss = charts[0]
    assert loss[3] == ["run-1", "run-2"]
    assert loss[4][1] <= 39 * 1.1  # the data's last step, not the planned 1000
    assert chromium.execute_script(
        "return document.querySelector('[data-chart=loss]').layout.yaxis.title.text"
    ) == "loss (nats/token)"

    chromium.find_element("css selector", ".run-toggle[data-run=run-1]").click()
    after = wait_for(chromium, lambda b: (c := b.execute_script(CHARTS)) and c[0][3] == ["run-2"]
                     and c)
    assert after[0][1:3] == [1, 1]  # one trace drawn, one hidden
    assert all("run-1" not in c[3] for c in after)
    assert_no_console_errors(chromium)


def test_static_site_smoothing_and_log_y_change_the_chart(chromium, site):
    open_fresh(chromium, (site / "experiments/exp-1.html").as_uri())
    charts_drawn(chromium)
    raw = chromium.execute_script("return document.querySelector('[data-chart=loss]').data[0].y")
    chromium.execute_script("""const s = document.getElementById('smoothing');
        s.value = 0.9; s.dispatchEvent(new Event('input'));""")
    smoothed = wait_for(chromium, lambda b: (y := b.execute_script(
        "return document.querySelector('[data-chart=loss]').data[0].y")) != raw and y)
    assert smoothed[0] == pytest.approx(raw[0])  # debiased: starts at the first value
    assert smoothed[-1] > raw[-1]  # lags a falling curve
    chromium.find_element("css selector", ".chart-box .log-y").click()
    wait_for(chromium, lambda b: b.execute_script(
        "return document.querySelector('[data-chart=loss]')._fullLayout.yaxis.type") == "log")
    assert_no_console_errors(chromium)


def test_static_compare_page_overlays_two_runs_with_events(chromium, site):
    open_fresh(chromium, (site / "compare/exp-1.html").as_uri())
    charts = charts_drawn(chromium)
    assert charts[0][0] == "loss" and charts[0][1] == 2 and charts[0][3] == ["run-1", "run-2"]
    shapes = chromium.execute_script(
        "return document.querySelector('[data-chart=loss]').layout.shapes"
        ".filter(s => s.yref === 'paper').map(s => s.x0)")
    assert shapes == [20, 30]  # the spike and the restart, marked on the curves
    assert "optim.lr" in body_text(chromium)
    assert_no_console_errors(chromium)


def test_static_site_shows_hostile_names_as_text(chromium, site):
    for page in ("index.html", "experiments/exp-2.html", "compare/exp-2.html",
                 "findings.html"):
        chromium.get((site / page).as_uri())
        wait_for(chromium, lambda b: EVIL in body_text(b))
        assert chromium.execute_script("return window.__pwned") is None
    chromium.get((site / "experiments/exp-2.html").as_uri())
    charts_drawn(chromium)
    assert chromium.execute_script("return window.__pwned") is None
    assert_no_console_errors(chromium)


def test_dashboard_draws_charts_and_reloads_when_a_run_writes(chromium, dashboard, sample_lab):
    chromium.get(dashboard.url)
    wait_for(chromium, lambda b: "moe-baseline" in body_text(b))
    assert EVIL in body_text(chromium) and chromium.execute_script("return window.__pwned") is None
    chromium.find_element("css selector", "input[value=run-2]").click()
    chromium.find_element("css selector", "input[value=run-3]").click()
    chromium.find_element("css selector", "form button").click()
    charts = charts_drawn(chromium)
    assert charts[0][3] == ["run-2", "run-3"]  # runs of two experiments on one chart

    chromium.get(dashboard.url + "experiments/exp-1.html")
    charts_drawn(chromium)
    assert_no_console_errors(chromium)
    chromium.execute_script(  # zoom, as a drag would, and turn on log y
        "Plotly.relayout(document.querySelector('[data-chart=loss]'), 'xaxis.range', [5, 10])")
    chromium.find_element("css selector", ".chart-box .log-y").click()
    with Store(sample_lab) as store:  # a run writes; the open page notices and reloads
        store.log_metrics("run-2", 30, {"loss": 0.5})
    wait_for(chromium, lambda b: b.execute_script(
        "const d = document.querySelector('[data-chart=loss]');"
        "return d && d.data && d.data[1].x.length") == 31)
    charts = charts_drawn(chromium)
    assert charts[0][4] == [5, 10]  # the reader's zoom survives the reload
    assert chromium.execute_script(
        "return document.querySelector('[data-chart=loss]')._fullLayout.yaxis.type") == "log"
    assert_no_console_errors(chromium)
