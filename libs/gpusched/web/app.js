// gpusched dashboard: plain JS, no build step. The server pushes the page's whole model over
// Server-Sent Events (/api/events); the page re-renders from it. Controls POST to /api/*.
"use strict";

const HUES = [205, 330, 140, 38, 265, 8, 175, 88, 300, 55];
const $ = (id) => document.getElementById(id);
let model = null;
let teamIndex = {};
let gpuIndex = {};
let jobIndex = {};
const explained = {};  // job id -> {seq, data}: explanations fetched on hover

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function hash(s) { let h = 0; for (const c of s) h = (h * 31 + c.charCodeAt(0)) | 0; return Math.abs(h); }
function teamHue(team) { return HUES[(teamIndex[team] ?? hash(team)) % HUES.length]; }
function teamColor(team, light = 55) { return `hsl(${teamHue(team)} 62% ${light}%)`; }
function jobColor(team, job) { return teamColor(team, 40 + (hash(job) % 5) * 6); }
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

// --- rendering ---------------------------------------------------------------------------

function render(m) {
  model = m;
  teamIndex = {};
  m.teams.forEach((t, i) => { teamIndex[t.team] = i; });
  gpuIndex = {};
  jobIndex = {};
  for (const j of m.running) jobIndex[j.job_id] = j;
  for (const q of m.queue) jobIndex[q.job_id] = jobIndex[q.job_id] || {...q, state: "pending"};
  for (const j of m.finished) jobIndex[j.job_id] = jobIndex[j.job_id] || j;
  renderHealth(m);
  renderCluster(m);
  renderTeams(m);
  renderQueue(m);
  renderTail(m);
}

function renderHealth(m) {
  const h = m.health;
  const pb = $("placement-badge");
  const lease = h.lease || {};
  let state = h.placement_degraded ? "degraded" : "ok";
  let text = h.placement_degraded ? "placement DEGRADED · naive fallback" : "placement topology-aware";
  if (!h.placement_degraded && lease.redis && lease.placement === null) { state = "down"; text = "placement down (lease lapsed)"; }
  pb.dataset.state = state;
  pb.textContent = text;
  pb.title = lease.placement ? "lease held by " + lease.placement : "";
  $("gpus-badge").textContent = `GPUs ${h.gpus.held}/${h.gpus.total} held · ${h.gpus.free} free` +
    (h.gpus.unavailable ? ` · ${h.gpus.unavailable} down` : "");
  $("jobs-badge").textContent = `jobs ${h.jobs.running + h.jobs.starting} running · ${h.jobs.pending} pending · ${h.jobs.completed} done`;
  $("seq-badge").textContent = `log seq ${m.seq}` + (h.violations ? ` · ${h.violations} VIOLATIONS` : "");
}

function renderCluster(m) {
  const parts = [];
  for (const rack of m.racks) {
    parts.push(`<div class="rack" data-rack="${esc(rack.rack)}"><h3>${esc(rack.rack)}</h3>`);
    for (const n of rack.nodes) {
      const cls = n.lost ? "node lost" : n.drained ? "node drained" : "node";
      parts.push(`<div class="${cls}" data-node="${esc(n.node)}"><span class="name" title="${n.free}/${n.total} free">${esc(n.node)}</span><span class="gpus">`);
      let dom = null;
      for (const g of n.gpus) {
        gpuIndex[g.gpu] = {...g, node: n.node, rack: n.rack};
        if (g.nvlink_domain !== dom) {
          if (dom !== null) parts.push("</span>");
          parts.push(`<span class="dom" title="NVLink domain ${g.nvlink_domain}">`);
          dom = g.nvlink_domain;
        }
        const style = g.status === "held" && g.team ? ` style="background:${jobColor(g.team, g.job_id)}"` : "";
        parts.push(`<span class="gpu" data-gpu="${esc(g.gpu)}" data-status="${g.status}"` + (g.idle ? ` data-idle="1"` : "") +
          (g.job_id ? ` data-job="${esc(g.job_id)}" data-team="${esc(g.team)}"` : "") + `${style}></span>`);
      }
      if (dom !== null) parts.push("</span>");
      parts.push(`</span></div>`);
    }
    parts.push(`</div>`);
  }
  $("cluster").innerHTML = parts.join("") || `<p class="dim">no nodes registered yet</p>`;
  const nodes = m.racks.reduce((a, r) => a + r.nodes.length, 0);
  $("cluster-summary").textContent = `${m.racks.length} rack(s), ${nodes} node(s), ${m.health.gpus.total} GPUs`;
  $("legend").innerHTML = m.teams.map((t) => `<span><span class="sw" style="background:${teamColor(t.team)}"></span>${esc(t.team)}</span>`).join("") +
    `<span><span class="sw" style="background:var(--free);border:1px solid #2d3641"></span>free</span>` +
    `<span><span class="sw" style="background:#5a2422"></span>quarantined / zombie</span>` +
    `<span><span class="sw idle"></span>held but idle</span>`;
}

function renderTeams(m) {
  const rows = [`<tr><th>team</th><th class="num">held</th><th class="num">guar.</th><th class="num">limit</th><th>share vs guarantee</th><th class="num">queued</th><th class="num" title="GPU-hours held / busy; efficiency = busy / held">GPU-h (eff.)</th></tr>`];
  const total = Math.max(1, m.health.gpus.total);
  for (const t of m.teams) {
    const pct = Math.min(100, (t.held / total) * 100);
    const g = Math.min(100, (t.guaranteed / total) * 100);
    rows.push(`<tr data-team="${esc(t.team)}"><td><span class="sw" style="display:inline-block;width:9px;height:9px;border-radius:2px;background:${teamColor(t.team)}"></span> ${esc(t.team)}</td>` +
      `<td class="num">${t.held}</td><td class="num">${t.guaranteed}</td><td class="num">${t.limit ?? "–"}</td>` +
      `<td><div class="bar" title="${(t.share * 100).toFixed(0)}% held, ${(t.entitled_share * 100).toFixed(0)}% guaranteed"><span style="width:${pct}%;background:${teamColor(t.team)}"></span><i style="left:${g}%"></i></div></td>` +
      `<td class="num">${t.pending_jobs}</td>` +
      `<td class="num${t.idle_gpus ? " idle-text" : ""}" title="${t.idle_gpus} GPU(s) idle now">${Number(t.gpu_hours_held || 0).toFixed(2)}/${Number(t.gpu_hours_busy || 0).toFixed(2)}` +
      `${t.efficiency == null ? "" : " (" + (t.efficiency * 100).toFixed(0) + "%)"}</td></tr>`);
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
  $("queue-count").textContent = m.queue_len ? `${m.queue_len} waiting, in policy order` : "empty";
  const rows = [`<tr><th>#</th><th>job</th><th>team</th><th>prio</th><th class="num">GPUs</th><th class="num">wait</th><th>reason</th></tr>`];
  for (const q of m.queue) {
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
    lines.push(`<div class="why">estimated start: ${w.eta_s == null ? "unknown" : "in " + dur(w.eta_s)}</div>`);
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
let lastEvent = null;
function showTip(ev) {
  const tip = $("tooltip");
  const t = ev && ev.target && ev.target.closest ? ev.target.closest("[data-gpu],[data-job]") : null;
  document.querySelectorAll(".gpu.hl").forEach((e) => e.classList.remove("hl"));
  if (!t) { tip.hidden = true; hovered = null; return; }
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
  if (jobId) document.querySelectorAll(`.gpu[data-job="${CSS.escape(jobId)}"]`).forEach((e) => e.classList.add("hl"));
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

function connect() {
  const es = new EventSource("/api/events");
  const conn = $("conn-badge");
  es.addEventListener("state", (ev) => {
    conn.dataset.state = "live";
    conn.textContent = "live";
    render(JSON.parse(ev.data));
    document.body.dataset.seq = String(model.seq);
  });
  es.onerror = () => { conn.dataset.state = "lost"; conn.textContent = "reconnecting…"; };
}
fetch("/api/state").then((r) => r.json()).then((m) => { if (!model) render(m); }).catch(() => {});
getSession().then((s) => { document.body.dataset.role = s.role || ""; }).catch(() => {});
connect();
// ages move with the wall clock even when the log is quiet
setInterval(() => { if (model) { renderQueue(model); renderShares(model); } }, 1000);
