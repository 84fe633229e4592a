// moelab lab charts: draws every <div class="chart"> of the page with plotly.js.
//
// The data comes from the page's <script type="application/json" id="lab-data"> block,
// never from inline script (the pages' Content-Security-Policy forbids it). Every string
// shown by plotly (which reads a little HTML in names and titles) is escaped first.
// Controls: EMA smoothing, run toggles, log y per chart, the metric of the "any" chart.
// Their state and each chart's zoom are kept in sessionStorage, so the dashboard's reload
// on new data keeps them (a double click on a chart zooms back out).
"use strict";
(function () {
  const block = document.getElementById("lab-data");
  if (!block || !window.Plotly) return;
  const data = JSON.parse(block.textContent);
  const charts = Object.fromEntries(data.charts.map((c) => [c.id, c]));
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"];
  const color = Object.fromEntries(data.runs.map((r, i) => [r.id, COLORS[i % COLORS.length]]));
  const storeKey = "moelab-charts:" + location.pathname + location.search;
  const saved = JSON.parse(sessionStorage.getItem(storeKey) || "{}");
  const state = {smoothing: saved.smoothing || 0, hidden: new Set(saved.hidden || []),
                 log: saved.log || {}, zoom: saved.zoom || {}, metric: saved.metric};
  const save = () => sessionStorage.setItem(storeKey, JSON.stringify(
    {...state, hidden: [...state.hidden]}));

  const text = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;")
    .replace(/>/g, "&gt;").replace(/"/g, "&quot;");

  // Debiased exponential moving average (as TensorBoard and W&B smooth): gaps stay gaps.
  function ema(values, alpha) {
    if (!alpha) return values;
    let acc = 0, weight = 0;
    return values.map((y) => {
      if (y === null) return null;
      acc = alpha * acc + (1 - alpha) * y;
      weight = alpha * weight + (1 - alpha);
      return acc / weight;
    });
  }

  function spec(div) {
    if (div.dataset.chart !== "any") return charts[div.dataset.chart];
    const metric = div.parentElement.querySelector(".metric-select").value;
    return {title: metric, y_label: data.units[metric], metrics: [metric], bands: []};
  }

  function traces(chart) {
    const several = data.runs.length > 1;
    const out = [];
    chart.metrics.forEach((metric, m) => {
      for (const run of data.runs) {
        const points = (data.series[metric] || {})[run.id];
        if (!points) continue;
        out.push({
          type: "scatter", mode: "lines", x: points[0], y: ema(points[1], state.smoothing),
          name: text(several ? `${run.label} ${metric}` : metric), meta: run.id,
          visible: !state.hidden.has(run.id),
          line: several ? {color: color[run.id], dash: DASHES[m % DASHES.length], width: 1.5}
                        : {width: 1.5},
        });
      }
    });
    return out;
  }

  function marks(chart) {
    const shapes = [], annotations = [];
    for (const e of data.events) {
      if (state.hidden.has(e.run)) continue;
      shapes.push({type: "line", xref: "x", yref: "paper", x0: e.step, x1: e.step, y0: 0,
                   y1: 1, line: {color: color[e.run] || "#a00", width: 1, dash: "dot"}});
      annotations.push({x: e.step, xref: "x", y: 1, yref: "paper", yanchor: "bottom",
                        showarrow: false, text: text(e.kind),
                        font: {size: 10, color: color[e.run] || "#a00"},
                        hovertext: text(`${e.label} step ${e.step} ${e.kind}: ${e.message}`)});
    }
    for (const b of chart.bands) {
      shapes.push({type: "rect", xref: "paper", x0: 0, x1: 1, yref: "y", y0: b.low, y1: b.high,
                   fillcolor: "rgba(0,0,0,0.12)", line: {width: 0}});
      shapes.push({type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: b.value,
                   y1: b.value, line: {color: "black", width: 1, dash: "dash"}});
      annotations.push({xref: "paper", x: 1, xanchor: "right", yref: "y", y: b.high,
                        yanchor: "bottom", showarrow: false, font: {size: 10},
                        text: text(`${b.label}: ${b.value.toPrecision(4)} ` +
                                   `[${b.low.toPrecision(4)}, ${b.high.toPrecision(4)}]`)});
    }
    return {shapes, annotations};
  }

  // The key of a chart's saved zoom: the "any" chart has one per metric.
  const zoomKey = (div) => div.dataset.chart === "any" ? "any:" + spec(div).metrics[0]
                                                       : div.dataset.chart;

  function draw(div) {
    const chart = spec(div);
    const logY = div.parentElement.querySelector(".log-y").checked;
    const zoom = state.zoom[zoomKey(div)] || {};
    const layout = {
      title: {text: text(chart.title)},
      // The x range follows the data only (unless zoomed): a running experiment is not
      // stretched to its planned number of steps.
      xaxis: {title: {text: text(data.x_label)}, autorange: !zoom.x, range: zoom.x},
      yaxis: {title: {text: text(chart.y_label)}, type: logY ? "log" : "linear",
              autorange: !zoom.y, range: zoom.y, uirevision: logY ? "log" : "linear"},
      margin: {t: 40, r: 20, b: 50, l: 70}, hovermode: "closest", uirevision: "keep",
      legend: {font: {size: 10}},
      ...marks(chart),
    };
    Plotly.react(div, traces(chart), layout, {displaylogo: false, responsive: true});
  }

  const divs = [...document.querySelectorAll(".chart")];
  const redraw = () => {
    save();
    divs.forEach(draw);
  };

  const slider = document.getElementById("smoothing");
  const shown = document.getElementById("smoothing-value");
  slider.value = shown.value = state.smoothing;
  slider.addEventListener("input", () => {
    state.smoothing = Number(slider.value);
    shown.value = slider.value;
    redraw();
  });
  for (const box of document.querySelectorAll(".run-toggle")) {
    box.checked = !state.hidden.has(box.dataset.run);
    box.addEventListener("change", () => {
      if (box.checked) state.hidden.delete(box.dataset.run);
      else state.hidden.add(box.dataset.run);
      redraw();
    });
  }
  for (const div of divs) {
    const box = div.parentElement;
    const logBox = box.querySelector(".log-y");
    const select = box.querySelector(".metric-select");
    if (select && state.metric) select.value = state.metric;
    if (zoomKey(div) in state.log) logBox.checked = state.log[zoomKey(div)];
    logBox.addEventListener("change", () => {
      state.log[zoomKey(div)] = logBox.checked;
      delete (state.zoom[zoomKey(div)] || {}).y;  // a y range means nothing on the new scale
      save();
      draw(div);
    });
    if (select) select.addEventListener("change", () => {
      state.metric = select.value;
      logBox.checked = !!state.log[zoomKey(div)];
      save();
      draw(div);
    });
  }
  divs.forEach(draw);
  for (const div of divs) {
    div.on("plotly_relayout", (change) => {
      const zoom = state.zoom[zoomKey(div)] = state.zoom[zoomKey(div)] || {};
      for (const axis of ["x", "y"]) {
        const [start, end] = [`${axis}axis.range[0]`, `${axis}axis.range[1]`];
        if (change[`${axis}axis.autorange`]) delete zoom[axis];
        else if (change[`${axis}axis.range`]) zoom[axis] = change[`${axis}axis.range`];
        else if (start in change) zoom[axis] = [change[start], change[end]];
      }
      save();
    });
  }
})();
