// omlx-jobs web page: renders /api/jobs, /api/jobs/{id} (with its requests) and /api/workers, and refreshes itself.
// Everything is built with DOM calls and textContent (no HTML from data); every request goes to this origin.
// Plots are uPlot (vendored: /static/uPlot.iife.min.js, MIT); styles are set through the CSSOM only (strict CSP).
"use strict";

const KEY_SLOT = "omlx-jobs-api-key";
const REFRESH_MS = Number(document.querySelector('meta[name="omlx-refresh-ms"]').content) || 2000;
const $ = (id) => document.getElementById(id);
let timer = null;

class NeedKey extends Error {}
class Missing extends Error {}

async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY_SLOT);
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(path, { ...options, headers, credentials: "omit", cache: "no-store" });
  if (response.status === 401) throw new NeedKey();
  const body = await response.json();
  if (response.status === 404 && body.error && body.error.code === "job_not_found") throw new Missing(body.error.message);
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

// ---- small helpers -------------------------------------------------------------------------------------

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function link(text, href, cls) {
  const a = el("a", text, cls);
  a.href = href;
  return a;
}

function cell(child, cls) {
  const td = el("td", null, cls);
  td.append(child);
  return td;
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
function num(x) { return x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US"); }
function rate(x) { return Number(x || 0).toLocaleString("en-US", { maximumFractionDigits: x >= 100 ? 0 : 1 }); }

function statusBadge(status, id) {
  const span = el("span", status, "status " + status);
  if (id) span.id = id;
  return span;
}

const ENDED_SHORT = new Set(["failed", "cancelled", "expired"]);

// A bar of three colours: completed, failed, cancelled; what is left (pending) stays empty.
function bar(counts, total, big) {
  const div = el("div", null, "bar" + (big ? " big" : ""));
  for (const part of ["completed", "failed", "cancelled"]) {
    const n = counts[part] || 0;
    div.dataset[part] = String(n);
    if (!n || !total) continue;
    const seg = el("span", null, part);
    seg.style.width = (100 * n / total).toFixed(3) + "%";
    div.append(seg);
  }
  div.title = ["completed", "failed", "cancelled", "pending"].map((p) => num(counts[p] || 0) + " " + p).join(", ");
  div.setAttribute("aria-label", div.title);
  return div;
}

function progressText(counts, total, status) {
  const done = counts.completed + counts.failed + counts.cancelled;
  const extra = ["failed", "cancelled"].filter((p) => counts[p]).map((p) => num(counts[p]) + " " + p);
  if (ENDED_SHORT.has(status)) {
    return num(counts.completed) + " / " + num(total) + " completed" + (extra.length ? ", " + extra.join(", ") : "");
  }
  const share = total ? " (" + pct(done / total) + ")" : "";
  return num(done) + " / " + num(total) + " requests" + share + (extra.length ? ": " + extra.join(", ") : "");
}

// ---- plots (uPlot) --------------------------------------------------------------------------------------

const plots = {};
const xRanges = {}; // each plot's x range, read by its scale at every redraw (a plot is made once, then fed data)

function plotWidth(container) { return Math.max(240, container.clientWidth - 10); }

function drawPlot(id, opts, data, emptyText, xRange) {
  xRanges[id] = xRange;
  opts.scales.x = { ...(opts.scales.x || {}), range: () => xRanges[id] };
  const container = $(id);
  const points = data[0].length;
  container.dataset.points = String(points);
  if (!points || typeof uPlot === "undefined") {
    if (plots[id]) { plots[id].destroy(); delete plots[id]; }
    container.replaceChildren(el("div", typeof uPlot === "undefined" ? "plot library missing" : emptyText, "empty"));
    return;
  }
  const width = plotWidth(container);
  const plot = plots[id];
  if (plot && plot.series.length === opts.series.length && plot.key === opts.key) {
    if (plot.width !== width) plot.setSize({ width, height: opts.height });
    plot.setData(data);
    return;
  }
  if (plot) plot.destroy();
  container.replaceChildren();
  plots[id] = new uPlot({ ...opts, width }, data, container);
  plots[id].key = opts.key;
}

function drawThroughput(series) {
  const x = series.map((b) => b.t + b.seconds / 2);
  const lo = series.length ? series[0].t : 0;
  const hi = series.length ? series[series.length - 1].t + series[series.length - 1].seconds : 1;
  const opts = {
    key: "throughput",
    height: 240,
    series: [
      {},
      { label: "prompt tok/s", stroke: "#1f6feb", width: 2, value: (u, v) => (v === null ? "–" : rate(v)) },
      { label: "generated tok/s", stroke: "#d4622a", width: 2, value: (u, v) => (v === null ? "–" : rate(v)) },
    ],
    legend: { live: false },
    axes: [{}, { label: "tokens / s", size: 60 }],
    scales: {
      y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] },
    },
  };
  // The job's span, not uPlot's guess around a single point.
  drawPlot("throughput-plot", opts, [x, series.map((b) => b.prompt_tps), series.map((b) => b.completion_tps)],
    "no tokens counted yet", [lo, Math.max(hi, lo + 10)]);
}

function bars() { return typeof uPlot === "undefined" ? undefined : uPlot.paths.bars({ size: [0.92, Infinity] }); }

function drawHistogram(id, bins, label, colour, emptyText) {
  const lo = bins.length ? bins[0].lo : 0;
  const hi = bins.length ? bins[bins.length - 1].hi : 1;
  const opts = {
    key: "hist",
    height: 150,
    title: label,
    legend: { show: false },
    scales: {
      x: { time: false },
      y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] },
    },
    series: [{}, { label: "requests", stroke: colour, fill: colour + "99", paths: bars(), points: { show: false } }],
    axes: [{ label: "tokens" }, { label: "requests", size: 50 }],
  };
  drawPlot(id, opts, [bins.map((b) => (b.lo + b.hi) / 2), bins.map((b) => b.count)], emptyText, [lo, hi]);
}

// ---- the job list -----------------------------------------------------------------------------------------

const list = { cursors: [null], filters: { status: "", model: "", q: "" } };

function fillSelect(select, values, current) {
  const keep = select.options[0];
  select.replaceChildren(keep);
  for (const v of values) {
    const opt = el("option", v);
    opt.value = v;
    select.append(opt);
  }
  select.value = current || "";
}

function renderJobs(data) {
  const body = $("jobs").tBodies[0];
  body.replaceChildren();
  for (const job of data.jobs) {
    const tr = el("tr");
    tr.dataset.jobId = job.id;
    const progress = el("div", null, "cell-progress");
    const text = job.total === 0 && job.input_errors ? "rejected: " + num(job.input_errors) + " bad line(s)"
      : progressText(job, job.total, job.status);
    progress.append(bar(job, job.total), el("span", text));
    tr.append(cell(link(job.id, "/jobs/" + encodeURIComponent(job.id)), "id"), cell(statusBadge(job.status)),
      cell(progress), el("td", job.model), el("td", duration(job.age_seconds)));
    body.append(tr);
  }
  $("no-jobs").hidden = data.jobs.length > 0;
  $("no-jobs").textContent = list.filters.status || list.filters.model || list.filters.q ? "No job matches." : "No jobs yet.";
  if (!$("filter-status").dataset.filled) {
    fillSelect($("filter-status"), data.statuses, list.filters.status);
    $("filter-status").dataset.filled = "1";
  }
  if (document.activeElement !== $("filter-model")) fillSelect($("filter-model"), data.models, list.filters.model);
  list.next = data.next;
  $("jobs-older").hidden = !data.next;
  $("jobs-newer").hidden = list.cursors.length <= 1;
}

function jobsQuery() {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(list.filters)) if (v) p.set(k, v);
  const before = list.cursors[list.cursors.length - 1];
  if (before) p.set("before", before);
  return "/api/jobs?" + p.toString();
}

// ---- one job ------------------------------------------------------------------------------------------------

const req = { status: "", outcome: "", q: "", after: null, before: null, rows: [] };

function stat(dl, name, value) { dl.append(el("dt", name), el("dd", value)); }

function renderLive(job) {
  const eta = job.eta || {};
  const etaEl = $("job-eta");
  etaEl.dataset.state = eta.state || "";
  etaEl.dataset.seconds = eta.eta_seconds === null || eta.eta_seconds === undefined ? "" : String(eta.eta_seconds);
  if (job.terminal) etaEl.textContent = "";
  else if (eta.state === "tokens") etaEl.textContent = "ETA " + duration(eta.eta_seconds);
  else if (eta.state === "stalled") etaEl.textContent = "ETA – (no tokens in the last seconds)";
  else if (eta.state === "done") etaEl.textContent = "finishing";
  else etaEl.textContent = "ETA estimating…";
  const live = job.live || {};
  const now = $("job-now");
  now.dataset.prompt = String(live.prompt_tokens_per_second || 0);
  now.dataset.generated = String(live.generated_tokens_per_second || 0);
  now.dataset.inflight = String(live.requests_in_flight || 0);
  now.textContent = job.terminal ? "" : "now: prompt " + rate(live.prompt_tokens_per_second) + " tok/s · generated " +
    rate(live.generated_tokens_per_second) + " tok/s · " + num(live.requests_in_flight) + " in flight on " +
    (live.workers || []).length + " worker(s)";
}

function renderStats(job) {
  const rc = job.request_counts;
  const dl = $("job-stats");
  dl.replaceChildren();
  stat(dl, "requests", num(rc.completed) + " completed, " + num(rc.failed) + " failed, " + num(rc.cancelled) +
    " cancelled, " + num(rc.pending) + " pending");
  const u = job.usage;
  stat(dl, "tokens", "prompt " + num(u.prompt_tokens) + " (cached " + num(u.prompt_tokens_details.cached_tokens) +
    "), generated " + num(u.completion_tokens) + " (finished requests)");
  const live = job.live || {};
  stat(dl, "counted live", "prompt " + num(live.prefilled_tokens) + " computed, " + num(live.generated_tokens) +
    " generated over " + duration(live.counted_seconds));
  const t = job.throughput;
  // A job that generates nothing (embeddings) is rated by the prompt tokens it embedded.
  const embedded = u.completion_tokens === 0 && u.prompt_tokens > 0;
  const avg = embedded ? t.prompt_tokens_per_second + " embedded tok/s, " : t.completion_tokens_per_second + " generated tok/s, ";
  stat(dl, "average", avg + t.requests_per_second +
    " req/s over " + duration(t.elapsed_seconds) + " (finished requests)");
  stat(dl, "cache-hit share", pct(job.cache.cached_token_share) + " of prompt tokens cached; " +
    pct(job.cache.hit_share) + " of prefix lookups hit");
  const eff = job.cache.computed_over_minimum;
  const p = job.prefix;
  // Workers add the prompt tokens they computed to the job when a shard ends; while it runs, the live count shows.
  stat(dl, "computed ÷ minimum", job.terminal && eff === null ? "–" : !job.terminal
    ? num(Math.max(p.prefill_tokens_computed, live.prefilled_tokens || 0)) + " computed so far; minimum " +
      num(p.trie_min_tokens) + " prompt tokens (the ratio when the job ends)"
    : eff.toFixed(3) + "× (" + num(p.prefill_tokens_computed) + " / " + num(p.trie_min_tokens) + " prompt tokens)");
}

function renderInputErrors(job) {
  const body = $("validation-errors").tBodies[0];
  body.replaceChildren();
  for (const e of job.errors) {
    const tr = el("tr");
    tr.append(el("td", e.line, "num"), el("td", e.field || "–"), el("td", e.code), el("td", e.message, "text"));
    body.append(tr);
  }
  $("input-errors").hidden = job.errors.length === 0;
  $("input-errors-count").textContent = job.error_count > job.errors.length
    ? "(first " + job.errors.length + " of " + job.error_count + ")" : "(" + job.error_count + ")";
}

function renderOutcomes(job) {
  if (job.outcomes === null) { // a large job's first view: read in the background, shown with a later refresh
    $("no-outcomes").textContent = "Counting…";
    $("no-outcomes").hidden = false;
    return;
  }
  $("no-outcomes").textContent = "No request has ended yet.";
  const body = $("outcomes").tBodies[0];
  body.replaceChildren();
  const entries = Object.entries(job.outcomes).sort((a, b) => b[1] - a[1]);
  const total = entries.reduce((s, e) => s + e[1], 0) || 1;
  const isReason = (k) => ["stop", "length", "content_filter", "tool_calls"].includes(k);
  for (const [outcome, n] of entries) {
    const tr = el("tr");
    tr.dataset.outcome = outcome;
    const a = link(outcome, "#requests", "outcome" + (isReason(outcome) ? "" : " error"));
    a.addEventListener("click", (ev) => { ev.preventDefault(); setRequestFilter({ outcome, status: "", q: "" }); });
    const share = el("span", null, "share" + (isReason(outcome) ? "" : " error"));
    share.style.width = (120 * n / total).toFixed(1) + "px";
    tr.append(cell(a), el("td", num(n), "num"), cell(share));
    body.append(tr);
  }
  $("no-outcomes").hidden = entries.length > 0;
  if (document.activeElement !== $("req-outcome")) fillSelect($("req-outcome"), entries.map((e) => e[0]), req.outcome);
}

function renderFirstErrors(job) {
  const errors = $("errors").tBodies[0];
  errors.replaceChildren();
  for (const e of job.first_errors) {
    const tr = el("tr");
    tr.append(el("td", e.line, "num"), el("td", e.custom_id), el("td", e.code), el("td", e.message, "text"));
    errors.append(tr);
  }
  $("no-errors").hidden = job.first_errors.length > 0;
}

function renderDetails(job) {
  const dl = $("job-details");
  dl.replaceChildren();
  stat(dl, "model", job.details.model);
  stat(dl, "queue", job.details.queue || "–");
  stat(dl, "input file", job.details.input_file || "–");
  stat(dl, "created", new Date(job.created_at * 1000).toLocaleString());
  stat(dl, "submitted through", job.batch ? "the Batch API" : "the CLI");
  for (const w of job.workers || []) stat(dl, "worker", w.worker + ": " + num(w.completed) + " completed, " +
    num(w.failed) + " failed (" + w.model + ")");
}

function renderJob(job) {
  document.title = "omlx-jobs · " + job.id;
  $("job-title").textContent = job.id;
  $("job-status").replaceWith(statusBadge(job.status, "job-status"));
  $("job-model").textContent = job.model_name;
  const rc = job.request_counts;
  const barEl = bar(rc, rc.total, true);
  barEl.id = "job-bar";
  $("job-bar").replaceWith(barEl);
  $("job-progress-text").textContent = progressText(rc, rc.total, job.status);
  if (rc.total === 0 && job.error_count) {
    $("job-progress-text").textContent = "rejected at submit: " + num(job.error_count) + " bad line(s); nothing ran";
  }
  renderLive(job);
  renderStats(job);
  renderInputErrors(job);
  drawThroughput(job.throughput_series);
  renderOutcomes(job);
  const hist = job.histograms || { prompt: [], completion: [] };
  const waiting = job.histograms === null ? "counting…" : "no completed request yet";
  drawHistogram("hist-prompt", hist.prompt, "prompt tokens", "#1f6feb", waiting);
  drawHistogram("hist-completion", hist.completion, "completion tokens", "#d4622a", waiting);
  renderFirstErrors(job);
  renderDetails(job);
  const cancel = $("cancel");
  cancel.hidden = !job.cancellable;
  cancel.disabled = false;
}

// ---- a job's requests -------------------------------------------------------------------------------------

function requestsQuery(id) {
  const p = new URLSearchParams();
  for (const k of ["status", "outcome", "q", "after", "before"]) if (req[k]) p.set(k, req[k]);
  return "/api/jobs/" + encodeURIComponent(id) + "/requests?" + p.toString();
}

function textCell(text, cut, row) {
  const td = el("td", null, "text");
  td.append(el("span", text));
  if (cut) {
    const more = link(" whole line", row.href, "more");
    more.addEventListener("click", (ev) => { ev.preventDefault(); showRequest(row); });
    td.append(more);
  }
  return td;
}

function renderRequests(data) {
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  for (const r of data.rows) {
    const tr = el("tr");
    tr.dataset.customId = r.custom_id;
    tr.dataset.idx = String(r.idx);
    const id = link(r.custom_id, r.href);
    id.addEventListener("click", (ev) => { ev.preventDefault(); showRequest(r); });
    const tokens = r.prompt_tokens === null ? "–" : num(r.prompt_tokens) + " / " + num(r.completion_tokens);
    tr.append(el("td", r.line, "num"), cell(id, "id"), cell(statusBadge(r.status)), el("td", r.outcome || "–"),
      el("td", tokens, "num"), textCell(r.input, r.input_cut, r), textCell(r.output, r.output_cut, r));
    body.append(tr);
  }
  req.rows = data.rows;
  req.first = data.first;
  req.last = data.last;
  $("no-requests").hidden = data.rows.length > 0;
  $("req-prev").hidden = !data.first;
  $("req-next").hidden = !data.last;
}

async function showRequest(row) {
  const data = await api(row.href);
  $("detail-title").textContent = "line " + data.line + " · " + data.request.custom_id + " · " + data.status;
  $("detail-input").textContent = JSON.stringify(data.request, null, 2);
  $("detail-output").textContent = data.result ? JSON.stringify(data.result, null, 2) : "(no result yet)";
  $("detail-raw").href = row.href;
  $("request-detail").hidden = false;
  $("request-detail").dataset.customId = data.request.custom_id;
  $("request-detail").scrollIntoView({ block: "nearest" });
}

function setRequestFilter(changes) {
  Object.assign(req, changes, { after: null, before: null });
  $("req-status").value = req.status;
  $("req-outcome").value = req.outcome;
  $("req-q").value = req.q;
  refresh();
}

// ---- workers --------------------------------------------------------------------------------------------------

function renderWorkers(data) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of data.workers) {
    const tr = el("tr");
    tr.dataset.worker = w.name;
    const beat = w.last_heartbeat ? duration(data.now - w.last_heartbeat) + " ago" : "never";
    const job = w.job_id ? link(w.job_id + (w.shard ? " [" + w.shard + "]" : ""), "/jobs/" + encodeURIComponent(w.job_id)) : el("span", "–");
    tr.append(el("td", w.name), el("td", w.state), el("td", w.model_name), el("td", rate(w.prompt_tokens_per_second), "num"),
      el("td", rate(w.tokens_per_second), "num"), el("td", num(w.in_flight), "num"), cell(job), el("td", beat));
    body.append(tr);
  }
  $("no-workers").hidden = data.workers.length > 0;
  $("workers-error").textContent = data.error || "";
}

// ---- routing and refresh ----------------------------------------------------------------------------------------

function route() {
  const m = location.pathname.match(/^\/jobs\/([^/]+)$/);
  if (m) return { view: "job", id: decodeURIComponent(m[1]) };
  return { view: location.pathname === "/workers" ? "workers" : "list" };
}

function show(view) {
  for (const id of ["list-view", "job-view", "workers-view", "missing-view"]) $(id).hidden = id !== view;
  $("tab-jobs").classList.toggle("active", view !== "workers-view");
  $("tab-workers").classList.toggle("active", view === "workers-view");
}

async function refresh() {
  clearTimeout(timer);
  const r = route();
  try {
    const workers = await api("/api/workers");
    $("workers-count").textContent = "(" + workers.workers.length + ")";
    if (r.view === "job") {
      const [job, requests] = await Promise.all([api("/api/jobs/" + encodeURIComponent(r.id)), api(requestsQuery(r.id))]);
      show("job-view"); // first: the plots take the width of their shown containers
      renderJob(job);
      renderRequests(requests);
    } else if (r.view === "workers") {
      show("workers-view");
      renderWorkers(workers);
    } else {
      const jobs = await api(jobsQuery());
      show("list-view");
      renderJobs(jobs);
    }
    $("auth").hidden = true;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "1";
  } catch (err) {
    if (err instanceof NeedKey) {
      $("auth").hidden = false;
      $("auth-error").textContent = sessionStorage.getItem(KEY_SLOT) ? "That key was refused." : "";
      return; // no refresh until a key is given
    }
    if (err instanceof Missing) {
      document.title = "omlx-jobs · no such job";
      $("missing-text").textContent = "There is no job " + r.id + " here: it was never submitted to this server's " +
        "store (or the link is mistyped).";
      show("missing-view");
      document.body.dataset.loaded = "1";
      return; // nothing to refresh
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

$("job-filters").addEventListener("submit", (event) => {
  event.preventDefault();
  list.filters = { status: $("filter-status").value, model: $("filter-model").value, q: $("filter-q").value.trim() };
  list.cursors = [null];
  refresh();
});
$("jobs-older").addEventListener("click", () => { if (list.next) { list.cursors.push(list.next); refresh(); } });
$("jobs-newer").addEventListener("click", () => { if (list.cursors.length > 1) { list.cursors.pop(); refresh(); } });

$("request-filters").addEventListener("submit", (event) => {
  event.preventDefault();
  setRequestFilter({ status: $("req-status").value, outcome: $("req-outcome").value, q: $("req-q").value.trim() });
});
$("req-next").addEventListener("click", () => { Object.assign(req, { after: req.last, before: null }); refresh(); });
$("req-prev").addEventListener("click", () => { Object.assign(req, { before: req.first, after: null }); refresh(); });
$("detail-close").addEventListener("click", () => { $("request-detail").hidden = true; });

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

window.addEventListener("resize", () => {
  for (const [id, plot] of Object.entries(plots)) plot.setSize({ width: plotWidth($(id)), height: plot.height });
});
document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
refresh();
