// gpusched dashboard: plain JS, no build step. The page loads the whole model once
// (GET /api/state, with its version), then the server pushes only what changed over Server-Sent
// Events (/api/events?since=VERSION: `delta` events keyed by version; see
// services/dashboard/delta.py). A delta for another version than the one held means one was
// missed: the page refetches the whole model. Controls POST to /api/*.
"use strict";

const HUES = [205, 330, 140, 38, 265, 8, 175, 88, 300, 55];
const KEYED = {nodes: "node", running: "job_id", finished: "job_id", queue: "job_id"};
const SERIES = {tail: ["seq", 120], shares: ["at", 1200]};
const STATE_COLORS = {held: "#4f7fd6", free: "#222a33", idle: "#d4a72c", quarantined: "#c0443e", zombie: "#c0443e",
  lost: "#101317", drained: "#5b6470", partitioned: "#7a4fd6", shared: "#3fa7a0",
  sliced: "#b05fc4", mig: "#4a3a55"};
const $ = (id) => document.getElementById(id);
let model = null;
let teamIndex = {};
let gpuIndex = {};     // gpu id -> its document, with node and rack
let cells = {};        // gpu id -> its cell element
let jobIndex = {};
let layoutKey = "";    // the racks, nodes and GPUs the cluster view was built for
const filter = {q: "", team: "", state: ""};
let colorBy = "team";
const stats = {loads: 0, fullRenderMs: 0, deltas: 0, lastDeltaMs: 0, lastDeltaBytes: 0, fullBytes: 0, refetches: 0};
window.gpuschedStats = stats;  // what the browser test and bench/bench_dashboard.py read
const explained = {};  // job id -> {seq, data}: explanations fetched on hover

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function hash(s) { let h = 0; for (const c of s) h = (h * 31 + c.charCodeAt(0)) | 0; return Math.abs(h); }
function teamHue(team) { return HUES[(teamIndex[team] ?? hash(team)) % HUES.length]; }
function teamColor(team, light = 55) { return `hsl(${teamHue(team)} 62% ${light}%)`; }
function jobColor(team, job) { return teamColor(team, 40 + (hash(job) % 5) * 6); }
// rack2 < rack10 < rack100, as readmodel.natural_key orders them
const collator = new Intl.Collator(undefined, {numeric: true});
const natural = (a, b) => collator.compare(a, b);
// Ages against the wall clock on a live cluster, against the log's time when it is old.
function nowSec() {
  const wall = Date.now() / 1000;
  if (!model) return wall;
  return Math.abs(wall - model.now) < 86400 ? Math.max(wall, model.now) : model.now;
}
function dur(s) {
  if (s == null) return "–";
  s = Math.max(0, s);
  if (s < 60) return s < 10 ? s.toFixed(1) + "s" : s.toFixed(0) + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  return (s / 3600).toFixed(1) + "h";
}
// A job's GPU-hours held and busy as of the log's time (readmodel.accounting): a job document is
// resent only when it changes, so what its GPUs accrued since is extrapolated here.
function accounted(doc) {
  const g = doc && doc.gpu_s;
  if (!g || !model) return doc;
  const dt = Math.max(0, model.now - g.at);
  const held = g.held + g.gpus * dt, busy = g.busy + (g.gpus - g.idle_gpus) * dt;
  return {...doc, gpu_hours_held: held / 3600, gpu_hours_busy: busy / 3600, efficiency: held > 0 ? busy / held : null};
}

// --- the model: whole, then deltas ----------------------------------------------------------

function applyDelta(m, d) {
  const out = {...m};
  for (const [k, v] of Object.entries(d)) if (!(k in KEYED) && !(k in SERIES) && k !== "kind" && k !== "base") out[k] = v;
  const changedNodes = [];
  for (const [section, key] of Object.entries(KEYED)) {
    const ch = d[section];
    if (!ch) continue;
    const docs = new Map(m[section].map((doc) => [doc[key], doc]));
    for (const gone of ch.del || []) docs.delete(gone);
    for (const doc of ch.set || []) { docs.set(doc[key], doc); if (section === "nodes") changedNodes.push(doc.node); }
    if (section === "nodes" && (ch.del || []).length) changedNodes.push(...ch.del);
    const order = ch.order ? ch.order.filter((k) => docs.has(k)) : m[section].map((doc) => doc[key]).filter((k) => docs.has(k));
    const placed = new Set(order);
    for (const k of docs.keys()) if (!placed.has(k)) order.push(k);
    out[section] = order.map((k) => docs.get(k));
  }
  if (d.nodes) out.nodes.sort((a, b) => natural(a.node, b.node));
  if (d.finished) out.finished.sort((a, b) => (b.finished_at || 0) - (a.finished_at || 0));
  for (const [section, [field, keep]] of Object.entries(SERIES)) {
    if (!d[section]) continue;
    const points = m[section].slice();
    for (const p of d[section]) {
      if (points.length && p[field] === points[points.length - 1][field]) points[points.length - 1] = p;
      else if (!points.length || p[field] > points[points.length - 1][field]) points.push(p);
    }
    out[section] = points.slice(-keep);
  }
  return [out, changedNodes];
}

// Deltas that arrive while the whole model is being refetched wait for it, then apply in order.
let refetching = null;
let waiting = [];
function refetch() {
  if (!refetching) {
    stats.refetches += 1;
    refetching = loadFull().catch(() => null).finally(() => {
      refetching = null;
      const queued = waiting;
      waiting = [];
      for (const text of queued) onDelta(text);
    });
  }
  return refetching;
}

async function loadFull() {
  const r = await fetch("/api/state");
  if (!r.ok) throw new Error(`HTTP ${r.status}`);
  const text = await r.text();
  stats.fullBytes = text.length;
  const m = JSON.parse(text);
  if (!model || m.version >= model.version) showFull(m);
  return m;
}

function showFull(m) {
  const t0 = performance.now();
  model = m;
  render(m, null);
  stats.loads += 1;
  stats.fullRenderMs = performance.now() - t0;
}

function onDelta(text) {
  if (!model) return;
  if (refetching) { waiting.push(text); return; }
  const d = JSON.parse(text);
  if (d.version <= model.version) return;  // already held (a refetch overtook it)
  if (d.base !== model.version) { refetch(); return; }  // a version was missed
  const t0 = performance.now();
  const [m, changedNodes] = applyDelta(model, d);
  model = m;
  render(m, changedNodes);
  stats.deltas += 1;
  stats.lastDeltaBytes = text.length;
  stats.lastDeltaMs = performance.now() - t0;
}

// --- rendering ---------------------------------------------------------------------------

function render(m, changedNodes) {
  teamIndex = {};
  m.teams.forEach((t, i) => { teamIndex[t.team] = i; });
  jobIndex = {};
  for (const j of m.running) jobIndex[j.job_id] = j;
  for (const q of m.queue) jobIndex[q.job_id] = jobIndex[q.job_id] || {...q, state: "pending"};
  for (const j of m.finished) jobIndex[j.job_id] = jobIndex[j.job_id] || j;
  renderHealth(m);
  renderCluster(m, changedNodes);
  renderTeams(m);
  renderTeamOptions(m);
  renderQueue(m);
  renderTail(m);
  document.body.dataset.seq = String(m.seq);
  document.body.dataset.version = String(m.version);
}

function renderHealth(m) {
  const h = m.health;
  const pb = $("placement-badge");
  const lease = h.lease || {};
  let state = h.placement_degraded ? "degraded" : "ok";
  let text = h.placement_degraded ? "placement DEGRADED · naive fallback" : "placement topology-aware";
  if (!h.placement_degraded && lease.reachable && lease.placement === null) { state = "down"; text = "placement down (lease lapsed)"; }
  pb.dataset.state = state;
  pb.textContent = text;
  pb.title = lease.placement ? "lease held by " + lease.placement : "";
  $("gpus-badge").textContent = `GPUs ${h.gpus.held}/${h.gpus.total} held · ${h.gpus.free} free` +
    (h.gpus.unavailable ? ` · ${h.gpus.unavailable} down` : "");
  $("jobs-badge").textContent = `jobs ${h.jobs.running + h.jobs.starting} running · ${h.jobs.pending} pending · ${h.jobs.completed} done`;
  $("seq-badge").textContent = `log seq ${m.seq}` + (h.violations ? ` · ${h.violations} VIOLATIONS` : "");
}

// The cluster view: one cell per GPU, nodes grouped in racks (natural order), built once per
// layout and then updated cell by cell; its cell size shrinks until the view fits the screen.
function racksOf(nodes) {
  const racks = new Map();
  for (const n of nodes) { if (!racks.has(n.rack)) racks.set(n.rack, []); racks.get(n.rack).push(n); }
  return [...racks.entries()].sort((a, b) => natural(a[0], b[0]));
}

function cellAttrs(g) {
  const style = colorBy === "team" && g.status === "held" && g.team ? ` style="background:${jobColor(g.team, g.job_id)}"` : "";
  return `data-gpu="${esc(g.gpu)}" data-status="${g.status}"` + (g.idle ? ` data-idle="1"` : "") +
    (g.job_id ? ` data-job="${esc(g.job_id)}" data-team="${esc(g.team)}"` : "") + style;
}

// A node in a declared partition keeps its jobs (not requeued) and gets no new work: not lost.
function nodeClass(n) {
  return n.lost ? "node lost" : n.partitioned ? "node partitioned" : n.drained ? "node drained" : "node";
}

function nodeHtml(n) {
  const cls = nodeClass(n);
  const parts = [`<div class="${cls}" data-node="${esc(n.node)}"><span class="name" title="${n.free}/${n.total} free${n.partitioned ? " · partitioned: its jobs kept, no new work" : ""}">${esc(n.node)}</span><span class="gpus">`];
  let dom = null;
  for (const g of n.gpus) {
    if (g.nvlink_domain !== dom) {
      if (dom !== null) parts.push("</span>");
      parts.push(`<span class="dom">`);
      dom = g.nvlink_domain;
    }
    parts.push(`<span class="gpu" ${cellAttrs(g)}></span>`);
  }
  if (dom !== null) parts.push("</span>");
  parts.push("</span></div>");
  return parts.join("");
}

function indexNode(n) {
  for (const g of n.gpus) gpuIndex[g.gpu] = {...g, node: n.node, rack: n.rack};
}

function buildCluster(m) {
  const parts = [];
  gpuIndex = {};
  for (const [rack, nodes] of racksOf(m.nodes)) {
    parts.push(`<div class="rack" data-rack="${esc(rack)}"><h3>${esc(rack)}</h3><div class="rnodes" style="grid-template-rows:repeat(${Math.min(nodes.length, 8)},auto)">`);
    for (const n of nodes) { indexNode(n); parts.push(nodeHtml(n)); }
    parts.push(`</div></div>`);
  }
  const el = $("cluster");
  el.innerHTML = parts.join("") || `<p class="dim">no nodes registered yet</p>`;
  cells = {};
  for (const c of el.querySelectorAll(".gpu")) cells[c.dataset.gpu] = c;
  fitCluster();
}

function layoutOf(m) {
  return m.nodes.map((n) => `${n.rack}/${n.node}/${n.gpus.length}`).join(",");
}

function updateNode(n) {
  indexNode(n);
  const el = document.querySelector(`.node[data-node="${CSS.escape(n.node)}"]`);
  if (!el) return;
  el.className = nodeClass(n);
  el.querySelector(".name").title = `${n.free}/${n.total} free${n.partitioned ? " · partitioned: its jobs kept, no new work" : ""}`;
  for (const g of n.gpus) {
    const c = cells[g.gpu];
    if (!c) continue;
    c.dataset.status = g.status;
    if (g.idle) c.dataset.idle = "1"; else delete c.dataset.idle;
    if (g.job_id) { c.dataset.job = g.job_id; c.dataset.team = g.team; } else { delete c.dataset.job; delete c.dataset.team; }
    c.style.background = colorBy === "team" && g.status === "held" && g.team ? jobColor(g.team, g.job_id) : "";
    matchCell(c);
  }
}

function renderCluster(m, changedNodes) {
  const key = layoutOf(m);
  if (changedNodes === null || key !== layoutKey) {
    layoutKey = key;
    buildCluster(m);
    applyFilter();
  } else if (changedNodes.length) {
    const byName = new Map(m.nodes.map((n) => [n.node, n]));
    for (const name of changedNodes) if (byName.has(name)) updateNode(byName.get(name));
    countMatches();
  }
  const total = m.health.gpus.total;
  $("cluster-summary").textContent = `${racksOf(m.nodes).length} rack(s), ${m.nodes.length} node(s), ${total} GPUs`;
  renderLegend(m);
}

function renderLegend(m) {
  const sw = (bg, label, extra = "") => `<span><span class="sw${extra}" style="background:${bg}"></span>${esc(label)}</span>`;
  if (colorBy === "state") {
    $("legend").innerHTML = Object.entries(STATE_COLORS).filter(([s]) => s !== "zombie").map(([s, c]) => sw(c, s === "quarantined" ? "quarantined / zombie" : s === "idle" ? "held but idle" : s)).join("");
    return;
  }
  $("legend").innerHTML = m.teams.map((t) => sw(teamColor(t.team), t.team)).join("") +
    `<span><span class="sw" style="background:var(--free);border:1px solid #2d3641"></span>free</span>` +
    `<span><span class="sw" style="background:#5a2422"></span>quarantined / zombie</span>` +
    `<span><span class="sw idle"></span>held but idle</span>`;
}

// Shrink the cells until the cluster view fits the screen below its top (8,000 GPUs fit 1080 px).
function fitCluster() {
  const el = $("cluster");
  const total = Object.keys(cells).length;
  if (!total) return;
  const avail = Math.max(200, window.innerHeight - el.getBoundingClientRect().top - window.scrollY + window.scrollY - 24);
  const width = Math.max(200, el.clientWidth);
  let size = total <= 512 ? 20 : Math.max(3, Math.min(20, Math.floor(Math.sqrt((width * avail) / (total * 2.6))) - 1));
  const apply = () => {
    el.style.setProperty("--cell", size + "px");
    el.classList.toggle("dense", size < 12);
  };
  apply();
  while (size > 3 && el.scrollHeight > avail) { size -= 1; apply(); }
  el.dataset.cell = String(size);
}
window.addEventListener("resize", () => { clearTimeout(fitCluster.timer); fitCluster.timer = setTimeout(fitCluster, 150); });

// --- search and filter ------------------------------------------------------------------------

function matches(g) {
  if (filter.team && g.team !== filter.team) return false;
  if (filter.state && (filter.state === "idle" ? !g.idle : g.status !== filter.state)) return false;
  if (filter.q) {
    const q = filter.q;
    return g.node.toLowerCase().includes(q) || g.rack.toLowerCase().includes(q) ||
      (g.job_id || "").toLowerCase().includes(q) || (g.team || "").toLowerCase().includes(q);
  }
  return true;
}
const filtering = () => Boolean(filter.q || filter.team || filter.state);

function matchCell(c) {
  const g = gpuIndex[c.dataset.gpu];
  c.classList.toggle("off", Boolean(g) && filtering() && !matches(g));
}

function countMatches() {
  const total = Object.keys(cells).length;
  const off = filtering() ? $("cluster").querySelectorAll(".gpu.off").length : 0;
  $("filter-count").textContent = filtering() ? `${total - off} of ${total} GPUs match` : "";
  $("cluster").dataset.matching = String(total - off);
}

function applyFilter() {
  $("cluster").classList.toggle("filtering", filtering());
  for (const c of Object.values(cells)) matchCell(c);
  countMatches();
  if (model) renderQueue(model);
}

function jobMatches(j) {
  if (filter.team && j.team !== filter.team) return false;
  if (filter.q && !(j.job_id.toLowerCase().includes(filter.q) || (j.team || "").toLowerCase().includes(filter.q))) return false;
  return !filter.state || filter.state === "pending";
}

function renderTeamOptions(m) {
  const sel = $("filter-team");
  const want = ["", ...m.teams.map((t) => t.team)];
  if (filter.team && !want.includes(filter.team)) want.push(filter.team);
  const have = [...sel.options].map((o) => o.value);
  if (have.join("\n") === want.join("\n")) return;
  sel.innerHTML = want.map((t) => `<option value="${esc(t)}">${t ? esc(t) : "all teams"}</option>`).join("");
  sel.value = filter.team;
}

function readFilter() {
  filter.q = $("filter-q").value.trim().toLowerCase();
  filter.team = $("filter-team").value;
  filter.state = $("filter-state").value;
  const h = new URLSearchParams();
  for (const [k, v] of Object.entries(filter)) if (v) h.set(k, v);
  if (colorBy !== "team") h.set("color", colorBy);
  history.replaceState(null, "", h.toString() ? "#" + h.toString() : location.pathname);
  applyFilter();
}

function restoreFilter() {
  const h = new URLSearchParams(location.hash.slice(1));
  $("filter-q").value = h.get("q") || "";
  const team = h.get("team") || "";
  if (team) $("filter-team").innerHTML += `<option value="${esc(team)}">${esc(team)}</option>`;
  $("filter-team").value = team;
  $("filter-state").value = h.get("state") || "";
  colorBy = h.get("color") === "state" ? "state" : "team";
  $("color-by").value = colorBy;
  $("cluster").classList.toggle("by-state", colorBy === "state");
  filter.q = $("filter-q").value.trim().toLowerCase();
  filter.team = team;
  filter.state = $("filter-state").value;
}

$("filter-q").addEventListener("input", readFilter);
$("filter-team").addEventListener("change", readFilter);
$("filter-state").addEventListener("change", readFilter);
$("color-by").addEventListener("change", () => {
  colorBy = $("color-by").value;
  $("cluster").classList.toggle("by-state", colorBy === "state");
  if (model) { layoutKey = ""; renderCluster(model, null); }
  readFilter();
});
$("filter-clear").addEventListener("click", () => {
  $("filter-q").value = ""; $("filter-team").value = ""; $("filter-state").value = "";
  readFilter();
});
// a click on a GPU narrows the view to its job (or, when free, its node)
$("cluster").addEventListener("click", (ev) => {
  const c = ev.target.closest ? ev.target.closest(".gpu") : null;
  if (!c) return;
  const g = gpuIndex[c.dataset.gpu];
  $("filter-q").value = g && g.job_id ? g.job_id : (g ? g.node : "");
  readFilter();
});

// "H100 2/8≤16  A100 0/32": held / guaranteed (≤ per-model limit) per GPU pool (docs/gpu-pools.md)
function poolText(pools) {
  return Object.entries(pools || {}).map(([p, r]) => `${p} ${r.held}/${r.guaranteed}${r.limit == null ? "" : "≤" + r.limit}`).join("  ");
}

function renderTeams(m) {
  const pooled = m.teams.some((t) => t.pools && Object.keys(t.pools).length);
  const rows = [`<tr><th>team</th><th class="num">held</th><th class="num">guar.</th><th class="num">limit</th><th>share vs guarantee</th><th class="num">queued</th><th class="num" title="GPU-hours held / busy; efficiency = busy / held">GPU-h (eff.)</th>` +
    (pooled ? `<th title="per GPU model: held / guaranteed (≤ limit)">pools</th>` : "") + `</tr>`];
  const total = Math.max(1, m.health.gpus.total);
  for (const t of m.teams) {
    const pct = Math.min(100, (t.held / total) * 100);
    const g = Math.min(100, (t.guaranteed / total) * 100);
    rows.push(`<tr data-team="${esc(t.team)}"><td><span class="sw" style="display:inline-block;width:9px;height:9px;border-radius:2px;background:${teamColor(t.team)}"></span> ${esc(t.team)}</td>` +
      `<td class="num">${t.held}</td><td class="num">${t.guaranteed}</td><td class="num">${t.limit ?? "–"}</td>` +
      `<td><div class="bar" title="${(t.share * 100).toFixed(0)}% held, ${(t.entitled_share * 100).toFixed(0)}% guaranteed"><span style="width:${pct}%;background:${teamColor(t.team)}"></span><i style="left:${g}%"></i></div></td>` +
      `<td class="num">${t.pending_jobs}</td>` +
      `<td class="num${t.idle_gpus ? " idle-text" : ""}" title="${t.idle_gpus} GPU(s) idle now">${Number(t.gpu_hours_held || 0).toFixed(2)}/${Number(t.gpu_hours_busy || 0).toFixed(2)}` +
      `${t.efficiency == null ? "" : " (" + (t.efficiency * 100).toFixed(0) + "%)"}</td>` +
      (pooled ? `<td>${esc(poolText(t.pools))}</td>` : "") + `</tr>`);
  }
  $("teams").innerHTML = rows.join("");
  renderShares(m);
}

function renderShares(m) {
  const svg = $("shares");
  const W = 520, H = 170, pad = 22;
  const pts = m.shares;
  if (!pts.length) { svg.innerHTML = `<text x="10" y="20">no usage yet</text>`; return; }
  const t1 = Math.max(nowSec(), pts[pts.length - 1].at);
  const t0 = Math.min(pts[0].at, t1 - 10);
  let ymax = 1;
  for (const p of pts) for (const v of Object.values(p.teams)) ymax = Math.max(ymax, v);
  for (const t of m.teams) ymax = Math.max(ymax, t.guaranteed);
  ymax = Math.ceil(ymax * 1.1);
  const x = (t) => pad + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - pad - 6);
  const y = (v) => H - 14 - (v / ymax) * (H - 24);
  const out = [];
  out.push(`<line x1="${pad}" y1="${y(0)}" x2="${W - 6}" y2="${y(0)}" stroke="#2d3641"/>`);
  out.push(`<text x="2" y="${y(ymax) + 8}">${ymax}</text><text x="2" y="${y(0)}">0</text>`);
  out.push(`<text x="${W - 70}" y="${H - 2}">last ${dur(t1 - t0)}</text>`);
  for (const t of m.teams) {
    const c = teamColor(t.team);
    if (t.guaranteed > 0) out.push(`<line x1="${pad}" x2="${W - 6}" y1="${y(t.guaranteed)}" y2="${y(t.guaranteed)}" stroke="${c}" stroke-dasharray="4 4" opacity=".7"/>`);
    let d = "";
    let prev = null;
    for (const p of pts) {
      const v = p.teams[t.team] ?? 0;
      if (prev === null) d += `M${x(p.at).toFixed(1)},${y(v).toFixed(1)}`;
      else d += `H${x(p.at).toFixed(1)}V${y(v).toFixed(1)}`;
      prev = v;
    }
    d += `H${x(t1).toFixed(1)}`;
    out.push(`<path d="${d}" fill="none" stroke="${c}" stroke-width="2"/>`);
  }
  svg.innerHTML = out.join("");
}

function renderQueue(m) {
  $("queue-count").textContent = m.queue_len ? `${m.queue_len} waiting, in policy order` + (filtering() ? " (filtered)" : "") : "empty";
  m.queue.forEach((q, i) => { q.position = i + 1; });
  const rows = [`<tr><th>#</th><th>job</th><th>team</th><th>prio</th><th class="num">GPUs</th><th class="num">wait</th><th>reason</th></tr>`];
  for (const q of m.queue) {
    if (filtering() && !jobMatches(q)) continue;
    rows.push(`<tr data-job="${esc(q.job_id)}"><td class="num">${q.position}</td><td>${esc(q.job_id)}</td>` +
      `<td style="color:${teamColor(q.team, 68)}">${esc(q.team)}</td><td class="prio-${q.priority}">${q.priority}</td>` +
      `<td class="num">${q.gpus}</td><td class="num">${dur(nowSec() - q.submitted_at)}</td><td class="reason">${esc(q.reason || "next cycle")}</td></tr>`);
  }
  $("queue").innerHTML = rows.join("");
}

function renderTail(m) {
  $("tail").innerHTML = m.tail.slice().reverse().slice(0, 80).map((e) =>
    `<li class="t-${e.type}"${e.job_id ? ` data-job="${esc(e.job_id)}"` : ""}><span class="s">${e.seq}</span>${esc(e.text)}</li>`).join("");
}

// --- hover details ----------------------------------------------------------------------

function jobDetails(job) {
  if (!job) return "";
  job = accounted(job);
  const lines = [`<b>${esc(job.job_id)}</b> ${esc(job.name || "")}`,
    `<span class="k">team</span> ${esc(job.team)} · <span class="k">priority</span> ${esc(job.priority)} · <span class="k">state</span> ${esc(job.state)}`];
  if (job.gpus && job.gpus.length) lines.push(`<span class="k">holds</span> ${job.gpus.length} GPU(s) · ${esc(job.level)} via ${esc(job.placer)}${job.backfill ? " (backfill)" : ""}`);
  if (job.gpus_requested) lines.push(`<span class="k">asks</span> ${job.min_gpus === job.gpus_requested ? job.gpus_requested : job.min_gpus + "–" + job.gpus_requested} GPU(s)${job.preemptible ? ", preemptible" : ""}`);
  if (job.started_at != null && model) lines.push(`<span class="k">running for</span> ${dur(nowSec() - job.started_at)}`);
  if (job.checkpoint) lines.push(`<span class="k">checkpoint</span> step ${job.checkpoint.step}`);
  if (job.idle) lines.push(`<span class="idle-text">idle</span> since ${dur(nowSec() - job.idle.since)}: GPUs under ${job.idle.threshold_pct}% (mean ${Number(job.idle.util_pct).toFixed(1)}%)`);
  if (job.efficiency != null) lines.push(`<span class="k">GPU-h held / busy</span> ${Number(job.gpu_hours_held).toFixed(2)} / ${Number(job.gpu_hours_busy).toFixed(2)} (${(job.efficiency * 100).toFixed(0)}%)`);
  if (job.preemption) lines.push(`<span class="k">preempting for</span> ${esc(job.preemption.for_job)}`);
  if (job.preemptions) lines.push(`<span class="k">preempted</span> ${job.preemptions}× · lost ${Number(job.lost_gpu_s || 0).toFixed(0)} GPU-s`);
  const reason = job.pending_reason || job.reason;
  if (job.state === "pending") lines.push(`<div class="why">why pending: ${esc(reason || "waiting for the next cycle")}</div>`);
  const ex = explained[job.job_id];
  if (ex && ex.data.why_pending) {
    const w = ex.data.why_pending;
    lines.push(`<div class="why">team ${esc(w.team)} holds ${w.team_quota.held}/${w.team_quota.guaranteed} guaranteed, limit ${w.team_quota.limit ?? "none"}` +
      ` · ${w.topology.free_total} GPUs free · queue #${w.queue.position}/${w.queue.of}</div>`);
    for (const u of w.unblock) lines.push(`<div class="why">→ ${esc(u)}</div>`);
    const eta = w.eta_s == null ? "unknown"
      : "in " + (w.eta_range ? dur(w.eta_range[0]) + "–" + dur(w.eta_range[1]) : dur(w.eta_s));
    lines.push(`<div class="why">estimated start: ${eta}</div>`);
  }
  return lines.map((l) => l.startsWith("<div") ? l : `<div>${l}</div>`).join("");
}

function explain(jobId) {
  const ex = explained[jobId];
  if (ex && model && ex.seq === model.seq) return;
  explained[jobId] = {seq: model ? model.seq : 0, data: (ex && ex.data) || {}};
  fetch(`/api/job/${encodeURIComponent(jobId)}`).then((r) => r.ok ? r.json() : null).then((data) => {
    if (data) { explained[jobId] = {seq: model ? model.seq : 0, data}; if (hovered === jobId) showTip(lastEvent); }
  }).catch(() => {});
}

let hovered = null;
let highlighted = null;
// outline the hovered job's GPUs (looked up only when the hovered job changes: 8,000 cells)
function highlight(jobId) {
  if (jobId === highlighted) return;
  document.querySelectorAll(".gpu.hl").forEach((e) => e.classList.remove("hl"));
  if (jobId) document.querySelectorAll(`.gpu[data-job="${CSS.escape(jobId)}"]`).forEach((e) => e.classList.add("hl"));
  highlighted = jobId;
}
let lastEvent = null;
function showTip(ev) {
  const tip = $("tooltip");
  const t = ev && ev.target && ev.target.closest ? ev.target.closest("[data-gpu],[data-job]") : null;
  if (!t) { tip.hidden = true; highlight(null); hovered = null; return; }
  let html = "";
  const jobId = t.dataset.job;
  if (t.dataset.gpu) {
    const g = gpuIndex[t.dataset.gpu] || {};
    html = `<b>GPU ${esc(t.dataset.gpu)}</b> <span class="k">${esc(g.model || "")} · rack ${esc(g.rack || "")} · NVLink ${g.nvlink_domain}</span><br>` +
      `<span class="k">status</span> ${esc(g.status)}` + (g.quarantined ? ` (${esc(g.quarantined)})` : "");
    if (jobId) html += `<div style="height:6px"></div>` + jobDetails(jobIndex[jobId] || {job_id: jobId, team: g.team, state: "running"});
  } else if (jobId) {
    const job = jobIndex[jobId];
    if (job && job.state === "pending") explain(jobId);
    html = jobDetails(job || {job_id: jobId});
  }
  highlight(jobId || null);
  hovered = jobId || null;
  tip.innerHTML = html;
  tip.hidden = false;
  const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
  tip.style.left = x + "px";
  tip.style.top = y + "px";
}
document.addEventListener("mousemove", (ev) => { lastEvent = ev; showTip(ev); });

// --- controls ---------------------------------------------------------------------------

let toastTimer = null;
function toast(text, error = false) {
  const t = $("toast");
  t.textContent = text;
  t.className = "show" + (error ? " error" : "");
  t.dataset.error = error ? "1" : "0";
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.className = ""; }, 4000);
}

// The session's CSRF token: every POST carries it in a header a foreign page cannot set
// without a CORS preflight (which this server never grants), with the login cookie.
let session = null;
async function getSession() {
  if (!session) session = await fetch("/api/session").then((r) => r.ok ? r.json() : {role: null, csrf: ""});
  return session;
}

async function post(path, body) {
  try {
    const s = await getSession();
    const r = await fetch(path, {method: "POST", body: JSON.stringify(body),
      headers: {"Content-Type": "application/json", "X-Gpusched-Csrf": s.csrf}});
    const data = await r.json().catch(() => ({ok: false, error: `HTTP ${r.status}`}));
    return data;
  } catch (err) {
    return {ok: false, error: String(err)};
  }
}

$("submit-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const body = {team: $("submit-team").value.trim(), gpus: Number($("submit-gpus").value),
    priority: $("submit-priority").value, preemptible: $("submit-preemptible").checked};
  const r = await post("/api/submit", body);
  toast(r.ok ? `submitted ${r.job_id}` : `submit failed: ${r.error}`, !r.ok);
});
for (const action of ["stop", "start"]) {
  $(`placement-${action}`).addEventListener("click", async () => {
    const r = await post("/api/placement", {action});
    toast(r.ok ? `placement ${action === "stop" ? "stopped" : "started"}` : `placement ${action} failed: ${r.error}`, !r.ok);
  });
}
$("flood-button").addEventListener("click", async () => {
  const r = await post("/api/flood", {team: $("flood-team").value.trim(), count: Number($("flood-count").value)});
  toast(r.ok ? `flood: ${r.submitted} interactive job(s) submitted` : `flood failed: ${r.error || (r.errors || []).join("; ")}`, !r.ok);
});

// --- live updates -----------------------------------------------------------------------

let source = null;
function connect(since) {
  // on a reconnect the browser sends Last-Event-ID (the last version it got): the server
  // answers with the deltas from there, or the whole model when it no longer holds them
  source = new EventSource(`/api/events?since=${since}`);
  const conn = $("conn-badge");
  const live = () => { conn.dataset.state = "live"; conn.textContent = "live"; };
  source.addEventListener("open", live);
  source.addEventListener("full", (ev) => { live(); showFull(JSON.parse(ev.data)); });
  source.addEventListener("delta", (ev) => { live(); onDelta(ev.data); });
  source.onerror = () => { conn.dataset.state = "lost"; conn.textContent = "reconnecting…"; };
}
restoreFilter();
getSession().then((s) => { document.body.dataset.role = s.role || ""; }).catch(() => {});
loadFull().then((m) => connect(`${m.epoch}-${m.version}`)).catch(() => connect(""));
// ages move with the wall clock even when the log is quiet
setInterval(() => { if (model) { renderQueue(model); renderShares(model); } }, 1000);
