#include "dashboard.h"

namespace baton::serve {

std::string_view dashboard_html() {
  return R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>baton-serve</title>
<style>
body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#666;margin-bottom:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
.card h2{font-size:13px;margin:0 0 6px;color:#444;font-weight:600}
.now{font-size:20px;font-weight:600} svg{width:100%;height:90px;display:block}
table{border-collapse:collapse} td,th{padding:2px 10px 2px 0;text-align:right} th{text-align:left;color:#555}
#err{color:#b00020;margin:8px 0} #key{display:none;margin:8px 0}
</style></head><body>
<h1>baton-serve <span id="model"></span></h1>
<div class="sub" id="sub">connecting...</div>
<div id="key">API key: <input id="keyin" type="password" size="40"> <button id="keygo">watch</button></div>
<div id="err"></div>
<div class="grid">
 <div class="card"><h2>batch: requests running</h2><div class="now" id="n-running"></div><svg id="c-running"></svg></div>
 <div class="card"><h2>queue: requests waiting</h2><div class="now" id="n-waiting"></div><svg id="c-waiting"></svg></div>
 <div class="card"><h2>KV cache used (%)</h2><div class="now" id="n-kv"></div><svg id="c-kv"></svg></div>
 <div class="card"><h2>engine busy (% of wall time in decode steps)</h2><div class="now" id="n-busy"></div><svg id="c-busy"></svg></div>
 <div class="card"><h2>stages busy (% of wall time in their part of the steps)</h2><div class="now" id="n-stages"></div><svg id="c-stages"></svg></div>
 <div class="card"><h2>output tokens/s</h2><div class="now" id="n-tps"></div><svg id="c-tps"></svg></div>
 <div class="card"><h2>latency of recent requests</h2>
  <table><tr><th></th><th>p50</th><th>p99</th></tr>
  <tr><th>TTFT</th><td id="ttft50"></td><td id="ttft99"></td></tr>
  <tr><th>TPOT</th><td id="tpot50"></td><td id="tpot99"></td></tr></table>
  <div class="sub" id="recent"></div></div>
</div>
<script>
"use strict";
const N = 300, series = {running: [], waiting: [], kv: [], busy: [], tps: []}, stages = [];
const colors = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
let key = new URLSearchParams(location.hash.slice(1)).get("key") || sessionStorage.getItem("baton-serve-key") || "";
let last = null;
function ms(s) { return s > 0 ? (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms" : "-"; }
function draw(id, values) {
  const svg = document.getElementById(id), w = 320, h = 90;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const max = Math.max(1e-9, ...values);
  const span = Math.min(N, Math.max(values.length, 60)) - 1;  // the first minute fills the width
  const pts = values.map((v, i) => `${(i / span * w).toFixed(1)},${(h - 4 - v / max * (h - 12)).toFixed(1)}`);
  svg.innerHTML = `<text x="2" y="10" font-size="9" fill="#888">max ${+max.toPrecision(3)}</text>` +
    `<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="${pts.join(" ")}"/>`;
}
// Several series on one chart (a stage each), one scale.
function draw_many(id, all) {
  const svg = document.getElementById(id), w = 320, h = 90;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const max = Math.max(1e-9, ...all.flat());
  const span = Math.min(N, Math.max(...all.map(v => v.length), 60)) - 1;
  svg.innerHTML = `<text x="2" y="10" font-size="9" fill="#888">max ${+max.toPrecision(3)}</text>` + all.map((values, k) =>
    `<polyline fill="none" stroke="${colors[k % colors.length]}" stroke-width="1.5" points="${values.map((v, i) =>
      `${(i / span * w).toFixed(1)},${(h - 4 - v / max * (h - 12)).toFixed(1)}`).join(" ")}"/>`).join("");
}
function push(name, v) { const s = series[name]; s.push(v); if (s.length > N) s.shift(); }
async function poll() {
  if (!key) { document.getElementById("key").style.display = "block"; return; }
  try {
    const r = await fetch("/api/serve", {headers: {Authorization: "Bearer " + key}});
    if (r.status === 401) { key = ""; sessionStorage.removeItem("baton-serve-key"); document.getElementById("err").textContent = "that key was refused"; return poll(); }
    const s = await r.json(), t = performance.now() / 1000;
    document.getElementById("err").textContent = s.failure ? "the engine failed: " + s.failure : "";
    document.getElementById("model").textContent = s.model;
    document.getElementById("sub").textContent = `weights: ${s.weights}${s.swapping ? " (new weights waiting for the batch to end)" : ""}` +
      `${s.draining ? "; draining" : ""}; context ${s.context} tokens; KV cache ${s.kv_cache_tokens} tokens; ${s.steps} steps`;
    let busy = 0, tps = 0;
    const sb = s.stage_busy_seconds || [];
    if (last) {
      const dt = t - last.t; busy = 100 * (s.busy_seconds - last.busy) / dt; tps = (s.generated_tokens - last.gen) / dt;
      sb.forEach((b, k) => { if (!stages[k]) stages[k] = []; stages[k].push(100 * (b - (last.stages[k] || 0)) / dt); if (stages[k].length > N) stages[k].shift(); });
      draw_many("c-stages", stages);
      document.getElementById("n-stages").textContent = stages.map((v, k) => `stage ${k}: ${v[v.length - 1].toFixed(0)}%`).join(", ");
    }
    last = {t, busy: s.busy_seconds, gen: s.generated_tokens, stages: sb};
    const now = {running: s.running, waiting: s.waiting, kv: 100 * s.kv_cache_usage, busy, tps};
    for (const [k, v] of Object.entries(now)) { push(k, v); draw("c-" + k, series[k]); document.getElementById("n-" + k).textContent = +v.toFixed(1); }
    document.getElementById("ttft50").textContent = ms(s.ttft_p50_s); document.getElementById("ttft99").textContent = ms(s.ttft_p99_s);
    document.getElementById("tpot50").textContent = ms(s.tpot_p50_s); document.getElementById("tpot99").textContent = ms(s.tpot_p99_s);
    document.getElementById("recent").textContent = `over the last ${s.requests_recent} finished requests`;
  } catch (e) { document.getElementById("err").textContent = "no answer from the server: " + e; }
  setTimeout(poll, 1000);
}
document.getElementById("keygo").onclick = () => {
  key = document.getElementById("keyin").value.trim(); sessionStorage.setItem("baton-serve-key", key);
  document.getElementById("key").style.display = "none"; poll();
};
if (key) sessionStorage.setItem("baton-serve-key", key);
poll();
</script></body></html>
)HTML";
}

}  // namespace baton::serve
