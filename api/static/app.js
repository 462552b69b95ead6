// omlx-jobs web page: renders /api/jobs, /api/jobs/{id} and /api/workers and refreshes itself.
// Everything is built with DOM calls and textContent (no HTML from data); every request goes to this origin.
"use strict";

const KEY_SLOT = "omlx-jobs-api-key";
const REFRESH_MS = Number(document.querySelector('meta[name="omlx-refresh-ms"]').content) || 2000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let timer = null;

class NeedKey extends Error {}

async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY_SLOT);
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(path, { ...options, headers, credentials: "omit", cache: "no-store" });
  if (response.status === 401) throw new NeedKey();
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) return seconds + "s";
  if (seconds < 3600) return Math.floor(seconds / 60) + "m " + (seconds % 60) + "s";
  if (seconds < 86400) return Math.floor(seconds / 3600) + "h " + Math.floor((seconds % 3600) / 60) + "m";
  return Math.floor(seconds / 86400) + "d " + Math.floor((seconds % 86400) / 3600) + "h";
}

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }

function progressCell(done, total, progress) {
  const td = el("td");
  const bar = el("progress");
  bar.max = 1;
  bar.value = progress;
  td.append(bar, el("span", " " + done + "/" + total + " (" + pct(progress) + ")"));
  return td;
}

function statusBadge(status) { return el("span", status, "status " + status); }

function renderJobs(data) {
  const body = $("jobs").tBodies[0];
  body.replaceChildren();
  for (const job of data.jobs) {
    const tr = el("tr");
    tr.dataset.jobId = job.id;
    const link = el("a", job.id);
    link.href = "/jobs/" + encodeURIComponent(job.id);
    const idCell = el("td");
    idCell.append(link);
    const statusCell = el("td");
    statusCell.append(statusBadge(job.status));
    tr.append(idCell, statusCell, progressCell(job.done, job.total, job.progress), el("td", job.model), el("td", duration(job.age_seconds)));
    body.append(tr);
  }
  $("no-jobs").hidden = data.jobs.length > 0;
}

function renderWorkers(data) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of data.workers) {
    const tr = el("tr");
    tr.dataset.worker = w.name;
    const beat = w.last_heartbeat ? duration(data.now - w.last_heartbeat) + " ago" : "never";
    tr.append(el("td", w.name), el("td", w.state), el("td", w.models.join(", ")), el("td", w.current_job || "–"), el("td", beat));
    body.append(tr);
  }
  $("no-workers").hidden = data.workers.length > 0;
  $("workers-error").textContent = data.error || "";
}

function stat(dl, name, value) { dl.append(el("dt", name), el("dd", value)); }

function renderJob(job) {
  document.title = "omlx-jobs · " + job.id;
  $("job-title").textContent = job.id;
  $("job-status").replaceWith(Object.assign(statusBadge(job.status), { id: "job-status" }));
  $("job-model").textContent = job.model;
  const rc = job.request_counts;
  const done = rc.completed + rc.failed + rc.cancelled;
  $("job-progress").value = job.progress;
  $("job-progress-text").textContent = done + " / " + rc.total + " requests (" + pct(job.progress) + ")";
  $("job-eta").textContent = job.eta_seconds !== null ? "ETA " + duration(job.eta_seconds) : "";
  const dl = $("job-stats");
  dl.replaceChildren();
  stat(dl, "requests", rc.completed + " completed, " + rc.failed + " failed, " + rc.cancelled + " cancelled, " + rc.pending + " pending");
  const u = job.usage;
  stat(dl, "tokens", "prompt " + u.prompt_tokens + " (cached " + u.prompt_tokens_details.cached_tokens + "), generated " + u.completion_tokens);
  const t = job.throughput;
  stat(dl, "throughput", t.completion_tokens_per_second + " generated tok/s, " + t.requests_per_second + " req/s over " + duration(t.elapsed_seconds));
  stat(dl, "cache-hit share", pct(job.cache.cached_token_share) + " of prompt tokens cached; " + pct(job.cache.hit_share) + " of prefix lookups hit");
  const eff = job.cache.computed_over_minimum;
  const p = job.prefix;
  // Workers add the prompt tokens they computed when a shard ends, so a running first shard shows none yet.
  const pendingCount = !job.terminal && p.prefill_tokens_computed === 0;
  stat(dl, "computed ÷ minimum", eff === null || pendingCount
    ? "– (counted as shards finish; minimum " + p.trie_min_tokens + " prompt tokens)"
    : eff.toFixed(3) + "× (" + p.prefill_tokens_computed + " / " + p.trie_min_tokens + " prompt tokens)");
  drawPlot($("throughput-plot"), job.throughput_series);
  const errors = $("errors").tBodies[0];
  errors.replaceChildren();
  for (const e of job.first_errors) {
    const tr = el("tr");
    tr.append(el("td", e.line, "num"), el("td", e.custom_id), el("td", e.code), el("td", e.message));
    errors.append(tr);
  }
  $("no-errors").hidden = job.first_errors.length > 0;
  const cancel = $("cancel");
  cancel.hidden = !job.cancellable;
  cancel.disabled = false;
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function drawPlot(svg, series) {
  svg.replaceChildren();
  const W = 720, H = 240, L = 56, R = 12, T = 24, B = 30;
  const pw = W - L - R, ph = H - T - B;
  if (!series.length) {
    svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no finished requests yet"));
    svg.dataset.points = "0";
    return;
  }
  const t0 = series[0].t;
  const span = Math.max(series[series.length - 1].t + series[series.length - 1].seconds - t0, 1);
  const ymax = niceMax(Math.max(...series.map((b) => Math.max(b.prompt_tps, b.completion_tps))));
  const x = (t) => L + (pw * (t - t0)) / span;
  const y = (v) => T + ph - (ph * v) / ymax;
  for (const f of [0, 0.5, 1]) {
    svg.append(svgEl("line", { x1: L, x2: L + pw, y1: y(ymax * f), y2: y(ymax * f), class: f ? "grid" : "axis" }));
    svg.append(svgEl("text", { x: L - 6, y: y(ymax * f) + 4, "text-anchor": "end" }, Math.round(ymax * f)));
  }
  svg.append(svgEl("line", { x1: L, x2: L, y1: T, y2: T + ph, class: "axis" }));
  svg.append(svgEl("text", { x: L, y: H - 8 }, "0"));
  svg.append(svgEl("text", { x: L + pw, y: H - 8, "text-anchor": "end" }, duration(span)));
  svg.append(svgEl("text", { x: 8, y: 14 }, "tokens / s"));
  for (const [key, cls, label, lx] of [["prompt_tps", "series-prompt", "prompt", 420], ["completion_tps", "series-completion", "generated", 560]]) {
    const points = series.map((b) => x(b.t + b.seconds / 2).toFixed(1) + "," + y(b[key]).toFixed(1)).join(" ");
    svg.append(svgEl("polyline", { points, class: cls }));
    svg.append(svgEl("rect", { x: lx, y: 6, width: 12, height: 12, class: "legend-" + cls.split("-")[1] }));
    svg.append(svgEl("text", { x: lx + 16, y: 16 }, label + " tok/s"));
  }
  svg.dataset.points = String(series.length);
}

function route() {
  const m = location.pathname.match(/^\/jobs\/([^/]+)$/);
  return m ? { view: "job", id: decodeURIComponent(m[1]) } : { view: "list" };
}

async function refresh() {
  clearTimeout(timer);
  const r = route();
  try {
    if (r.view === "job") {
      renderJob(await api("/api/jobs/" + encodeURIComponent(r.id)));
      $("job-view").hidden = false;
    } else {
      renderJobs(await api("/api/jobs"));
      $("list-view").hidden = false;
    }
    renderWorkers(await api("/api/workers"));
    $("workers-view").hidden = false;
    $("auth").hidden = true;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "1";
  } catch (err) {
    if (err instanceof NeedKey) {
      $("auth").hidden = false;
      $("auth-error").textContent = sessionStorage.getItem(KEY_SLOT) ? "That key was refused." : "";
      return; // no refresh until a key is given
    }
    $("updated").textContent = "refresh failed: " + err.message;
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

$("auth-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_SLOT, $("auth-key").value.trim());
  $("auth-key").value = "";
  refresh();
});

$("cancel").addEventListener("click", async () => {
  const r = route();
  if (!confirm("Cancel " + r.id + "? Finished results are kept.")) return;
  $("cancel").disabled = true;
  try {
    renderJob(await api("/api/jobs/" + encodeURIComponent(r.id) + "/cancel", { method: "POST" }));
  } catch (err) {
    $("updated").textContent = "cancel failed: " + err.message;
  }
});

document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
refresh();
