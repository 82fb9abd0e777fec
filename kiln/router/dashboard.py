"""The live dashboard: one self-contained HTML page (no external assets) that polls `/api/state`
every second and draws the workers in a table. The KV-usage bar is a solid fill on a solid track,
KV_BAR_PX wide, so that a screenshot can measure it (tests/router/test_router_server.py)."""

from __future__ import annotations

KV_BAR_PX = 120
KV_FILL = "#1b7f5c"
KV_TRACK = "#d5dbe3"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Kiln router</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2430; background: #fff; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 24px 0 8px; }
  #summary { color: #4a5565; margin-bottom: 16px; }
  #summary .bad { color: #b3261e; }
  table { border-collapse: collapse; }
  th, td { padding: 6px 10px; border-bottom: 1px solid #e6e9ee; text-align: left; white-space: nowrap; }
  th { font-weight: 600; color: #4a5565; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .bar { display: inline-block; vertical-align: middle; width: @BAR@px; height: 12px; background: @TRACK@; }
  .fill { display: block; height: 12px; background: @FILL@; }
  .pct { display: inline-block; width: 44px; text-align: right; margin-left: 6px; }
  .alive { color: #1b7f5c; } .dead, .evicted { color: #b3261e; font-weight: 600; }
  .labels { color: #4a5565; font-size: 12px; }
</style>
</head>
<body>
<h1>Kiln router</h1>
<div id="summary">loading&hellip;</div>
<table>
  <thead><tr>
    <th>worker</th><th>worker set</th><th>status</th><th>running</th><th>waiting</th><th>KV usage</th>
    <th>index blocks</th><th>recent prefix blocks</th><th>in flight</th><th>picks</th><th>predicted ms</th>
    <th>TTFT ms</th><th>E2E ms</th>
    <th>engine</th>
    <th>models</th>
    <th>labels</th>
  </tr></thead>
  <tbody id="workers"></tbody>
</table>
<h2 id="rollouts-title" hidden>Adapter rollouts</h2>
<table id="rollouts" hidden>
  <thead><tr>
    <th>rollout</th><th>adapter</th><th>version</th><th>status</th><th>stage</th><th>workers</th><th>last check</th>
  </tr></thead>
  <tbody></tbody>
</table>
<script>
const BAR_PX = @BAR@;
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}
function ms(v) { return v === null || v === undefined ? "" : v.toFixed(0); }
function calibration(w) {
  const c = w.calibration;
  if (!c) return "";
  if (!c.active) return `, uncalibrated (${c.observations} of ${c.min_observations} TTFTs)`;
  return `, calibrated: queue x${c.queue_scale.toFixed(2)}, prefill x${c.prefill_scale.toFixed(2)}, ` +
    `${c.batch_ms.toFixed(0)} ms per request in the batch, offset ${c.offset_ms.toFixed(0)} ms`;
}
function render(s) {
  const sets = s.worker_sets.map(w => `${w.name}: ${w.workers} workers, ${w.index_blocks} blocks` + calibration(w))
    .join("; ");
  const summary = document.getElementById("summary");
  summary.textContent = `${s.mode} mode, ${s.ready ? "ready" : "not ready"}; ${s.picks_total} picks; ` +
    `${s.inflight} in flight; ${sets}` +
    (s.workers.length < s.workers_total ? `; showing ${s.workers.length} of ${s.workers_total} workers` : "");
  if (!s.ready) summary.className = "bad"; else summary.className = "";
  const body = document.getElementById("workers");
  body.replaceChildren();
  for (const w of s.workers) {
    const row = document.createElement("tr");
    row.dataset.worker = w.worker;
    cell(row, w.worker);
    cell(row, w.workerset);
    const status = w.evicted ? "evicted" : (w.alive ? "alive" : "dead");
    cell(row, status, status).title = w.evicted_reason || "";
    cell(row, w.running, "num");
    cell(row, w.waiting, "num");
    const kv = cell(row, "");
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.width = Math.round(Math.min(1, Math.max(0, w.kv_usage)) * BAR_PX) + "px";
    bar.appendChild(fill);
    const pct = document.createElement("span");
    pct.className = "pct";
    pct.textContent = (w.kv_usage * 100).toFixed(0) + "%";
    kv.append(bar, pct);
    cell(row, w.index_blocks, "num");
    cell(row, w.recent_prefix_blocks, "num");
    cell(row, w.inflight, "num");
    cell(row, w.picks, "num");
    cell(row, ms(w.predicted_ms), "num");
    cell(row, ms(w.ttft_ms), "num");
    cell(row, ms(w.e2e_ms), "num");
    cell(row, w.engine);
    // adapters the worker lists but loads on a first request cost it a load in the prediction
    cell(row, w.models.map(m => w.adapters_unloaded.includes(m) ? `${m} (not loaded)` : m).join(", "), "labels");
    cell(row, Object.entries(w.labels).map(([k, v]) => `${k}=${v}`).join(" "), "labels");
    body.appendChild(row);
  }
  renderRollouts(s.rollouts || []);
}
function renderRollouts(rollouts) {
  const table = document.getElementById("rollouts");
  table.hidden = document.getElementById("rollouts-title").hidden = rollouts.length === 0;
  const body = table.querySelector("tbody");
  body.replaceChildren();
  for (const r of rollouts) {
    const row = document.createElement("tr");
    row.dataset.rollout = r.id;
    cell(row, r.id);
    cell(row, r.name);
    cell(row, r.version);
    cell(row, r.status, r.status === "rolled_back" || r.status === "failed" ? "dead" : "");
    const total = r.stage_workers[r.stage_workers.length - 1];
    cell(row, `${r.stage} of ${r.stages.length} (${r.stage_workers[Math.max(0, r.stage - 1)]} of ${total} workers)`);
    cell(row, r.targets.map(t => `${t.worker}: ${t.state}` + (t.previous ? ` (was ${t.previous})` : "")).join(", "),
      "labels");
    const last = r.checks[r.checks.length - 1];
    cell(row, r.reason || (last ? `stage ${last.stage} ${last.passed ? "passed" : "failed"}` : ""), "labels");
    body.appendChild(row);
  }
}
async function refresh() {
  try {
    const response = await fetch("/api/state", {cache: "no-store"});
    render(await response.json());
  } catch (e) {
    const summary = document.getElementById("summary");
    summary.textContent = "router state unavailable: " + e;
    summary.className = "bad";
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
"""
PAGE = PAGE.replace("@BAR@", str(KV_BAR_PX)).replace("@FILL@", KV_FILL).replace("@TRACK@", KV_TRACK)
