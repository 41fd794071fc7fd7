// cdc dashboard: polls /status and /history, draws the stages and a uPlot chart of lag over time.
(function () {
  "use strict";
  const token = new URLSearchParams(location.search).get("token");
  const q = token ? "?token=" + encodeURIComponent(token) : "";
  const palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
  let chart = null;
  let chartKeys = "";
  window.cdcUpdates = 0;

  function text(v) { return v === null || v === undefined ? "–" : String(v); }
  function lagText(s) {
    const parts = [];
    if (s.lag_bytes !== undefined && s.lag_bytes !== null) parts.push(s.lag_bytes.toLocaleString() + " B");
    if (s.lag_offsets !== undefined && s.lag_offsets !== null) parts.push(s.lag_offsets.toLocaleString() + " offsets");
    if (s.retained_wal_bytes !== undefined && s.retained_wal_bytes !== null) parts.push("retained " + s.retained_wal_bytes.toLocaleString() + " B");
    return parts.join(", ") || "–";
  }
  function stageKey(s) { return s.stage === "apply" ? "apply:" + s.table + ":" + s.sink : s.stage; }
  function el(tag, attrs, content) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (content !== undefined) e.textContent = content;
    return e;
  }

  function renderStatus(r) {
    const overall = document.getElementById("overall");
    overall.textContent = r.verdict;
    overall.className = "verdict v-" + r.verdict;
    document.getElementById("meta").textContent =
      "source " + r.source.dsn + (r.source.reachable ? "" : " (unreachable)") +
      " · updated " + new Date(r.generated_ms).toLocaleTimeString();
    const body = document.querySelector("#stages tbody");
    body.replaceChildren();
    for (const s of r.stages) {
      const tr = el("tr", { "data-stage": stageKey(s), "data-verdict": s.verdict, "data-severity": s.severity });
      tr.appendChild(el("td", {}, s.name));
      const v = el("span", { class: "verdict v-" + s.verdict + (s.severity === "critical" ? " crit" : "") }, s.verdict);
      const td = el("td"); td.appendChild(v); tr.appendChild(td);
      tr.appendChild(el("td", {}, lagText(s)));
      tr.appendChild(el("td", {}, s.lag_seconds === undefined || s.lag_seconds === null ? "–" : s.lag_seconds.toFixed(1)));
      tr.appendChild(el("td", {}, s.reason));
      tr.appendChild(el("td", { class: "fix" }, text(s.fix)));
      body.appendChild(tr);
    }
    const extra = document.getElementById("extra");
    const d = r.dead_letters;
    const lines = ["dead letters: " + d.total + " total, " + d.recent + " in the last " + d.window_s + " s"];
    for (const role in r.processes) {
      const p = r.processes[role];
      lines.push(role + ": " + (p.running ? "running" : "not running") +
        (p.last_error ? " — last error: " + p.last_error.type + ": " + p.last_error.message : ""));
    }
    for (const s of r.snapshots) lines.push("snapshot " + s.table + ": " + s.state);
    if (r.slot_drop) lines.push("slot " + r.slot_drop.slot + " dropped at " + r.slot_drop.at + ": " + r.slot_drop.reason);
    extra.replaceChildren(...lines.map((l) => el("div", {}, l)));
  }

  function renderChart(samples) {
    const keys = [];
    for (const s of samples) for (const k in (s.stages || {})) {
      const st = s.stages[k];
      if (st.lag_seconds !== null && st.lag_seconds !== undefined && !keys.includes(k)) keys.push(k);
    }
    keys.sort();
    const xs = samples.map((s) => s.t_ms / 1000);
    const data = [xs].concat(keys.map((k) => samples.map((s) => {
      const st = (s.stages || {})[k];
      return st && st.lag_seconds !== null && st.lag_seconds !== undefined ? st.lag_seconds : null;
    })));
    const width = Math.max(400, document.getElementById("chart").clientWidth - 12);
    if (chart === null || chartKeys !== keys.join("|")) {
      if (chart !== null) chart.destroy();
      chartKeys = keys.join("|");
      chart = new uPlot({
        width: width, height: 300,
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        series: [{}].concat(keys.map((k, i) => ({
          label: k, stroke: palette[i % palette.length], width: 2, spanGaps: true,
          points: { show: true, size: 5 },
        }))),
        axes: [{}, { label: "seconds" }],
      }, data, document.getElementById("chart"));
      window.cdcChart = chart;
    } else {
      chart.setData(data);
    }
  }

  async function refresh() {
    try {
      const [st, hi] = await Promise.all([fetch("status" + q), fetch("history" + q)]);
      if (st.ok) renderStatus(await st.json());
      if (hi.ok) renderChart((await hi.json()).samples.filter((s) => s.stages));
      window.cdcUpdates += 1;
    } catch (e) {
      document.getElementById("meta").textContent = "cannot reach cdc serve: " + e;
    }
  }
  refresh();
  setInterval(refresh, 2000);
})();
