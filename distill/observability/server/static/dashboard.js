// distill dashboard: polls the status API and draws everything by hand on <canvas>
// (no libraries, no network beyond this server). Each chart sets data-points="N" on its
// canvas after drawing N points, which the browser test reads.
"use strict";

const POLL_MS = 1500;
const COLORS = {
  loss: "#1d2330", kd: "#2f6fe0", ce: "#e07a2f", teacher: "#e07a2f", student: "#2f6fe0",
  tps: "#0f9488", grid: "#e3e6eb", axis: "#6b7280",
};

const state = {
  epoch: null,
  next: -1,
  series: { bootstrap: new Map(), distill: new Map(), eval: new Map() },
  sorted: { bootstrap: [], distill: [], eval: [] },
  utilSamples: [],  // busy fractions seen in /api/status, for runs that report them as gauges
  status: null,
  config: null,
};

const $ = (id) => document.getElementById(id);

// ---- formatting --------------------------------------------------------------------------

function fmt(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
  if (a !== 0 && (a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toString();
}

function fmtSI(v) {
  if (v === null || v === undefined) return "—";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return fmt(v, 3);
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "—";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}

function fmtClock(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "—";
}

function setText(id, text) {
  const el = $(id);
  if (el && el.textContent !== text) el.textContent = text;
}

// ---- data ----------------------------------------------------------------------------------

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok && r.status !== 503) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function seriesOf(r) {
  if (r.eval) return "eval";
  return r.phase === "bootstrap" ? "bootstrap" : "distill";
}

function resetHistory() {
  for (const k of Object.keys(state.series)) state.series[k].clear();
  state.next = -1;
}

function ingest(page) {
  const touched = new Set();
  for (const r of page.records) {
    const k = seriesOf(r);
    state.series[k].set(r.step, r);  // a later record for a step replaces the earlier one
    touched.add(k);
  }
  for (const k of touched) {
    state.sorted[k] = Array.from(state.series[k].values()).sort((a, b) => a.step - b.step);
  }
  state.next = Math.max(state.next, page.next);
  state.epoch = page.epoch;
  return touched.size > 0;
}

async function poll() {
  try {
    const [status, page] = await Promise.all([
      getJSON("api/status"),
      getJSON(`api/history?after=${state.next}`),
    ]);
    let changed;
    if (state.epoch !== null && page.epoch !== state.epoch) {
      resetHistory();  // the run rewound (resumed from a checkpoint): start over
      changed = ingest(await getJSON("api/history"));
      state.utilSamples = [];
    } else {
      changed = ingest(page);
    }
    state.status = status;
    noteUtil(status);
    renderStatus(status);
    if (changed || !drawnOnce) drawCharts();
    if (state.config === null) loadConfig();
    setConn(true, "live");
  } catch (err) {
    setConn(false, "disconnected: " + err.message);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

async function loadConfig() {
  try {
    state.config = await getJSON("api/config");
    $("config").textContent = toYaml(state.config, 0).trimEnd() || "(empty)";
  } catch (err) {
    state.config = null;
  }
}

function setConn(ok, text) {
  const el = $("conn");
  el.dataset.ok = String(ok);
  setText("conn", text);
  if (ok) setText("updated", new Date().toLocaleTimeString());
}

function noteUtil(s) {
  if (s.teacher_busy === null && s.student_busy === null) return;
  const last = state.utilSamples[state.utilSamples.length - 1];
  if (last && last.step === s.step) return;
  state.utilSamples.push({ step: s.step, teacher_busy: s.teacher_busy, student_busy: s.student_busy });
  if (state.utilSamples.length > 2000) state.utilSamples.shift();
}

// ---- status panels -------------------------------------------------------------------------

function renderStatus(s) {
  document.title = `${s.run_name} · ${s.phase} · ${s.step}/${s.total_steps}`;
  setText("run-name", s.run_name);
  const phase = $("phase");
  phase.dataset.phase = s.phase;
  setText("phase", s.phase);
  const health = $("health");
  health.dataset.ok = String(s.healthy);
  health.title = s.health_reason;
  setText("health-reason", s.health_reason);

  setText("step", String(s.step));
  setText("total-steps", String(s.total_steps));
  setText("counter-label", s.phase === "bootstrap" ? "(teacher bootstrap)" : "");
  const pct = s.progress === null ? 0 : 100 * s.progress;
  $("progress-bar").style.width = pct.toFixed(1) + "%";
  setText("progress-pct", pct.toFixed(1) + "%");
  setText("eta", s.phase === "done" ? "done" : fmtDuration(s.eta_s));
  setText("elapsed", fmtDuration(s.elapsed_s));

  setText("loss", fmt(s.loss));
  setText("kd-loss", fmt(s.kd_loss));
  const byTeacher = s.kd_loss_by_teacher;  // several teachers: each one's divergence
  $("kd-by-teacher").hidden = $("kd-by-teacher-label").hidden = !byTeacher;
  if (byTeacher) {
    setText("kd-by-teacher", Object.entries(byTeacher).map(([n, v]) => `${n} ${fmt(v)}`).join(" · "));
  }
  setText("ce-loss", fmt(s.ce_loss));
  setText("lr", fmt(s.lr, 3));
  setText("tokens-per-s", fmtSI(s.tokens_per_s));
  setText("teacher-ms", fmt(s.teacher_ms, 3));
  setText("student-ms", fmt(s.student_ms, 3));
  setText("in-flight", fmt(s.in_flight));
  setText("teacher-wait", typeof s.teacher_wait_s === "number" ? fmtDuration(s.teacher_wait_s) : "—");
  setText("bottleneck", s.bottleneck || "—");
  setText("bytes-per-token", fmtSI(s.bytes_per_token));
  setText("generate-ms", fmt(s.generate_ms, 3));
  setText("gen-tokens-per-s", fmtSI(s.gen_tokens_per_s));
  setText("on-policy", typeof s.on_policy === "number" ? (100 * s.on_policy).toFixed(0) + "%" : "—");
  setText("staleness", fmt(s.staleness, 2));

  const ev = s.latest_eval;
  setText("eval-step", ev ? `at step ${ev.step}` : "");
  setText("eval-student-loss", fmt(ev && ev.student_loss));
  setText("eval-teacher-loss", fmt(ev && ev.teacher_loss));
  setText("eval-kl", fmt(ev && ev.kl));
  setText("eval-top1", ev && ev.top1_agreement !== null
    ? (100 * ev.top1_agreement).toFixed(1) + "%" : "—");
  setText("eval-sample-nll", fmt(ev && ev.sample_teacher_nll));
  setText("eval-sample-kl", fmt(ev && ev.sample_kl));
  setText("eval-sample-len", fmt(ev && ev.sample_len, 3));

  const gate = s.alpha_gate || [];
  const last = gate[gate.length - 1];
  const off = s.teacher_off_steps ? ` · ${s.teacher_off_steps} steps off` : "";
  setText("alpha-gate", !last ? (s.alpha === 0 ? "off" : "on")
    : `${last.alpha === 0 ? "off" : "on"} from step ${last.step}: ${last.reason}${off}`);

  const ck = s.last_checkpoint;
  setText("checkpoint-step", ck ? String(ck.step) : "—");
  setText("checkpoint-time", ck ? `${fmtClock(ck.time)} (${fmtDuration(s.time - ck.time)} ago)` : "—");
  setText("restarts", String(s.restarts || 0));

  const banner = $("banner");
  if (s.phase === "failed" || !s.healthy) {
    banner.hidden = false;
    setText("banner", s.phase === "failed" ? `Run failed: ${s.failure}` : s.health_reason);
  } else {
    banner.hidden = true;
  }

  renderMesh(s);
  renderActors(s.actors);
  const summary = $("summary-panel");
  summary.hidden = !s.summary;
  if (s.summary) setText("summary", toYaml(s.summary, 0).trimEnd());
}

let meshKey = "";

function renderMesh(s) {
  const layout = s.mesh;
  const key = JSON.stringify([layout, s.bytes_per_token, s.in_flight]);
  if (!layout || key === meshKey) return;
  meshKey = key;
  // colocated meshes share their devices: both roles are shown, each device under both
  const colocated = layout.placement === "colocated";
  const where = colocated ? " · colocated (both roles on the same devices, in turn)" : "";
  setText("platform", layout.platform ? `· ${layout.platform}${where}` : "");
  const box = $("mesh");
  box.replaceChildren();
  const roles = [["teacher", "Teacher · inference mesh"], ["student", "Student · training mesh"]];
  roles.forEach(([role, title], i) => {
    const m = layout[role];
    if (!m) return;
    if (i === 1 && layout.teacher) box.appendChild(linkBox(s));
    const group = document.createElement("div");
    group.className = "mesh-role";
    group.dataset.role = role;
    const shape = Object.entries(m.shape || {}).map(([a, n]) => `${a}=${n}`).join(" × ");
    const h = document.createElement("h3");
    h.textContent = `${title} (${shape || m.axis})`;
    group.appendChild(h);
    const devs = document.createElement("div");
    devs.className = "devices";
    (m.devices || []).forEach((d, idx) => {
      const el = document.createElement("div");
      el.className = "device";
      el.dataset.role = role;
      el.id = colocated ? `device-${d.id}-${role}` : `device-${d.id}`;
      const at = meshCoords(m, idx);
      el.title = `${role} ${at} on device ${d.id} (${d.kind || "?"})`;
      el.innerHTML = `<b></b><span></span><br><span></span>`;
      el.children[0].textContent = at;
      el.children[1].textContent = `device ${d.id}`;
      el.children[3].textContent = d.kind || "?";
      devs.appendChild(el);
    });
    group.appendChild(devs);
    box.appendChild(group);
  });
}

// A device's place in its mesh from its flat (row-major) index: "dp1 tp0", naming the axes
// longer than 1 (the role's main axis alone when every axis is 1).
function meshCoords(m, idx) {
  const axes = Object.entries(m.shape || {});
  if (!axes.length) return `${m.axis || "?"}${idx}`;
  const at = [];
  let rest = idx;
  for (let i = axes.length - 1; i >= 0; i--) {
    const [name, n] = axes[i];
    if (n > 1) at.unshift(`${name}${rest % n}`);
    rest = Math.floor(rest / n);
  }
  return at.length ? at.join(" ") : `${m.axis || "?"}0`;
}

function linkBox(s) {
  const el = document.createElement("div");
  el.className = "link";
  el.innerHTML = `<div class="arrow">↓</div><div></div>`;
  const parts = [s.mesh.placement === "colocated" ? "teacher outputs, same devices" : "teacher outputs"];
  if (s.bytes_per_token !== null) parts.push(`${fmtSI(s.bytes_per_token)} B/token`);
  if (s.in_flight !== null) parts.push(`${fmt(s.in_flight)} in flight`);
  el.lastChild.textContent = parts.join(" · ");
  return el;
}

function renderActors(actors) {
  const panel = $("actors-panel");
  panel.hidden = !(Array.isArray(actors) && actors.length);
  if (panel.hidden) return;
  const cols = [];
  for (const a of actors) for (const k of Object.keys(a)) if (!cols.includes(k)) cols.push(k);
  const table = $("actors");
  table.replaceChildren();
  const head = table.insertRow();
  for (const c of cols) {
    const th = document.createElement("th");
    th.textContent = c;
    head.appendChild(th);
  }
  for (const a of actors) {
    const row = table.insertRow();
    for (const c of cols) {
      const v = a[c];
      row.insertCell().textContent = typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v);
    }
  }
}

function isLeaf(v) {
  if (v === null || typeof v !== "object") return true;
  if (Array.isArray(v)) return v.every((x) => x === null || typeof x !== "object");
  return Object.keys(v).length === 0;
}

function toYaml(v, indent) {
  // A YAML-looking rendering of a JSON value, for reading the config at a glance.
  const pad = "  ".repeat(indent);
  if (isLeaf(v)) return JSON.stringify(v) + "\n";
  if (Array.isArray(v)) return v.map((x) => `${pad}- ${toYaml(x, indent + 1).trimStart()}`).join("");
  return Object.entries(v).map(([k, child]) => (isLeaf(child)
    ? `${pad}${k}: ${toYaml(child, 0)}`
    : `${pad}${k}:\n${toYaml(child, indent + 1)}`)).join("");
}

// ---- charts --------------------------------------------------------------------------------

let drawnOnce = false;

function drawCharts() {
  drawnOnce = true;
  const d = state.sorted.distill, e = state.sorted.eval, b = state.sorted.bootstrap;
  const pts = (rs, key) => rs.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);
  lineChart($("chart-loss"), [
    { label: "loss", color: COLORS.loss, points: pts(d, "loss"), width: 2 },
    { label: "KD", color: COLORS.kd, points: pts(d, "kd_loss") },
    { label: "CE", color: COLORS.ce, points: pts(d, "ce_loss") },
  ]);
  lineChart($("chart-eval"), [
    { label: "student", color: COLORS.student, points: pts(e, "student_loss"), width: 2, dots: true },
    { label: "teacher", color: COLORS.teacher, points: pts(e, "teacher_loss"), width: 2, dots: true },
  ]);
  lineChart($("chart-samples"), [
    { label: "teacher NLL", color: COLORS.teacher, points: pts(e, "sample_teacher_nll"), width: 2, dots: true },
    { label: "KL", color: COLORS.student, points: pts(e, "sample_kl"), width: 2, dots: true },
  ]);
  lineChart($("chart-tps"), [
    { label: "tokens/s", color: COLORS.tps, points: pts(d, "tokens_per_s"), width: 2 },
  ], { yMin0: true, yFmt: fmtSI });
  const util = d.some((r) => typeof r.teacher_busy === "number" || typeof r.student_busy === "number")
    ? d : state.utilSamples;
  utilStrip($("chart-util"), util);
  const experts = pts(d, "expert_load_max_mean");
  $("experts-figure").hidden = experts.length === 0;
  if (experts.length) {  // a mixture-of-experts teacher's routing (dropped: with a capacity)
    lineChart($("chart-experts"), [
      { label: "max/mean", color: COLORS.teacher, points: experts, width: 2 },
      { label: "dropped", color: COLORS.student, points: pts(d, "expert_dropped") },
    ], { yMin0: true });
  }
  $("bootstrap-figure").hidden = b.length === 0;
  if (b.length) {
    lineChart($("chart-bootstrap"), [
      { label: "teacher loss", color: COLORS.teacher, points: pts(b, "loss"), width: 2 },
    ]);
  }
}

function setupCanvas(canvas) {
  const rect = canvas.getBoundingClientRect();
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(100, Math.round(rect.width)), h = Math.max(60, Math.round(rect.height));
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) {
    canvas.width = w * dpr;
    canvas.height = h * dpr;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

function niceTicks(lo, hi, n) {
  if (hi <= lo) { hi = lo + 1; }
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
  return ticks;
}

function waiting(ctx, w, h, canvas) {
  ctx.fillStyle = COLORS.axis;
  ctx.textAlign = "center";
  ctx.fillText("waiting for data…", w / 2, h / 2);
  canvas.dataset.points = "0";
}

function lineChart(canvas, series, opts = {}) {
  const { ctx, w, h } = setupCanvas(canvas);
  const all = series.flatMap((s) => s.points);
  if (!all.length) return waiting(ctx, w, h, canvas);
  const yFmt = opts.yFmt || ((v) => fmt(v, 3));
  const m = { l: 54, r: 12, t: 22, b: 22 };
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (opts.yMin0) y0 = Math.min(0, y0);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const pad = (y1 - y0) * 0.08 || Math.abs(y1) * 0.1 || 1;
  y0 = opts.yMin0 ? y0 : y0 - pad;
  y1 += pad;
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const Y = (y) => h - m.b - ((y - y0) / (y1 - y0)) * (h - m.t - m.b);

  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.axis;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const t of niceTicks(y0, y1, 4)) {
    ctx.beginPath(); ctx.moveTo(m.l, Y(t)); ctx.lineTo(w - m.r, Y(t)); ctx.stroke();
    ctx.fillText(yFmt(t), m.l - 6, Y(t));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of niceTicks(x0, x1, 6)) {
    if (t < x0 || t > x1) continue;
    ctx.fillText(String(Math.round(t)), X(t), h - m.b + 5);
  }
  ctx.strokeStyle = COLORS.axis;
  ctx.beginPath(); ctx.moveTo(m.l, m.t); ctx.lineTo(m.l, h - m.b); ctx.lineTo(w - m.r, h - m.b); ctx.stroke();

  let drawn = 0;
  for (const s of series) {
    if (!s.points.length) continue;
    ctx.strokeStyle = ctx.fillStyle = s.color;
    ctx.lineWidth = s.width || 1.5;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    if (s.dots || s.points.length === 1) {
      for (const [x, y] of s.points) { ctx.beginPath(); ctx.arc(X(x), Y(y), 3, 0, 2 * Math.PI); ctx.fill(); }
    }
    drawn += s.points.length;
  }
  legend(ctx, w, m, series.filter((s) => s.points.length), yFmt);
  canvas.dataset.points = String(drawn);
}

function legend(ctx, w, m, series, yFmt) {
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  let x = w - m.r;
  const items = series.map((s) => `${s.label} ${yFmt(s.points[s.points.length - 1][1])}`);
  const widths = items.map((t) => ctx.measureText(t).width + 26);
  x -= widths.reduce((a, b) => a + b, 0);
  series.forEach((s, i) => {
    ctx.strokeStyle = ctx.fillStyle = s.color;
    ctx.lineWidth = 2.5;
    ctx.beginPath(); ctx.moveTo(x, 9); ctx.lineTo(x + 14, 9); ctx.stroke();
    ctx.fillStyle = "#1d2330";
    ctx.fillText(items[i], x + 18, 9);
    x += widths[i];
  });
}

function utilStrip(canvas, records) {
  const { ctx, w, h } = setupCanvas(canvas);
  const rows = [["teacher", "teacher_busy", COLORS.teacher], ["student", "student_busy", COLORS.student]];
  const recs = records.filter((r) => rows.some(([, k]) => typeof r[k] === "number"));
  if (!recs.length) return waiting(ctx, w, h, canvas);
  const m = { l: 86, r: 12, t: 10, b: 22 };
  const x0 = recs[0].step, x1 = Math.max(recs[recs.length - 1].step, x0 + 1);
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const bandH = (h - m.t - m.b - 12) / 2;
  rows.forEach(([name, key, color], ri) => {
    const top = m.t + ri * (bandH + 12);
    ctx.fillStyle = "#f0f2f5";
    ctx.fillRect(m.l, top, w - m.l - m.r, bandH);
    ctx.fillStyle = color;
    recs.forEach((r, i) => {
      const v = r[key];
      if (typeof v !== "number") return;
      const xa = X(r.step), xb = i + 1 < recs.length ? X(recs[i + 1].step) : w - m.r;
      const bh = bandH * Math.max(0, Math.min(1, v));
      ctx.globalAlpha = 0.35 + 0.65 * Math.max(0, Math.min(1, v));
      ctx.fillRect(xa, top + bandH - bh, Math.max(1, xb - xa), bh);
    });
    ctx.globalAlpha = 1;
    const vals = recs.map((r) => r[key]).filter((v) => typeof v === "number");
    const mean = vals.reduce((a, b) => a + b, 0) / Math.max(1, vals.length);
    ctx.fillStyle = "#1d2330";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.font = "600 12px system-ui, sans-serif";
    ctx.fillText(name, m.l - 8, top + bandH / 2 - 7);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = COLORS.axis;
    ctx.fillText(vals.length ? `mean ${(100 * mean).toFixed(0)}%` : "—", m.l - 8, top + bandH / 2 + 8);
  });
  ctx.fillStyle = COLORS.axis;
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of niceTicks(x0, x1, 6)) {
    if (t >= x0 && t <= x1) ctx.fillText(String(Math.round(t)), X(t), h - m.b + 5);
  }
  canvas.dataset.points = String(recs.length);
}

window.addEventListener("resize", () => { if (drawnOnce) drawCharts(); });
poll();
