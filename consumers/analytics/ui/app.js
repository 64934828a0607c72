// rollstream web UI: vanilla JS, SVG charts drawn here, data from the analytics server
// (/reports/<view>, /ui/api/<name>, /health). No build step, nothing fetched from outside.
"use strict";

const POLL_MS = 5000;
const COLORS = ["#2f6fdb", "#23915a", "#c7821a", "#c8382d", "#7b4fc9", "#1b9aaa", "#8a8f98"];
const LINK_COLORS = { root: "#18202b", append: "#2f6fdb", branch: "#23915a", rewind: "#c7821a", subagent: "#7b4fc9" };
const $ = (sel, root = document) => root.querySelector(sel);
const main = () => $("#main");

// --- helpers ---------------------------------------------------------------------------------

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function fmt(value, digits = 3) {
  if (value === null || value === undefined || value === "") return "–";
  if (typeof value === "number") {
    if (!Number.isFinite(value)) return "–";
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    const abs = Math.abs(value);
    if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
    return String(Number(value.toFixed(digits)));
  }
  return String(value);
}
function pct(value) { return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)}%`; }
function short(id, n = 14) { id = String(id ?? ""); return id.length > n ? `${id.slice(0, n - 1)}…` : id; }
function tail(id, n = 14) { id = String(id ?? ""); return id.length > n ? `…${id.slice(1 - n)}` : id; }
function ts(value) { return value ? String(value).replace("T", " ").slice(0, 19) : "–"; }
function rowsOf(table) { return table.rows.map((r) => Object.fromEntries(table.columns.map((c, i) => [c, r[i]]))); }
function qs(params) {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") p.set(k, v);
  const s = p.toString();
  return s ? `?${s}` : "";
}

// --- data, with the analyst key ----------------------------------------------------------------

class Unauthorized extends Error {}
// an answer that came back after the page moved on (another route): its page must not draw
class Stale extends Error {}

async function api(path) {
  const asked = generation;
  const key = sessionStorage.getItem("rollstream.key");
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  const r = await fetch(path, { headers });
  if (r.status === 401) { askKey(); throw new Unauthorized("an analyst API key is needed"); }
  const body = await r.json().catch(() => ({ error: `${r.status} ${r.statusText}` }));
  if (asked !== generation) throw new Stale(path);
  if (!r.ok) throw new Error(body.error || `${r.status}`);
  return body;
}
function askKey() {
  const form = $("#keyform");
  form.hidden = false;
  $("#key").focus();
}
$("#keyform").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("rollstream.key", $("#key").value.trim());
  $("#keyform").hidden = true;
  route();
});
function showError(err) {
  const box = $("#error");
  if (err instanceof Stale) return;  // a page left behind: nothing to show
  if (!err || err instanceof Unauthorized) { box.hidden = true; return; }
  box.textContent = err.message || String(err);
  box.hidden = false;
}

// --- charts (SVG) -------------------------------------------------------------------------------

function scale(d0, d1, r0, r1) {
  const span = d1 - d0 || 1;
  return (v) => r0 + ((v - d0) / span) * (r1 - r0);
}
function ticks(lo, hi, n = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / n, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(Number(v.toFixed(10)));
  return out;
}
function legend(series) {
  return `<div class="legend">${series.map((s, i) => `<span><i style="background:${s.color || COLORS[i % COLORS.length]}"></i>${esc(s.name)}</span>`).join("")}</div>`;
}
// lineChart(xs, [{name, values}], {xLabel}) -> SVG markup; NaN/null points are skipped
function lineChart(xs, series, opt = {}) {
  const W = opt.width || 420, H = opt.height || 190, L = 46, R = 10, T = 8, B = 28;
  const vals = series.flatMap((s) => s.values).filter((v) => v !== null && Number.isFinite(v));
  if (!xs.length || !vals.length) return `<p class="muted">no data yet</p>`;
  let lo = Math.min(...vals), hi = Math.max(...vals);
  if (opt.zero !== false) lo = Math.min(lo, 0);
  if (lo === hi) hi = lo + 1;
  const xn = xs.map(Number), x0 = Math.min(...xn), x1 = Math.max(...xn);
  const sx = scale(x0, x1 === x0 ? x0 + 1 : x1, L, W - R), sy = scale(lo, hi, H - B, T);
  let g = "";
  for (const t of ticks(lo, hi, 4)) g += `<line class="grid" x1="${L}" x2="${W - R}" y1="${sy(t)}" y2="${sy(t)}"/><text x="${L - 4}" y="${sy(t) + 3}" text-anchor="end">${fmt(t)}</text>`;
  const xt = xs.length <= 12 ? xn : ticks(x0, x1, 6);
  for (const t of xt) g += `<text x="${sx(t)}" y="${H - B + 14}" text-anchor="middle">${fmt(t)}</text>`;
  g += `<line class="axis" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/><line class="axis" x1="${L}" x2="${L}" y1="${T}" y2="${H - B}"/>`;
  if (opt.xLabel) g += `<text x="${(L + W - R) / 2}" y="${H - 2}" text-anchor="middle">${esc(opt.xLabel)}</text>`;
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    const pts = xn.map((x, j) => [x, s.values[j]]).filter(([, v]) => v !== null && Number.isFinite(v));
    if (pts.length > 1) g += `<polyline fill="none" stroke="${color}" stroke-width="1.8" points="${pts.map(([x, v]) => `${sx(x)},${sy(v)}`).join(" ")}"/>`;
    if (pts.length <= 200) for (const [x, v] of pts) g += `<circle cx="${sx(x)}" cy="${sy(v)}" r="2.8" fill="${color}"><title>${esc(s.name)} @ ${fmt(x)}: ${fmt(v, 4)}</title></circle>`;
  });
  return `<svg viewBox="0 0 ${W} ${H}" width="100%" style="max-width:${W * 1.5}px">${g}</svg>${series.length > 1 ? legend(series) : ""}`;
}
// barChart(labels, [{name, values}]) -> grouped bars
function barChart(labels, series, opt = {}) {
  const W = opt.width || 420, H = opt.height || 190, L = 46, R = 10, T = 8, B = 34;
  const vals = series.flatMap((s) => s.values).filter((v) => v !== null && Number.isFinite(v));
  if (!labels.length || !vals.length) return `<p class="muted">no data yet</p>`;
  const lo = Math.min(0, ...vals), hi = Math.max(...vals, lo + 1e-9);
  const sy = scale(lo, hi, H - B, T), band = (W - L - R) / labels.length, bw = (band * 0.8) / series.length;
  let g = "";
  for (const t of ticks(lo, hi, 4)) g += `<line class="grid" x1="${L}" x2="${W - R}" y1="${sy(t)}" y2="${sy(t)}"/><text x="${L - 4}" y="${sy(t) + 3}" text-anchor="end">${fmt(t)}</text>`;
  labels.forEach((label, j) => {
    series.forEach((s, i) => {
      const v = s.values[j];
      if (v === null || !Number.isFinite(v)) return;
      const x = L + band * j + band * 0.1 + bw * i, y0 = sy(0), y1 = sy(v);
      g += `<rect x="${x}" y="${Math.min(y0, y1)}" width="${Math.max(bw - 1, 1)}" height="${Math.max(Math.abs(y0 - y1), 0.5)}" fill="${s.color || COLORS[i % COLORS.length]}"><title>${esc(label)} ${esc(s.name)}: ${fmt(v, 4)}</title></rect>`;
    });
    g += `<text x="${L + band * (j + 0.5)}" y="${H - B + 14}" text-anchor="middle">${esc(short(label, Math.max(4, Math.floor(band / 6))))}</text>`;
  });
  g += `<line class="axis" x1="${L}" x2="${W - R}" y1="${sy(0)}" y2="${sy(0)}"/>`;
  return `<svg viewBox="0 0 ${W} ${H}" width="100%" style="max-width:${W * 1.5}px">${g}</svg>${series.length > 1 ? legend(series) : ""}`;
}
function table(rows, columns, opt = {}) {
  const head = columns.map((c) => `<th class="${c.num ? "num" : ""}">${esc(c.label || c.key)}</th>`).join("");
  const body = rows.map((r) => `<tr>${columns.map((c) => {
    const v = r[c.key];
    const html = c.html ? c.html(r) : esc(c.fmt ? c.fmt(v) : fmt(v));
    return `<td class="${c.num ? "num" : ""}" data-col="${esc(c.key)}">${html}</td>`;
  }).join("")}</tr>`).join("");
  return `<table ${opt.id ? `id="${opt.id}"` : ""}><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}
const statusCell = (r) => `<span class="status-${esc(r.status)}">${esc(r.status)}</span>`;

// --- dashboard ---------------------------------------------------------------------------------

async function dashboard() {
  const views = ["reward_by_policy", "rollouts_by_status", "stages", "tokens_per_rollout", "staleness", "train_steps"];
  const [health, thr, lag, ...tables] = await Promise.all([api("/health"), api("/ui/api/throughput"), api("/ui/api/lag"), ...views.map((v) => api(`/reports/${v}`))]);
  const t = Object.fromEntries(views.map((v, i) => [v, rowsOf(tables[i])]));
  const statuses = t.rollouts_by_status;
  const total = statuses.reduce((a, r) => a + r.rollouts, 0);
  const running = statuses.filter((r) => r.status === "running").reduce((a, r) => a + r.rollouts, 0);
  const rp = t.reward_by_policy, last = rp[rp.length - 1];
  const samples = t.staleness.reduce((a, r) => a + r.samples, 0);
  const sink = health.sink || {};
  $("#namespace").textContent = `namespace ${health.namespace || "(default)"} · ${health.database}`;
  const steps = t.train_steps, lastStep = steps[steps.length - 1];
  const kpis = [
    ["rollouts", total], ["running", running], ["finished", total - running],
    ["pass rate (latest version)", last ? pct(last.pass_rate) : "–"],
    ["mean reward (latest version)", last ? fmt(last.mean_reward) : "–"],
    ["tokens/s (last 5 min)", thr.tokens_per_s === null ? "–" : fmt(thr.tokens_per_s)],
    ["consumer lag", lag.error ? "–" : lag.groups.reduce((a, g) => a + g.lag, 0)],
    ["samples", samples], ["policy versions", steps.length],
    ["sink dead letters", sink.dead_letters ?? "–"], ["trainer DLQ", lastStep ? fmt(lastStep.dlq) : "–"],
  ];
  const stageLabels = t.stages.map((r) => `${r.stage} ${r.job_id}`);
  main().innerHTML = `
  <h2>Dashboard</h2>
  <div class="kpis" id="kpis">${kpis.map(([k, v]) => `<div class="kpi" data-kpi="${esc(k)}"><div class="v">${esc(typeof v === "number" ? fmt(v) : v)}</div><div class="k">${esc(k)}</div></div>`).join("")}</div>
  <div class="grid">
    <div class="card"><h3>Reward and pass rate per policy version</h3>
      ${lineChart(rp.map((r) => r.policy_version), [{ name: "mean reward", values: rp.map((r) => r.mean_reward) }, { name: "pass rate", values: rp.map((r) => r.pass_rate) }], { xLabel: "policy version" })}
      ${table(rp, [{ key: "policy_version", label: "version", num: 1 }, { key: "rollouts", num: 1 }, { key: "mean_reward", label: "mean reward", num: 1 }, { key: "pass_rate", label: "pass rate", num: 1, fmt: pct }], { id: "reward-table" })}</div>
    <div class="card"><h3>Rollouts per status</h3>
      ${barChart(statuses.map((r) => r.status), [{ name: "rollouts", values: statuses.map((r) => r.rollouts) }])}
      ${table(statuses, [{ key: "status", html: statusCell }, { key: "rollouts", num: 1 }, { key: "share", num: 1, fmt: pct }], { id: "status-table" })}</div>
    <div class="card"><h3>Stage latencies (finished stages, ms)</h3>
      ${barChart(stageLabels, ["p50_ms", "p90_ms", "p99_ms"].map((k) => ({ name: k, values: t.stages.map((r) => r[k]) })))}
      ${table(t.stages, [{ key: "job_id", label: "job" }, { key: "stage" }, { key: "started", num: 1 }, { key: "finished", num: 1 }, { key: "failed", num: 1 }, { key: "timed_out", label: "timeout", num: 1 }, { key: "p50_ms", label: "p50", num: 1 }, { key: "p90_ms", label: "p90", num: 1 }, { key: "p99_ms", label: "p99", num: 1 }], { id: "stages-table" })}</div>
    <div class="card"><h3>Tokens per finished rollout</h3>
      ${lineChart(t.tokens_per_rollout.map((r) => r.policy_version), [{ name: "mean completion tokens", values: t.tokens_per_rollout.map((r) => r.mean_completion_tokens) }, { name: "mean unique tokens", values: t.tokens_per_rollout.map((r) => r.mean_unique_tokens) }], { xLabel: "policy version" })}
      ${table(t.tokens_per_rollout, [{ key: "policy_version", label: "version", num: 1 }, { key: "rollouts", num: 1 }, { key: "mean_llm_calls", label: "calls", num: 1 }, { key: "mean_completion_tokens", label: "completion", num: 1 }, { key: "p90_completion_tokens", label: "p90", num: 1 }, { key: "mean_unique_tokens", label: "unique", num: 1 }], { id: "tokens-table" })}</div>
    <div class="card"><h3>Sample staleness (versions behind at arrival)</h3>
      ${barChart(t.staleness.map((r) => String(r.staleness)), [{ name: "samples", values: t.staleness.map((r) => r.samples) }])}
      ${table(t.staleness, [{ key: "staleness", num: 1 }, { key: "samples", num: 1 }, { key: "share", num: 1, fmt: pct }], { id: "staleness-table" })}</div>
    <div class="card"><h3>Throughput (per minute, last hour of calls)</h3>
      ${lineChart(thr.minutes.map((_, i) => i - thr.minutes.length + 1), [{ name: "generated tokens / s", values: thr.minutes.map((r) => r.completion_tokens / 60) }, { name: "LLM calls / min", values: thr.minutes.map((r) => r.calls) }], { xLabel: "minutes before the newest call" })}
      <p class="muted" id="throughput-note">${thr.last_call ? `newest call ${esc(ts(thr.last_call))}; ${fmt(thr.recent_calls)} calls and ${fmt(thr.recent_tokens)} generated tokens in the ${thr.recent_s / 60} minutes before it` : "no LLM calls yet"}</p></div>
    <div class="card"><h3>Consumer lag (records behind, from Kafka)</h3>
      ${lag.error ? `<p class="muted" id="lag-error">lag unavailable: ${esc(lag.error)}</p>` : table(lag.groups, [{ key: "group" }, { key: "topic" }, { key: "partitions", num: 1 }, { key: "lag", num: 1 }], { id: "lag-table" })}</div>
    <div class="card"><h3>Dead letters</h3>
      ${table([{ where: "sink (this process)", n: sink.dead_letters ?? null }, { where: "trainer (latest step)", n: lastStep ? lastStep.dlq : null }], [{ key: "where" }, { key: "n", label: "records", num: 1 }], { id: "dlq-table" })}
      <p class="muted">Sink: records the store could not map or ClickHouse refused. Trainer: samples it could not decode.</p></div>
  </div>`;
}

// --- training ---------------------------------------------------------------------------------

async function training() {
  const steps = rowsOf(await api("/reports/train_steps"));
  const xs = steps.map((r) => r.trainer_step);
  const metrics = [["loss", "loss"], ["clip_frac", "clip fraction"], ["approx_kl", "approx KL"], ["entropy", "entropy"], ["grad_norm", "grad norm"], ["step_time_s", "step time (s)"]];
  const shown = metrics.filter(([k]) => k !== "entropy" || steps.some((r) => r.entropy !== null));
  main().innerHTML = `<h2>Training</h2>
  <p class="muted">One point per trainer step (a published policy version); ${steps.length} steps.</p>
  <div class="grid">${shown.map(([k, label]) => `<div class="card" data-metric="${k}"><h3>${esc(label)}</h3>${lineChart(xs, [{ name: label, values: steps.map((r) => r[k]) }], { xLabel: "trainer step", zero: false })}</div>`).join("")}</div>
  <div class="card" style="margin-top:14px"><h3>Steps</h3>${table(steps.slice().reverse(), [{ key: "trainer_step", label: "step", num: 1 }, { key: "policy_version", label: "version", num: 1 }, { key: "ts", fmt: ts }, { key: "samples_trained", label: "samples", num: 1 }, ...shown.map(([k, label]) => ({ key: k, label, num: 1 })), { key: "batch_tokens", label: "batch tokens", num: 1 }], { id: "steps-table" })}</div>`;
}

// --- rollout browser -----------------------------------------------------------------------------

const FILTERS = ["job", "task", "group", "status", "min_reward", "max_reward", "policy_version"];
let filterValues = null;

async function rollouts(params) {
  if (!filterValues) filterValues = await api("/ui/api/filters");
  const offset = Number(params.offset || 0), limit = 50;
  const data = await api(`/ui/api/rollouts${qs({ ...Object.fromEntries(FILTERS.map((f) => [f, params[f]])), offset, limit })}`);
  const select = (name, values) => `<select name="${name}"><option value="">any</option>${values.map((v) => `<option ${String(params[name] ?? "") === String(v) ? "selected" : ""}>${esc(v)}</option>`).join("")}</select>`;
  const input = (name, type = "text") => `<input name="${name}" type="${type}" ${type === "number" ? 'step="any"' : ""} value="${esc(params[name] ?? "")}">`;
  main().innerHTML = `<h2>Rollouts</h2>
  <form class="filters" id="filters">
    <label>job ${select("job", filterValues.jobs)}</label>
    <label>task ${select("task", filterValues.tasks)}</label>
    <label>group ${input("group")}</label>
    <label>status ${select("status", ["running", "completed", "failed", "timeout", "aborted", "truncated"])}</label>
    <label>reward ≥ ${input("min_reward", "number")}</label>
    <label>reward ≤ ${input("max_reward", "number")}</label>
    <label>policy version ${select("policy_version", filterValues.policy_versions)}</label>
    <button type="submit">Filter</button> <a href="#/rollouts">clear</a>
  </form>
  <div class="card">
    <div id="total" class="muted">${fmt(data.total)} rollouts match</div>
    ${table(data.rollouts, [
      { key: "rollout_id", label: "rollout", html: (r) => `<a href="#/rollout/${encodeURIComponent(r.rollout_id)}">${esc(short(r.rollout_id, 24))}</a>` },
      { key: "task_id", label: "task" },
      { key: "group_id", label: "group", html: (r) => `<a href="#/group/${encodeURIComponent(r.group_id)}">${esc(short(r.group_id, 18))}</a>` },
      { key: "job_id", label: "job" }, { key: "status", html: statusCell },
      { key: "policy_version", label: "version", num: 1 }, { key: "reward", num: 1 }, { key: "score", num: 1 },
      { key: "llm_calls", label: "calls", num: 1 }, { key: "completion_tokens", label: "tokens", num: 1 },
      { key: "started_ts", label: "started", fmt: ts }], { id: "rollouts-table" })}
    <div class="pager">
      ${offset > 0 ? `<a href="#/rollouts${qs({ ...params, offset: Math.max(0, offset - limit) })}">← newer</a>` : ""}
      <span class="muted">${data.total ? `${offset + 1}–${offset + data.rollouts.length} of ${fmt(data.total)}` : ""}</span>
      ${offset + limit < data.total ? `<a href="#/rollouts${qs({ ...params, offset: offset + limit })}">older →</a>` : ""}
    </div>
  </div>`;
  $("#filters").addEventListener("submit", (e) => {
    e.preventDefault();
    const f = Object.fromEntries(new FormData(e.target).entries());
    location.hash = `#/rollouts${qs(f)}`;
  });
}

async function group(id) {
  const data = await api(`/ui/api/group${qs({ group: id })}`);
  const advs = data.rollouts.map((r) => r.advantage).filter((v) => v !== null);
  const span = Math.max(1e-9, ...advs.map(Math.abs));
  main().innerHTML = `<h2>Group ${esc(id)}</h2>
  <p class="muted">${data.rollouts.length} rollouts · mean reward ${fmt(data.mean_reward)} · advantages are per rollout (every sample of a rollout carries its rollout's)</p>
  <div class="card" style="margin-bottom:12px">${barChart(data.rollouts.map((r) => short(r.rollout_id, 10)), [{ name: "advantage", values: data.rollouts.map((r) => r.advantage) }], { height: 150 })}</div>
  <div class="side" id="group-rollouts">${data.rollouts.map((r) => {
    const a = r.advantage, w = a === null ? 0 : (Math.abs(a) / span) * 50;
    return `<div class="card" data-rollout="${esc(r.rollout_id)}">
      <h3><a href="#/rollout/${encodeURIComponent(r.rollout_id)}">${esc(short(r.rollout_id, 26))}</a></h3>
      <div>${statusCell(r)} · task ${esc(r.task_id)} · v${esc(r.policy_version)}</div>
      <div>reward <b data-field="reward">${fmt(r.reward)}</b> · advantage <b data-field="advantage">${fmt(a)}</b></div>
      <div class="adv"><b style="left:${a < 0 ? 50 - w : 50}%;width:${w}%;background:${a < 0 ? "var(--bad)" : "var(--good)"}"></b></div>
      ${r.samples.length ? table(r.samples, [{ key: "sample_id", label: "sample", fmt: (v) => short(v, 10) }, { key: "mode" }, { key: "num_tokens", label: "tokens", num: 1 }, { key: "num_loss_tokens", label: "trained", num: 1 }, { key: "loss_weight", label: "weight", num: 1 }]) : '<p class="muted">no samples</p>'}
    </div>`;
  }).join("")}</div>`;
}

// --- trajectory tree viewer ---------------------------------------------------------------------

function layoutTree(nodes) {
  const kids = new Map(), byId = new Map(nodes.map((n) => [n.call_id, n]));
  const roots = [];
  for (const n of nodes) {
    if (n.parent && byId.has(n.parent)) { if (!kids.has(n.parent)) kids.set(n.parent, []); kids.get(n.parent).push(n); }
    else roots.push(n);
  }
  const pos = new Map();
  let row = 0, lanes = 0;
  const stack = roots.slice().reverse().map((n) => [n, -1]);
  while (stack.length) {
    const [n, lane] = stack.pop();
    const l = lane >= 0 ? lane : lanes++;
    pos.set(n.call_id, { row: row++, lane: l });
    const ch = kids.get(n.call_id) || [];
    for (let i = ch.length - 1; i >= 0; i--) stack.push([ch[i], i === 0 ? l : -1]);
  }
  // lanes opened by later children are numbered as they are reached (pre-order)
  return { pos, lanes: Math.max(lanes, 1) };
}

// The call tree is drawn lazily: only the rows in (and near) the scrolled window of the #tree
// card are in the DOM, redrawn on scroll, so a 1,000-call tree costs as much as a 100-call one.
const TREE_ROW = 22, TREE_OVERSCAN = 30;

function treeRows(nodes, pos, lo, hi, selected, lanes) {
  const RH = TREE_ROW, LW = 16, X0 = 12, labelX = X0 + lanes * LW + 8;
  const cx = (p) => X0 + p.lane * LW, cy = (p) => 12 + p.row * RH;
  const edges = [], marks = [], labels = [];
  for (const n of nodes) {
    const p = pos.get(n.call_id);
    const from = n.parent ? pos.get(n.parent) : n.raw_parent ? pos.get(n.raw_parent) : null;
    if (from && Math.max(from.row, p.row) >= lo && Math.min(from.row, p.row) <= hi) {
      const dash = n.link === "rewind" || n.link === "subagent" ? ' stroke-dasharray="4 3"' : "";
      const color = LINK_COLORS[n.link] || "#999";
      const d = from.lane === p.lane ? `M${cx(from)},${cy(from)} L${cx(p)},${cy(p)}` : `M${cx(from)},${cy(from)} C${cx(from)},${cy(p) - RH / 2} ${cx(p)},${cy(from) + RH / 2} ${cx(p)},${cy(p)}`;
      edges.push(`<path d="${d}" fill="none" stroke="${color}" stroke-width="1.4"${dash}/>`);
    }
    if (p.row < lo || p.row > hi) continue;
    const sel = n.call_id === selected;
    const reward = n.rewards.reduce((a, r) => a + (r.value || 0), 0);
    const badges = [
      n.rewards.length ? `★${fmt(reward)}` : "",
      n.tools.length ? `⚙${n.tools.length}` : "",
      n.drift_tokens ? `drift ${n.drift_tokens}` : "",
      n.link !== "append" && n.link !== "root" ? n.link : "",
      n.branches.length ? `${n.branches.map((b) => b.kind).join(",")} here` : "",
    ].filter(Boolean).join("  ");
    if (sel) marks.push(`<rect class="sel-row" x="0" y="${cy(p) - RH / 2}" width="100%" height="${RH}"/>`);
    labels.push(`<g class="node${sel ? " selected" : ""}" data-call="${esc(n.call_id)}" data-link="${esc(n.link)}" data-rewards="${n.rewards.length}">
      <circle cx="${cx(p)}" cy="${cy(p)}" r="5.5" fill="${LINK_COLORS[n.link] || "#999"}" ${n.drift_tokens ? 'stroke="#c8382d" stroke-width="2"' : ""}><title>${esc(n.call_id)} (${esc(n.link)})</title></circle>
      <text x="${labelX}" y="${cy(p) + 4}">${esc(tail(n.call_id, 22))}  <tspan fill="#8a929c">${n.prompt_len}+${n.completion_len} tok · v${n.policy_version}</tspan>  <tspan fill="#a06a00">${esc(badges)}</tspan></text>
      <rect x="0" y="${cy(p) - RH / 2}" width="100%" height="${RH}" fill="transparent"/></g>`);
  }
  return marks.join("") + edges.join("") + labels.join("");
}

// treeView(box, nodes, selected): draws the tree into the scrolling card `box`, the selected
// call scrolled into view; returns { select(call) }.
function treeView(box, nodes, selected) {
  const { pos, lanes } = layoutTree(nodes);
  const labelX = 12 + lanes * 16 + 8, H = nodes.length * TREE_ROW + 10;
  box.innerHTML = `<svg id="tree-svg" width="100%" height="${H}" data-nodes="${nodes.length}" style="min-width:${labelX + 320}px"></svg>`;
  const svg = box.firstElementChild;
  let drawn = null, pending = false;
  const draw = (force) => {
    pending = false;
    const top = box.scrollTop, height = box.clientHeight || 800;
    const lo = Math.max(0, Math.floor(top / TREE_ROW) - TREE_OVERSCAN);
    const hi = Math.ceil((top + height) / TREE_ROW) + TREE_OVERSCAN;
    if (!force && drawn && lo >= drawn[0] && hi <= drawn[1]) return;
    // draw a wider window than needed, so small scrolls need no redraw
    drawn = [Math.max(0, lo - TREE_OVERSCAN), hi + TREE_OVERSCAN];
    svg.innerHTML = treeRows(nodes, pos, drawn[0], drawn[1], selected, lanes);
  };
  box.addEventListener("scroll", () => { if (!pending) { pending = true; requestAnimationFrame(() => draw(false)); } });
  const reveal = () => { // scroll the selected row into view when it is out of it
    const p = pos.get(selected), y = p ? p.row * TREE_ROW : 0;
    if (p && (y < box.scrollTop || y + TREE_ROW > box.scrollTop + box.clientHeight)) box.scrollTop = y - box.clientHeight / 2;
  };
  reveal();
  draw(true);
  return { select(call) { selected = call; reveal(); draw(true); } };
}

function nodeDetail(n) {
  if (!n) return "";
  const tools = n.tools.map((t) => `<div class="tool" data-tool="${esc(t.tool_call_id)}"><b>${esc(t.name)}</b> ${t.is_error ? '<span class="pill drift">error</span>' : ""}<span class="muted">${fmt(t.duration_ms)} ms${t.anchored ? "" : " · after this call"}</span>
    <div class="muted">arguments</div><pre>${esc(t.arguments)}</pre><div class="muted">result${t.truncated ? " (truncated)" : ""}</div><pre>${esc(t.result)}</pre></div>`).join("");
  const rewards = n.rewards.map((r) => `<span class="pill reward">${esc(r.kind)} ${esc(r.name)} ${fmt(r.value)}</span>`).join("");
  const branches = n.branches.map((b) => `<span class="pill">${esc(b.kind)} ${esc(b.branch_id)} ${esc(b.reason)}</span>`).join("");
  return `<h3>Call ${esc(n.call_id)} <span class="pill link-${esc(n.link)}">${esc(n.link)}</span></h3>
    <div class="muted">parent ${esc(n.parent || "–")}${n.raw_parent && n.raw_parent !== n.parent ? ` (recorded parent ${esc(n.raw_parent)})` : ""} · prefix ${n.prefix_len} · prompt +${n.prompt_len} · completion ${n.completion_len} · v${n.policy_version} · ${esc(n.finish_reason)} · ${esc(n.model)} ${esc(n.backend)} · ${fmt(n.latency_ms)} ms${n.drift_tokens ? ` · <span class="pill drift">drift ${n.drift_tokens} tokens</span>` : ""}</div>
    <div>${rewards}${branches}</div>${tools}`;
}

// The token view draws TOKEN_CHUNK tokens at a time: more as the #tokens box is scrolled to
// its end (the page of tokens is fetched whole; only the drawing is lazy).
const TOKEN_CHUNK = 600;

function tokenSpans(data, drift, from, to) {
  let html = "";
  for (let i = from; i < to; i++) {
    const s = data.segment[i], seg = data.segments[s], m = data.mask[i];
    const cls = ["tok", seg.kind === "unknown" ? "unk" : `m${m}`];
    if (drift.has(seg.call_id)) cls.push("drift");
    if (i === 0 || s !== data.segment[i - 1]) cls.push("seg-start");
    const lp = data.logprobs[i];
    html += ` <span class="${cls.join(" ")}" title="${esc(`${seg.call_id} ${seg.kind} · mask ${m}${lp === null ? "" : ` · logprob ${fmt(lp, 4)}`}`)}">${data.ids[i]}</span>`;
  }
  return html;
}

function tokenView(data) {
  const end = data.offset + data.ids.length;
  return `<div class="muted" id="token-summary">path ${data.path.map((c) => esc(short(c, 12))).join(" → ")} · ${fmt(data.length)} tokens, <b>${fmt(data.trained_tokens)}</b> trained (mask 1) · showing ${fmt(data.offset)}–${fmt(end)}${data.drift_calls.length ? ` · <span class="pill drift">drift in ${data.drift_calls.map(esc).join(", ")}</span>` : ""}</div>
    <div class="legend"><span><i style="background:#edf0f3"></i>prompt (mask 0, not trained)</span><span><i style="background:#d6f2e1"></i>completion (mask 1, trained; hover: behaviour logprob)</span><span><i style="background:#fff;box-shadow:inset 0 -2px 0 #c8382d"></i>call with retokenization drift</span></div>
    <div class="tokens" id="tokens"></div>
    ${end < data.length ? `<button id="more-tokens" data-offset="${end}">next tokens →</button>` : ""}`;
}

// fills the #tokens box of tokenView(data) a chunk at a time: the first chunks now, the rest
// when the box is scrolled near its end
function drawTokens(box, data) {
  const drift = new Set(data.drift_calls), n = data.ids.length;
  let done = 0;
  const more = () => {
    const to = Math.min(n, done + TOKEN_CHUNK);
    box.insertAdjacentHTML("beforeend", tokenSpans(data, drift, done, to));
    done = to;
  };
  const fill = () => { while (done < n && box.scrollTop + box.clientHeight >= box.scrollHeight - 200) more(); };
  more();
  fill();
  box.addEventListener("scroll", fill, { passive: true });
}

async function trajectory(id, params) {
  const data = await api(`/ui/api/trajectory${qs({ rollout: id })}`);
  const r = data.rollout;
  const byId = new Map(data.nodes.map((n) => [n.call_id, n]));
  let selected = params.call && byId.has(params.call) ? params.call : (data.nodes[data.nodes.length - 1] || {}).call_id;
  const tokenPage = (call, offset) => api(`/ui/api/tokens${qs({ rollout: id, call, offset, limit: 4000 })}`);
  const firstPage = selected ? tokenPage(selected, 0) : null; // asked for while the tree is drawn
  if (firstPage) firstPage.catch(() => {}); // shown (error included) by showTokens
  const counts = {};
  for (const n of data.nodes) counts[n.link] = (counts[n.link] || 0) + 1;
  main().innerHTML = `<h2>Rollout ${esc(id)}</h2>
  <div class="kpis">
    ${[["status", `<span class="status-${esc(r.status)}">${esc(r.status)}</span>`], ["task", esc(r.task_id)], ["group", `<a href="#/group/${encodeURIComponent(r.group_id)}">${esc(short(r.group_id, 20))}</a>`], ["reward", fmt(r.reward)], ["score", fmt(r.score)], ["policy version", fmt(r.policy_version)], ["calls", fmt(data.nodes.length)], ["job", esc(r.job_id || "–")]].map(([k, v]) => `<div class="kpi"><div class="v">${v}</div><div class="k">${k}</div></div>`).join("")}
  </div>
  <p class="muted">${data.rebuilt ? "tree rebuilt by the trajectory builder" : "no trajectory yet (running): the tree of the recorded calls"} · ${Object.entries(counts).map(([k, v]) => `<span class="pill link-${esc(k)}">${esc(k)} ${v}</span>`).join("")}${r.error ? ` · error: ${esc(r.error)}` : ""}</p>
  <div class="traj">
    <div class="card tree" id="tree"></div>
    <div>
      <div class="card" id="node-detail"></div>
      <div class="card" style="margin-top:12px"><h3>Tokens of the path to the selected call</h3><div id="token-view" class="muted">select a call</div></div>
    </div>
  </div>
  ${data.unplaced.length ? `<div class="card" style="margin-top:12px"><h3>Events not at a call</h3>${data.unplaced.map((u) => u.kind_of === "reward" ? `<span class="pill reward">${esc(u.kind)} ${esc(u.name)} ${fmt(u.value)}</span>` : u.name ? `<span class="pill">tool ${esc(u.name)}</span>` : `<span class="pill">branch ${esc(u.kind)}</span>`).join("")}</div>` : ""}
  <div class="card" id="samples-card" style="margin-top:12px"><h3>Samples this tree produced</h3>${data.samples.length ? table(data.samples, [{ key: "sample_id", label: "sample", fmt: (v) => short(v, 16) }, { key: "mode" }, { key: "leaf_id", label: "leaf", html: (s) => byId.has(s.leaf_id) ? `<a href="#" data-goto="${esc(s.leaf_id)}">${esc(s.leaf_id)}</a>` : esc(s.leaf_id) }, { key: "advantage", num: 1 }, { key: "reward", num: 1 }, { key: "loss_weight", label: "weight", num: 1 }, { key: "num_tokens", label: "tokens", num: 1 }, { key: "num_loss_tokens", label: "trained", num: 1 }, { key: "min_policy_version", label: "min version", num: 1 }], { id: "samples-table" }) : '<p class="muted">none (yet)</p>'}</div>`;

  const tree = treeView($("#tree"), data.nodes, selected);
  let shown = 0; // the latest token request wins
  async function showTokens(request) {
    const view = $("#token-view"), mine = ++shown;
    try {
      const t = await request;
      if (mine !== shown) return;
      view.classList.remove("muted");
      view.innerHTML = tokenView(t);
      drawTokens($("#tokens"), t);
      const more = $("#more-tokens");
      if (more) more.addEventListener("click", () => showTokens(tokenPage(selected, Number(more.dataset.offset))));
    } catch (err) { if (mine === shown && !(err instanceof Stale)) view.textContent = err.message; }
  }
  async function select(call, request) {
    selected = call;
    tree.select(call);
    $("#node-detail").innerHTML = nodeDetail(byId.get(call));
    if (!call) return;
    await showTokens(request || tokenPage(call, 0));
  }
  $("#tree").addEventListener("click", (e) => {
    const g = e.target.closest(".node");
    if (g) select(g.dataset.call);
  });
  $("#samples-card").addEventListener("click", (e) => {
    const a = e.target.closest("[data-goto]");
    if (a) { e.preventDefault(); select(a.dataset.goto); }
  });
  await select(selected, firstPage);
}

// --- routing, live refresh ----------------------------------------------------------------------

let timer = null, generation = 0;

function parseHash() {
  const [path, query] = (location.hash.slice(1) || "/").split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), params: Object.fromEntries(new URLSearchParams(query || "")) };
}

async function route() {
  const gen = ++generation;
  clearTimeout(timer);
  const { parts, params } = parseHash();
  const page = parts[0] || "dashboard";
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === page || (page === "rollout" || page === "group") && a.dataset.nav === "rollouts"));
  const pages = {
    dashboard: [dashboard, true], training: [training, true], rollouts: [() => rollouts(params), true],
    rollout: [() => trajectory(parts[1], params), false], group: [() => group(parts[1]), true],
  };
  const [render, live] = pages[page] || pages.dashboard;
  const typing = () => document.activeElement && document.activeElement.closest && document.activeElement.closest("form");
  const tick = async (first) => {
    try {
      if (!first && typing()) { timer = setTimeout(tick, POLL_MS); return; } // never redraw under the cursor
      await render();
      if (gen !== generation) return;
      showError(null);
      $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
      document.body.dataset.loaded = page;
    } catch (err) { showError(err); }
    if (live && gen === generation) timer = setTimeout(tick, POLL_MS);
  };
  await tick(true);
}

async function start() {
  try {
    const h = await api("/health");
    if (h.namespace !== undefined) $("#namespace").textContent = `namespace ${h.namespace || "(default)"} · ${h.database}`;
  } catch (err) { showError(err); }
  window.addEventListener("hashchange", route);
  route();
}
start();
