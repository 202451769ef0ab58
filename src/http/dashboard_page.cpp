// The dashboard page (http/dashboard.h), compiled in: HTML, CSS and one
// inline script, no third-party code. The loss curves are SVG polylines
// drawn here, one point per recorded forward_backward.
namespace loom::http {

extern const char* const kDashboardHtml;
const char* const kDashboardHtml = R"LOOMPAGE(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>loom dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1c2330}
header{background:#1c2330;color:#fff;padding:10px 20px;display:flex;gap:16px;align-items:center}
header h1{font-size:18px;margin:0}
main{padding:16px 20px;display:grid;gap:16px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px 16px}
h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eef0f3;font-variant-numeric:tabular-nums}
th{color:#5a6475;font-weight:600}
.curves{display:flex;flex-wrap:wrap;gap:16px}
.curve{font-size:12px}
svg.loss{background:#fbfcfd;border:1px solid #dde1e7}
svg.loss polyline{fill:none;stroke:#2f6fdb;stroke-width:2}
svg.loss text{font-size:10px;fill:#5a6475}
#error{color:#b3261e}
form{display:flex;gap:8px}
input{font:inherit;padding:4px 6px;width:28em}
</style></head>
<body>
<header><h1>loom</h1><span id="who"></span><span id="status" data-state="idle"></span></header>
<main>
<section id="login" hidden><h2>API key</h2>
<form id="keyform"><input id="keyinput" type="password" autocomplete="off" placeholder="X-API-Key">
<button>Open</button></form>
<p>The key stays in this tab (sessionStorage) and is sent only as the X-API-Key header.</p></section>
<div id="error"></div>
<div id="view"></div>
</main>
<script>
"use strict";
const KEY = "loom.api_key";
(function takeKeyFromFragment() {
  const m = /^#key=(.+)$/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);  // the key leaves the address bar
  }
})();

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function table(id, columns, rows) {
  const t = el("table", {id});
  t.append(el("tr", {}, ...columns.map(c => el("th", {}, c[0]))));
  for (const r of rows) t.append(el("tr", {}, ...columns.map(c => el("td", {}, c[1](r)))));
  return t;
}
function section(title, ...children) { return el("section", {}, el("h2", {}, title), ...children); }
function num(x, digits) { return typeof x === "number" ? (digits === undefined ? x : x.toFixed(digits)) : "-"; }

async function get(path) {
  const r = await fetch(path, {headers: {"X-API-Key": sessionStorage.getItem(KEY) || ""}, cache: "no-store"});
  const body = await r.json();
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (body.error || body.detail || ""));
  return body;
}

const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
// One model's loss curve: x = request number, y = mean loss per scored token.
function lossCurve(model) {
  const W = 420, H = 180, P = 32, pts = model.passes;
  const s = svg("svg", {class: "loss", width: W, height: H, "data-model": model.model_id, viewBox: `0 0 ${W} ${H}`});
  const ys = pts.map(p => p.loss_mean);
  const lo = Math.min(...ys), hi = Math.max(...ys);
  const x0 = pts.length ? pts[0].index : 0, x1 = pts.length ? pts[pts.length - 1].index : 1;
  const X = i => P + (x1 > x0 ? (i - x0) / (x1 - x0) : 0.5) * (W - 2 * P);
  const Y = v => H - P + (hi > lo ? -(v - lo) / (hi - lo) : -0.5) * (H - 2 * P);
  s.append(svg("line", {x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#c4cad3"}));
  s.append(svg("line", {x1: P, y1: P, x2: P, y2: H - P, stroke: "#c4cad3"}));
  const line = svg("polyline", {points: pts.map(p => `${X(p.index).toFixed(1)},${Y(p.loss_mean).toFixed(1)}`).join(" "),
                                "data-points": pts.length});
  s.append(line);
  const label = (x, y, t) => { const e = svg("text", {x, y}); e.textContent = t; s.append(e); };
  if (pts.length) {
    label(2, P, hi.toPrecision(3)); label(2, H - P, lo.toPrecision(3));
    label(P, H - 8, "#" + x0); label(W - P - 20, H - 8, "#" + x1);
  }
  return el("div", {class: "curve"}, el("div", {}, model.model_id + " - mean loss per token, " + pts.length +
                                              " forward_backward"), s);
}

function tenantView(d, usage, ckpts) {
  const v = document.getElementById("view");
  v.replaceChildren(
    section("Models", table("models", [["model", m => m.model_id], ["base model", m => m.base_model],
                                       ["rank", m => m.rank], ["queue state", m => m.queue_state],
                                       ["queued", m => m.queued], ["forward_backward kept", m => m.passes.length]],
                            d.models)),
    section("Loss (last " + d.history_limit + " forward_backward per model)",
            el("div", {class: "curves"}, ...d.models.map(lossCurve))),
    section("Recent passes", table("passes", [["model", p => p.model_id], ["#", p => p.index],
                                              ["loss:sum", p => num(p.loss_sum, 4)], ["tokens", p => p.tokens],
                                              ["mean", p => num(p.loss_mean, 4)],
                                              ["finished", p => new Date(p.at_ms).toISOString()]],
            d.models.flatMap(m => m.passes.slice(-10).map(p => Object.assign({model_id: m.model_id}, p)))
                    .sort((a, b) => b.at_ms - a.at_ms).slice(0, 20))),
    section("Checkpoints", table("checkpoints", [["path", c => c.tinker_path], ["type", c => c.checkpoint_type],
                                                 ["time", c => c.time], ["bytes", c => num(c.size_bytes)]],
                                 ckpts.checkpoints || [])),
    section("Usage", usageTable([usage])));
}
function usageTable(rows) {
  return table("usage", [["tenant", u => u.tenant], ["tokens trained", u => u.tokens_trained],
                         ["tokens sampled", u => u.tokens_sampled], ["passes", u => u.passes],
                         ["slot-seconds", u => num(u.slot_seconds, 1)], ["live models", u => u.live_models],
                         ["waiting", u => u.waiting_models], ["checkpoints", u => u.checkpoints],
                         ["bytes stored", u => u.bytes_stored]], rows);
}
function adminView(d) {
  const f = d.pass_fill, s = d.sampler;
  const kv = (rows) => table(null, [["", r => r[0]], ["", r => r[1]]], rows);
  document.getElementById("view").replaceChildren(
    section("Slots", kv([["in use", d.slots.in_use + " / " + d.slots.total],
                         ["create_model waiting for a slot", d.capacity_waiters]])),
    section("Pass fill", kv([["forward(_backward) passes", f.passes],
                             ["last pass", f.last_tokens + " / " + f.token_budget + " tokens (" +
                                           (100 * f.last_ratio).toFixed(1) + "%)"],
                             ["mean fill", (100 * f.mean_ratio).toFixed(1) + "%"]])),
    section("Sampler", s.attached ? kv([["requests waiting", s.requests_waiting], ["requests done", s.requests_done],
                                        ["KV blocks free", s.kv_blocks_free], ["of which cached", s.kv_blocks_cached]])
                                  : el("p", {}, "no sampler attached")),
    section("Queued requests by model", kv(Object.entries(d.queued_by_model))),
    section("Tenants", usageTable(d.tenants)));
}

async function load() {
  const status = document.getElementById("status");
  if (!sessionStorage.getItem(KEY)) { document.getElementById("login").hidden = false; return; }
  status.dataset.state = "loading";
  try {
    const d = await get("/api/v1/dashboard");
    document.getElementById("who").textContent = d.view === "admin" ? "admin" : "tenant " + d.tenant;
    if (d.view === "admin") {
      adminView(d);
    } else {
      const [usage, ckpts] = await Promise.all([get("/api/v1/usage"), get("/api/v1/checkpoints")]);
      tenantView(d, usage, ckpts);
    }
    document.getElementById("error").textContent = "";
    status.dataset.state = "loaded";
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("error").textContent = e.message;
    status.dataset.state = "error";
  }
  setTimeout(load, 5000);
}
document.getElementById("keyform").addEventListener("submit", e => {
  e.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("keyinput").value);
  document.getElementById("login").hidden = true;
  load();
});
load();
</script>
</body></html>
)LOOMPAGE";

}  // namespace loom::http
