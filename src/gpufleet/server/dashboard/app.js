// gpufleet dashboard: one page, routed by the URL's fragment (#/, #/jobs, #/jobs/ID,
// #/workers). Every value a user or a job wrote reaches the page as text (textContent,
// text nodes), never as HTML. Live updates come over Server-Sent Events; nothing polls.
"use strict";

const MAX_LOG_LINES = 5000; // lines the log view keeps; older ones are fetched on scroll-back
const MAX_LINE_CHARS = 4000; // a longer line is cut, saying how much was left out
const PAGE = 50; // jobs per page
const STATUSES = ["pending", "claimed", "running", "succeeded", "failed", "cancelled"];
const S = { me: null, fleet: null, fleetListeners: new Set(), cleanups: [] };

// ---- small DOM helpers ------------------------------------------------------------------

function h(tag, props, ...kids) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : String(kid));
  }
  return el;
}

const $ = (sel) => document.querySelector(sel);
const enc = encodeURIComponent;
const jobHref = (id) => "#/jobs/" + enc(id);

function badge(status) {
  return h("span", { class: "status " + status }, status);
}

function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return d.toLocaleString();
}

function ago(iso) {
  if (!iso) return "never";
  const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
  if (s < 60) return Math.round(s) + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
  return Math.round(s / 86400) + " d ago";
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "";
  const s = Math.round(seconds);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
}

function mib(n) {
  return n >= 1024 ? (n / 1024).toFixed(1) + " GiB" : n + " MiB";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1000 || Number.isInteger(v) ? String(v) : v.toPrecision(4);
}

function bar(label, value, max, text) {
  const pct = max > 0 ? Math.max(0, Math.min(100, (100 * value) / max)) : 0;
  const fill = h("span");
  fill.style.width = pct.toFixed(1) + "%";
  return h("div", { class: "meter" }, h("div", { class: "meter-text" }, text), h("div", {
    class: "bar", role: "progressbar", "aria-label": label,
    "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(pct),
    "aria-valuetext": text,
  }, fill));
}

function flash(message, isError) {
  const box = $("#flash");
  box.replaceChildren(h("p", { class: isError ? "error" : "" }, message));
  clearTimeout(flash.timer);
  flash.timer = setTimeout(() => box.replaceChildren(), isError ? 12000 : 5000);
}

// Run fn at most once per ms: a call inside the window runs once when it ends.
function throttle(fn, ms) {
  let timer = null;
  let again = false;
  const run = () => {
    timer = setTimeout(() => { timer = null; if (again) { again = false; run(); } }, ms);
    Promise.resolve(fn()).catch((e) => flash(e.message, true));
  };
  return () => { if (timer) again = true; else run(); };
}

function onCleanup(fn) { S.cleanups.push(fn); }

// ---- the API ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, opts = {}) {
  const method = opts.method || "GET";
  const headers = { Accept: "application/json" };
  let body;
  if (opts.body !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.body);
  }
  if (method !== "GET" && S.me && S.me.csrf) headers["X-CSRF-Token"] = S.me.csrf;
  const r = await fetch(path, { method, headers, body, credentials: "same-origin", cache: "no-store" });
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!r.ok) {
    const message = (data && data.error && data.error.message) || r.status + " " + r.statusText;
    if (r.status === 401 && !opts.signIn) signedOut(message);
    throw new ApiError(r.status, message);
  }
  return opts.withHeaders ? { data, headers: r.headers } : data;
}

// ---- sign-in --------------------------------------------------------------------------------

function showSignIn(message) {
  const main = $("#main");
  const input = h("input", {
    id: "token", type: "password", name: "token", autocomplete: "off", required: true,
    spellcheck: "false", placeholder: "gf_…",
  });
  const error = h("p", { class: "error", role: "alert" }, message || "");
  const form = h("form", {
    onsubmit: async (ev) => {
      ev.preventDefault();
      const token = input.value.trim();
      if (!token) return;
      try {
        S.me = await api("/v1/session", { method: "POST", body: { token }, signIn: true });
        input.value = "";
        signedIn();
      } catch (e) {
        error.textContent = e.message;
        input.select();
      }
    },
  },
  h("label", { for: "token" }, "Token (admin, operator or submitter)"),
  input,
  h("button", { class: "primary", type: "submit" }, "Sign in"),
  error);
  main.replaceChildren(h("section", { class: "signin", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title" }, "Sign in to gpufleet"),
    h("p", { class: "muted" },
      "Paste a token once. The server keeps you signed in with a session cookie; the token " +
      "itself is not stored in this browser."),
    form));
  input.focus();
}

function signedOut(message) {
  S.me = null;
  closeFleet();
  cleanupPage();
  $("#nav").hidden = true;
  $("#signout").hidden = true;
  $("#who").textContent = "";
  showSignIn(message);
}

function signedIn() {
  $("#nav").hidden = false;
  $("#signout").hidden = false;
  const pools = S.me.pools.length ? S.me.pools.join(", ") : "every pool";
  $("#who").textContent = S.me.name + " · " + S.me.role + " · " + pools;
  openFleet();
  route();
}

function canOperate() { return S.me && (S.me.role === "admin" || S.me.role === "operator"); }
function canSteer(job) { return canOperate() || (S.me && S.me.role === "submitter" && job.submitted_by === S.me.id); }

// ---- the fleet's event stream (job status changes, worker changes) ----------------------------

function openFleet() {
  closeFleet();
  const source = new EventSource("/v1/events");
  const live = $("#live");
  live.hidden = false;
  source.onopen = () => { live.textContent = "live"; live.classList.remove("down"); };
  source.onerror = () => { live.textContent = "reconnecting"; live.classList.add("down"); };
  const tell = (kind) => (ev) => {
    let data = {};
    try { data = JSON.parse(ev.data); } catch { return; }
    for (const fn of S.fleetListeners) fn(kind, data);
  };
  source.addEventListener("job", tell("job"));
  source.addEventListener("worker", tell("worker"));
  S.fleet = source;
}

function closeFleet() {
  if (S.fleet) S.fleet.close();
  S.fleet = null;
  $("#live").hidden = true;
}

function onFleet(fn) {
  S.fleetListeners.add(fn);
  onCleanup(() => S.fleetListeners.delete(fn));
}

// ---- routing ----------------------------------------------------------------------------------

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map((p) => {
    try { return decodeURIComponent(p); } catch { return p; }
  });
  return { parts, params: new URLSearchParams(query || "") };
}

function cleanupPage() {
  for (const fn of S.cleanups.splice(0)) {
    try { fn(); } catch (e) { console.error(e); }
  }
}

async function route() {
  cleanupPage();
  if (!S.me) return showSignIn();
  const main = $("#main");
  main.replaceChildren();
  const { parts, params } = parseHash();
  const page = parts[0] === "jobs" ? "jobs" : parts[0] === "workers" ? "workers" : "fleet";
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  try {
    if (page === "jobs" && parts[1]) await jobPage(main, parts[1]);
    else if (page === "jobs") await jobsPage(main, params);
    else if (page === "workers") await workersPage(main);
    else await fleetPage(main);
  } catch (e) {
    if (e.status !== 401) main.replaceChildren(h("h1", {}, "Could not load this page"), h("p", { class: "error" }, e.message));
  }
}

// ---- fleet overview ---------------------------------------------------------------------------

function gpuCard(worker, gpu) {
  const used = Math.max(0, gpu.total_mib - gpu.free_mib);
  const util = gpu.util_percent;
  return h("div", { class: "gpu" },
    h("strong", {}, "GPU " + gpu.index + " · " + gpu.name + (gpu.simulated ? " (simulated)" : "")),
    h("span", { class: "muted" }, worker.name),
    bar("memory of GPU " + gpu.index + " on " + worker.name, used, gpu.total_mib,
      "memory " + mib(used) + " / " + mib(gpu.total_mib)),
    util === null || util === undefined
      ? h("span", { class: "muted" }, "utilisation not reported")
      : bar("utilisation of GPU " + gpu.index + " on " + worker.name, util, 100, "utilisation " + util + " %"));
}

function jobsTable(jobs, caption) {
  if (!jobs.length) return h("p", { class: "muted" }, "No jobs.");
  return h("table", {},
    h("caption", { class: "muted" }, caption || ""),
    h("thead", {}, h("tr", {}, ["Name", "Status", "Pool", "Worker", "Progress", "Created"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, jobs.map((j) => h("tr", {},
      h("td", { class: "name" }, h("a", { href: jobHref(j.id) }, j.name), h("div", { class: "muted mono" }, j.id)),
      h("td", {}, badge(j.status), j.stopped_early ? h("div", { class: "muted" }, "stopped early") : null),
      h("td", {}, j.pool || ""),
      h("td", {}, j.worker || ""),
      h("td", {}, progressText(j.progress)),
      h("td", { title: when(j.created_at) }, ago(j.created_at))))));
}

function progressText(p) {
  if (!p) return "";
  const parts = [];
  if (p.epoch !== undefined) parts.push("epoch " + p.epoch + (p.epochs ? "/" + p.epochs : ""));
  else if (p.step !== undefined) parts.push("step " + p.step + (p.steps ? "/" + p.steps : ""));
  else if (p.progress !== undefined) parts.push(Math.round(p.progress * 100) + " %");
  if (p.loss !== undefined) parts.push("loss " + fmt(p.loss));
  return parts.join(" · ");
}

async function fleetPage(main) {
  const counts = h("div", { class: "cards", "aria-label": "Jobs and workers" });
  const gpus = h("div", { class: "gpus" });
  const table = h("div");
  const queue = h("div");
  main.append(h("h1", {}, "Fleet"), counts,
    h("h2", {}, "Workers"), table,
    h("h2", {}, "GPUs"), gpus,
    h("h2", {}, "Queue: running and waiting jobs"), queue);
  const refresh = async () => {
    const [status, workers, jobs] = await Promise.all([
      api("/v1/status"), api("/v1/workers"),
      api("/v1/jobs?status=claimed,running,pending&order=newest&limit=25"),
    ]);
    const card = (n, k) => h("div", { class: "card" }, h("div", { class: "n" }, String(n)), h("div", { class: "k" }, k));
    counts.replaceChildren(
      ...STATUSES.map((s) => card(status.jobs[s] || 0, s + " jobs")),
      card(Object.entries(status.workers).filter(([k]) => k !== "offline").reduce((a, [, n]) => a + n, 0), "workers up"),
      card(status.gpus_free + " / " + status.gpus, "GPUs free"),
      card(status.cpu_slots_free + " / " + status.cpu_slots, "CPU slots free"));
    table.replaceChildren(workers.length ? h("table", {},
      h("thead", {}, h("tr", {}, ["Worker", "Status", "Pool", "GPUs", "Running", "Heartbeat"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, workers.map((w) => h("tr", {},
        h("td", { class: "name" }, h("a", { href: "#/workers" }, w.name)),
        h("td", {}, badge(w.status), w.drain ? " draining" : ""),
        h("td", {}, w.pool),
        h("td", {}, w.gpus.length ? w.gpus.map((g) => g.name).join(", ") : "none"),
        h("td", {}, String(w.running.length)),
        h("td", {}, ago(w.last_heartbeat)))))) : h("p", { class: "muted" }, "No workers have joined yet."));
    const cards = workers.filter((w) => w.status !== "offline").flatMap((w) => w.gpus.map((g) => gpuCard(w, g)));
    gpus.replaceChildren(...(cards.length ? cards : [h("p", { class: "muted" }, "No GPUs online.")]));
    queue.replaceChildren(jobsTable(jobs, "Newest first; at most 25"));
  };
  await refresh();
  onFleet(throttle(refresh, 1000));
}

// ---- jobs -------------------------------------------------------------------------------------

async function jobsPage(main, params) {
  const status = params.get("status") || "";
  const pool = params.get("pool") || "";
  const name = params.get("name") || "";
  const before = params.get("before") || "";
  const statusSelect = h("select", { id: "f-status", name: "status" },
    h("option", { value: "" }, "any"), STATUSES.map((s) => h("option", { value: s, selected: s === status }, s)));
  const poolInput = S.me.pools.length
    ? h("select", { id: "f-pool", name: "pool" }, h("option", { value: "" }, "any of mine"),
      S.me.pools.map((p) => h("option", { value: p, selected: p === pool }, p)))
    : h("input", { id: "f-pool", name: "pool", value: pool, size: 12 });
  const nameInput = h("input", { id: "f-name", name: "name", value: name, type: "search", size: 20 });
  const form = h("form", {
    class: "filters", role: "search",
    onsubmit: (ev) => {
      ev.preventDefault();
      const q = new URLSearchParams();
      if (statusSelect.value) q.set("status", statusSelect.value);
      if (poolInput.value.trim()) q.set("pool", poolInput.value.trim());
      if (nameInput.value.trim()) q.set("name", nameInput.value.trim());
      location.hash = "#/jobs" + (q.toString() ? "?" + q : "");
    },
  },
  h("label", { for: "f-status" }, "Status", statusSelect),
  h("label", { for: "f-pool" }, "Pool", poolInput),
  h("label", { for: "f-name" }, "Name holds", nameInput),
  h("button", { type: "submit", class: "primary" }, "Filter"));
  const table = h("div");
  const pager = h("div", { class: "pager" });
  main.append(h("h1", {}, "Jobs"), form, table, pager);

  const load = async () => {
    const q = new URLSearchParams({ order: "newest", limit: String(PAGE) });
    if (status) q.set("status", status);
    if (pool) q.set("pool", pool);
    if (name) q.set("name", name);
    if (before) q.set("before", before);
    const { data: jobs, headers } = await api("/v1/jobs?" + q, { withHeaders: true });
    const total = Number(headers.get("X-Total-Count") || jobs.length);
    table.replaceChildren(jobsTable(jobs, total + " matching jobs, newest first"));
    table.setAttribute("data-count", String(jobs.length));
    const older = new URLSearchParams();
    if (status) older.set("status", status);
    if (pool) older.set("pool", pool);
    if (name) older.set("name", name);
    const first = "#/jobs" + (older.toString() ? "?" + older : "");
    if (jobs.length) older.set("before", jobs[jobs.length - 1].id);
    pager.replaceChildren(
      before ? h("a", { href: first }, "« Newest") : null,
      before ? h("button", { type: "button", onclick: () => history.back() }, "‹ Newer") : null,
      jobs.length === PAGE ? h("a", { href: "#/jobs?" + older, id: "older" }, "Older ›") : null,
      h("span", { class: "muted" }, jobs.length ? "showing " + jobs.length + " of " + total : ""));
  };
  await load();
  // a job's status changed: the first page shows it (a page further back stays put)
  const reload = throttle(load, 1000);
  onFleet((kind) => { if (kind === "job" && !before) reload(); });
}

// ---- one job ----------------------------------------------------------------------------------

function cleanLine(text) {
  // a carriage-return progress bar: keep its last state
  if (text.includes("\r")) {
    const parts = text.split("\r").filter((p) => p.length);
    text = parts.length ? parts[parts.length - 1] : "";
  }
  return text;
}

function logLine(ev) {
  const text = cleanLine(ev.line || "");
  const line = h("div", { class: "line " + (ev.stream || "stdout"), "data-seq": ev.seq });
  if (text.length > MAX_LINE_CHARS) {
    line.append(text.slice(0, MAX_LINE_CHARS), h("span", { class: "cut" }, " … [" + (text.length - MAX_LINE_CHARS) + " more characters cut]"));
  } else {
    line.append(text);
  }
  return line;
}

class LogView {
  constructor(jobId) {
    this.jobId = jobId;
    this.box = h("div", { class: "log", role: "log", tabindex: "0", "aria-label": "Job output", id: "log" });
    this.note = h("span", { class: "muted" });
    this.latest = h("button", { type: "button", hidden: true, onclick: () => this.reload() }, "Jump to latest");
    this.older = true; // lines before the first shown may exist
    this.detached = false; // scrolled back past what fits: live lines are not added
    this.loading = false;
    this.pending = [];
    this.box.addEventListener("scroll", () => {
      if (this.box.scrollTop < 40 && this.older && !this.loading) this.loadOlder();
    });
    this.el = h("section", { "aria-labelledby": "logs-title" },
      h("div", { class: "logbar" }, h("h2", { id: "logs-title" }, "Logs"), this.note, this.latest), this.box);
  }

  count() { return this.box.childElementCount; }
  atBottom() { return this.box.scrollHeight - this.box.scrollTop - this.box.clientHeight < 30; }

  async tail() {
    const page = await api(`/v1/jobs/${enc(this.jobId)}/events?format=json&types=log&before=9007199254740991&limit=1000`);
    this.box.replaceChildren(...page.events.map((e) => logLine(e.data)));
    this.older = page.more;
    this.box.scrollTop = this.box.scrollHeight;
    this.update();
    return new Set(page.events.map((e) => String(e.seq)));
  }

  async reload() {
    this.detached = false;
    this.latest.hidden = true;
    await this.tail();
  }

  add(ev) {
    if (this.detached) return;
    this.pending.push(ev);
    if (this.pending.length === 1) requestAnimationFrame(() => this.flush());
  }

  flush() {
    const stick = this.atBottom();
    const batch = this.pending.splice(0);
    const frag = document.createDocumentFragment();
    for (const ev of batch) frag.append(logLine(ev));
    this.box.append(frag);
    let extra = this.count() - MAX_LOG_LINES;
    if (extra > 0) this.older = true;
    while (extra-- > 0) this.box.firstElementChild.remove();
    if (stick) this.box.scrollTop = this.box.scrollHeight;
    this.update();
  }

  async loadOlder() {
    const first = this.box.firstElementChild;
    if (!first) return;
    this.loading = true;
    try {
      const page = await api(`/v1/jobs/${enc(this.jobId)}/events?format=json&types=log&before=${first.dataset.seq}&limit=500`);
      this.older = page.more;
      const height = this.box.scrollHeight;
      this.box.prepend(...page.events.map((e) => logLine(e.data)));
      this.box.scrollTop += this.box.scrollHeight - height;
      let extra = this.count() - MAX_LOG_LINES;
      if (extra > 0) { this.detached = true; this.latest.hidden = false; }
      while (extra-- > 0) this.box.lastElementChild.remove();
      this.update();
    } finally {
      this.loading = false;
    }
  }

  update() {
    const n = this.count();
    this.note.textContent = n ? n + " lines shown" + (this.older ? "; scroll up for earlier ones" : "") + (this.detached ? "; not following" : "") : "no output yet";
  }
}

const PALETTE = ["#2f6fbf", "#d9480f", "#2b8a3e", "#9c36b5", "#c2255c", "#0b7285", "#5c940d", "#e67700"];

class Curves {
  constructor() {
    this.records = [];
    this.box = h("div", { class: "chart", id: "chart", role: "img", "aria-label": "Metrics: none reported yet", "data-points": "0" });
    this.empty = h("p", { class: "muted" }, "The job has reported no metrics yet.");
    this.box.append(this.empty);
    this.plot = null;
    this.keys = [];
    this.queued = false;
    this.resize = () => { if (this.plot) this.plot.setSize(this.size()); };
    window.addEventListener("resize", this.resize);
  }

  destroy() {
    window.removeEventListener("resize", this.resize);
    if (this.plot) this.plot.destroy();
  }

  size() { return { width: Math.max(300, this.box.clientWidth - 16), height: 240 }; }

  add(record) {
    this.records.push(record);
    if (!this.queued) {
      this.queued = true;
      requestAnimationFrame(() => { this.queued = false; this.draw(); });
    }
  }

  axis() {
    if (this.records.some((r) => r.epoch !== undefined)) return "epoch";
    if (this.records.some((r) => r.step !== undefined)) return "step";
    return "report";
  }

  draw() {
    const known = new Set(["epoch", "epochs", "step", "steps", "progress", "eta_s", "message", "bytes", "bytes_total", "bytes_per_s"]);
    const keys = [];
    for (const r of this.records) for (const k of Object.keys(r)) if (!known.has(k) && !keys.includes(k)) keys.push(k);
    if (!keys.length) return;
    const axis = this.axis();
    // one point per x: a later record for the same epoch replaces the earlier one's values
    const byX = new Map();
    this.records.forEach((r, i) => {
      const x = axis === "report" ? i + 1 : r[axis];
      if (x === undefined) return;
      byX.set(x, { ...(byX.get(x) || {}), ...r });
    });
    const xs = [...byX.keys()].sort((a, b) => a - b);
    const data = [xs, ...keys.map((k) => xs.map((x) => { const v = byX.get(x)[k]; return typeof v === "number" ? v : null; }))];
    this.box.setAttribute("data-points", String(xs.length));
    const last = keys.map((k) => k + " " + fmt(data[keys.indexOf(k) + 1][xs.length - 1])).join(", ");
    this.box.setAttribute("aria-label", `Metrics over ${xs.length} ${axis === "epoch" ? "epochs" : axis + "s"}: latest ${last}`);
    if (typeof uPlot === "undefined") return;
    if (!this.plot || keys.join() !== this.keys.join() || axis !== this.axisName) {
      if (this.plot) this.plot.destroy();
      this.empty.remove();
      this.keys = keys;
      this.axisName = axis;
      const style = getComputedStyle(document.documentElement);
      const ink = style.getPropertyValue("--text").trim() || "#000";
      const grid = style.getPropertyValue("--line").trim() || "#ccc";
      const ax = { stroke: ink, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid } };
      this.plot = new uPlot({
        ...this.size(),
        scales: { x: { time: false } },
        axes: [{ ...ax, label: axis }, { ...ax }],
        series: [{ label: axis }, ...keys.map((k, i) => ({ label: k, stroke: PALETTE[i % PALETTE.length], width: 2, points: { show: xs.length <= 60 } }))],
      }, data, this.box);
    } else {
      this.plot.setData(data);
    }
  }
}

async function allEvents(jobId, types) {
  // every record of these types so far, page by page; and where the pages ended
  let after = 0;
  const out = [];
  for (let i = 0; i < 100; i++) {
    const page = await api(`/v1/jobs/${enc(jobId)}/events?format=json&types=${types}&after=${after}&limit=10000`);
    out.push(...page.events);
    after = page.next;
    if (!page.more) break; // it stopped at its count or its byte budget
  }
  return { events: out, next: after };
}

function actionButton(label, cls, fn, confirmText) {
  const button = h("button", { type: "button", class: cls });
  button.textContent = label;
  let armed = false;
  button.addEventListener("click", async () => {
    if (confirmText && !armed) {
      armed = true;
      button.textContent = confirmText;
      setTimeout(() => { armed = false; button.textContent = label; }, 5000);
      return;
    }
    button.disabled = true;
    try { await fn(); } catch (e) { flash(e.message, true); } finally { button.disabled = false; armed = false; button.textContent = label; }
  });
  return button;
}

async function jobPage(main, ref) {
  let job = await api(`/v1/jobs/${enc(ref)}`);
  const id = job.id;
  const head = h("div", { class: "job-head" });
  const actions = h("div", { class: "actions", "aria-label": "Steer this job" });
  const facts = h("dl", { class: "facts" });
  const progress = h("div", { id: "progress" });
  const curves = new Curves();
  const timeline = h("ol", { class: "timeline", id: "timeline" });
  const attempts = h("div");
  const why = h("section", { id: "why" });
  const artifact = h("div", { id: "artifact" });
  const logs = new LogView(id);
  onCleanup(() => curves.destroy());
  main.append(head, actions, progress,
    h("div", { class: "grid2" },
      h("section", {}, h("h2", {}, "Loss and metrics"), curves.box),
      h("section", {}, h("h2", {}, "Details"), facts, h("h2", {}, "Timeline"), timeline)),
    why, logs.el,
    h("h2", {}, "Attempts"), attempts,
    h("h2", {}, "Artifact"), artifact);

  const render = () => {
    head.replaceChildren(...[h("h1", {}, job.name), badge(job.status),
      job.stopped_early ? h("span", { class: "muted" }, "stopped early") : null,
      job.stop_requested_at && job.status === "running" ? h("span", { class: "muted" }, "stop requested") : null].filter(Boolean));
    head.setAttribute("data-status", job.status);
    actions.replaceChildren();
    if (canSteer(job)) {
      const post = (what, body) => async () => {
        // The answer is the job's summary, not its detail (no spec): the page's own job
        // stays the detail, or a state event rendering it meanwhile would find no spec.
        const done = await api(`/v1/jobs/${enc(id)}/${what}`, { method: "POST", body });
        flash(what + ": " + done.name + " is " + done.status);
        await refresh();
      };
      if (job.status === "running" && !job.stop_requested_at) actions.append(actionButton("Stop (keep outputs)", "", post("stop", {})));
      if (["pending", "claimed", "running"].includes(job.status)) actions.append(actionButton("Cancel", "danger", post("cancel"), "Really cancel? Click again"));
      if (["failed", "cancelled"].includes(job.status)) actions.append(actionButton("Requeue", "", post("requeue")));
    }
    const row = (k, v) => (v === null || v === undefined || v === "" ? [] : [h("dt", {}, k), h("dd", {}, v)]);
    facts.replaceChildren(
      ...row("id", h("code", {}, job.id)),
      ...row("pool", job.pool),
      ...row("tags", (job.spec.tags || []).join(", ")),
      ...row("command", h("code", {}, (job.spec.command || []).join(" "))),
      ...row("worker", job.worker ? job.worker + (job.gpus.length ? " · GPU " + job.gpus.join(", ") : "") : ""),
      ...row("GPU memory", job.gpu_mib !== null && job.gpu_mib !== undefined ? mib(job.gpu_mib) : ""),
      ...row("attempt", job.attempt ? job.attempt + " (" + job.attempts + " of " + job.max_attempts + " counted)" : ""),
      ...row("created", when(job.created_at)),
      ...row("started", when(job.started_at)),
      ...row("finished", when(job.finished_at)),
      ...row("exit code", job.exit_code === null ? "" : String(job.exit_code)),
      ...row("error", job.error || ""),
      ...Object.entries(job.metrics || {}).flatMap(([k, v]) => row(k, fmt(v))));
    const p = job.progress;
    progress.replaceChildren();
    if (p) {
      let frac = null;
      if (p.progress !== undefined) frac = p.progress;
      else if (p.epoch !== undefined && p.epochs) frac = Math.min(1, p.epoch / p.epochs);
      else if (p.step !== undefined && p.steps) frac = Math.min(1, p.step / p.steps);
      const text = [progressText(p), p.eta_s !== undefined && job.status === "running" ? "ETA " + duration(p.eta_s) : "", p.message || ""].filter(Boolean).join(" · ");
      progress.append(frac === null ? h("p", {}, text) : bar("progress", frac, 1, text));
    }
    attempts.replaceChildren(job.history.length ? h("table", {},
      h("thead", {}, h("tr", {}, ["#", "Worker", "Claimed", "Ended", "Outcome", "Error"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, job.history.map((a) => h("tr", {},
        h("td", {}, String(a.attempt)), h("td", {}, a.worker || ""), h("td", {}, when(a.claimed_at)),
        h("td", {}, when(a.finished_at)), h("td", {}, a.outcome || (a.finished_at ? "" : "running")),
        h("td", { class: "name" }, a.error || "", a.stderr_tail.length ? h("pre", { class: "mono" }, a.stderr_tail.join("\n")) : null))))) : h("p", { class: "muted" }, "Not claimed yet."));
    artifact.replaceChildren(job.artifact
      ? h("p", {}, h("a", { href: "/v1/blobs/" + enc(job.artifact.sha256), download: job.name + "-attempt" + job.artifact.attempt + ".tar.zst", id: "artifact-link" }, "Download the outputs"),
        " (" + job.artifact.file_count + " files, " + bytes(job.artifact.bytes) + " unpacked, " + bytes(job.artifact.size) + " archived)")
      : h("p", { class: "muted" }, ["succeeded", "failed", "cancelled"].includes(job.status) ? "No outputs were kept." : "Outputs are kept when the job ends."));
  };

  const renderWhy = async () => {
    if (job.status !== "pending") { why.replaceChildren(); return; }
    const w = await api(`/v1/jobs/${enc(id)}/why`);
    why.replaceChildren(h("h2", {}, "Why is it waiting?"), h("p", {}, w.summary),
      w.position ? h("p", {}, "Position in its queue: " + w.position) : null,
      w.workers.length ? h("table", {},
        h("thead", {}, h("tr", {}, ["Worker", "Status", "What keeps it from this job"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, w.workers.map((x) => h("tr", {}, h("td", {}, x.name), h("td", {}, badge(x.status)),
          h("td", {}, x.reasons.length ? h("ul", { class: "reasons" }, x.reasons.map((r) => h("li", {}, r))) : "it may run it"))))) : null);
  };

  const refresh = async () => {
    job = await api(`/v1/jobs/${enc(id)}`);
    render();
    await renderWhy();
  };

  const addState = (d) => {
    const who = d.by ? " by " + d.by : "";
    timeline.append(h("li", {}, h("time", { datetime: new Date(d.ts * 1000).toISOString() }, new Date(d.ts * 1000).toLocaleTimeString()), " ",
      badge(d.status), " ", d.event || "", who, d.why ? " — " + d.why : ""));
  };

  render();
  await renderWhy();
  // What happened so far, then everything after it, live. The log's tail is read after
  // the rest, so it holds every line up to where the rest ended (and perhaps more): the
  // stream starts there and skips the lines shown already. Event ids are compared for
  // equality only: a token confined to some pools gets opaque ones, in no order.
  const past = await allEvents(id, "state,progress");
  const shownLines = await logs.tail();
  for (const e of past.events) {
    if (e.type === "state") addState(e.data);
    else curves.add(e.data.record);
  }
  const source = new EventSource(`/v1/jobs/${enc(id)}/events?after=${past.next}`);
  onCleanup(() => source.close());
  const refreshSoon = throttle(refresh, 500);
  const take = (kind, fn) => source.addEventListener(kind, (ev) => {
    if (kind === "log" && shownLines.has(ev.lastEventId)) return;
    let data;
    try { data = JSON.parse(ev.data); } catch { return; }
    fn(data);
  });
  take("log", (d) => logs.add(d));
  take("progress", (d) => {
    curves.add(d.record);
    job.progress = { ...(job.progress || {}), ...d.record };
    job.metrics = { ...(job.metrics || {}) };
    for (const [k, v] of Object.entries(d.record)) if (!["epoch", "epochs", "step", "steps", "progress", "eta_s", "message", "bytes", "bytes_total", "bytes_per_s"].includes(k)) job.metrics[k] = v;
    render();
  });
  take("state", (d) => { addState(d); job.status = d.status; render(); refreshSoon(); });
  source.addEventListener("end", () => { source.close(); refreshSoon(); });
}

// ---- workers ------------------------------------------------------------------------------------

async function workersPage(main) {
  const box = h("div", { class: "workers" });
  main.append(h("h1", {}, "Workers"), box);
  const refresh = async () => {
    const [workers, running] = await Promise.all([api("/v1/workers"), api("/v1/jobs?status=claimed,running&limit=1000")]);
    const names = new Map(running.map((j) => [j.id, j]));
    box.replaceChildren(...(workers.length ? workers.map((w) => {
      const drain = canOperate() && !w.drain && w.status !== "offline"
        ? actionButton("Drain", "", async () => { await api(`/v1/workers/${enc(w.id)}/drain`, { method: "POST" }); flash(w.name + " is draining: it finishes what it runs and takes nothing new"); await refresh(); }, "Really drain? Click again")
        : null;
      return h("article", { class: "worker", "aria-label": "Worker " + w.name },
        h("h2", {}, w.name, badge(w.status), w.drain ? h("span", { class: "status cancelled" }, "draining") : null),
        h("dl", { class: "facts" },
          h("dt", {}, "pool"), h("dd", {}, w.pool),
          h("dt", {}, "heartbeat"), h("dd", {}, ago(w.last_heartbeat)),
          h("dt", {}, "slots"), h("dd", {}, Object.entries(w.slots).map(([k, v]) => k + " " + v).join(", ") || "–"),
          h("dt", {}, "labels"), h("dd", {}, Object.entries(w.labels).map(([k, v]) => k + "=" + v).join(", ") || "–"),
          h("dt", {}, "tools"), h("dd", {}, Object.entries(w.capability.tools || {}).map(([k, v]) => k + " " + v).join(", ") || "–")),
        w.gpus.length ? h("div", { class: "gpus" }, w.gpus.map((g) => gpuCard(w, g))) : h("p", { class: "muted" }, "No GPU (CPU jobs only)."),
        h("h3", {}, "Running"),
        w.running.length ? h("ul", {}, w.running.map((jid) => h("li", {}, h("a", { href: jobHref(jid) }, names.has(jid) ? names.get(jid).name : jid), " ", names.has(jid) ? progressText(names.get(jid).progress) : ""))) : h("p", { class: "muted" }, "Nothing."),
        drain ? h("div", { class: "actions" }, drain) : null);
    }) : [h("p", { class: "muted" }, "No workers have joined yet.")]));
  };
  await refresh();
  onFleet(throttle(refresh, 1000));
}

// ---- start ----------------------------------------------------------------------------------------

function applyTheme(theme) {
  document.documentElement.setAttribute("data-theme", theme);
  $("#theme").textContent = "Theme: " + theme;
  try { localStorage.setItem("gpufleet-theme", theme); } catch { /* private mode */ }
}

async function start() {
  let theme = "auto";
  try { theme = localStorage.getItem("gpufleet-theme") || "auto"; } catch { /* private mode */ }
  applyTheme(theme);
  $("#theme").addEventListener("click", () => {
    const order = ["auto", "light", "dark"];
    applyTheme(order[(order.indexOf(document.documentElement.getAttribute("data-theme")) + 1) % 3]);
  });
  $("#signout").addEventListener("click", async () => {
    try { await api("/v1/session", { method: "DELETE" }); } catch (e) { /* signed out anyway */ }
    signedOut("Signed out.");
  });
  window.addEventListener("hashchange", () => { if (S.me) route(); });
  try {
    S.me = await api("/v1/session", { signIn: true });
  } catch {
    S.me = null;
  }
  if (S.me && S.me.csrf) signedIn();
  else showSignIn();
}

document.addEventListener("DOMContentLoaded", start);
