// gpufleet dashboard: one page, routed by the URL's fragment (#/, #/jobs, #/jobs/ID,
// #/workers, #/tokens); job.js holds a job's page, admin.js what changes the fleet (tokens,
// a worker's drain and removal, a job's clone). Every value a user or a job wrote reaches the page as text (textContent,
// text nodes), never as HTML. Live updates come over Server-Sent Events; nothing polls.
"use strict";

const MAX_LOG_LINES = 5000; // lines the log view keeps; older ones are fetched on scroll-back
const MAX_LINE_CHARS = 4000; // a longer line is cut, saying how much was left out
const PAGE = 50; // jobs per page
const STATUSES = ["pending", "claimed", "running", "paused", "succeeded", "failed", "cancelled"];
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

// el's children become kids; a null or false kid is left out (replaceChildren would write
// it as the text "null": the jobs page's pager once read "nullnullnull").
function fill(el, ...kids) {
  el.replaceChildren(...kids.flat(Infinity).filter((k) => k !== null && k !== undefined && k !== false));
}

const $ = (sel) => document.querySelector(sel);
const enc = encodeURIComponent;
const jobHref = (id) => "#/jobs/" + enc(id);

function badge(status) {
  return h("span", { class: "status " + status }, status);
}

// The class of a failure its worker named ("environment": the job's environment could not
// be built), as a badge beside the status; null when none was named.
function failureBadge(failure) {
  if (!failure) return null;
  return h("span", { class: "status failure", title: failure === "environment" ? "its Python environment could not be built" : null }, failure + " failure");
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

// ---- a job's environment while its worker builds it ---------------------------------------

const ENV_BUILDING = "building environment";
// When each attempt's build began (ms, by the browser's clock), by "JOB/ATTEMPT": a page
// drawn again keeps the time it first worked out, so the time shown never goes back.
const BUILD_SINCE = new Map();

// Whether the job's worker is building its environment now: its progress message says so.
function buildingEnv(job) {
  const message = job.progress && typeof job.progress.message === "string" ? job.progress.message : "";
  return ["claimed", "running"].includes(job.status) && message.startsWith(ENV_BUILDING);
}

// The build's time so far in a progress message, "building environment (12s)": 12.
function reportedSeconds(message) {
  const m = /\((\d+)s\)$/.exec(message || "");
  return m ? Number(m[1]) : 0;
}

// Note that job's attempt began building at sinceMs (the earliest guess stands).
function noteBuild(jobId, attempt, sinceMs) {
  const key = jobId + "/" + attempt;
  const had = BUILD_SINCE.get(key);
  if (had === undefined || sinceMs < had) BUILD_SINCE.set(key, sinceMs);
  return BUILD_SINCE.get(key);
}

// Whole seconds passed (every note on the page reads one clock: they agree).
function buildingText(sinceMs, now = Date.now()) {
  return ENV_BUILDING + " · " + duration(Math.max(0, Math.floor((now - sinceMs) / 1000)));
}

// "building environment · 12 s", ticking each second (tickBuilds) from when it began: as
// the page worked it out, or its message's time so far (sent every few seconds) before now.
function buildingNote(job) {
  const since = noteBuild(job.id, job.attempt, Date.now() - 1000 * reportedSeconds(job.progress.message));
  return h("span", { class: "env-building", "data-since": String(since) }, buildingText(since));
}

function tickBuilds() {
  const now = Date.now();
  for (const el of document.querySelectorAll(".env-building[data-since]")) el.textContent = buildingText(Number(el.dataset.since), now);
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
  $("#nav-tokens").hidden = !isAdmin(); // the server refuses the others anyway (403)
  $("#signout").hidden = false;
  const pools = S.me.pools.length ? S.me.pools.join(", ") : "every pool";
  $("#who").textContent = S.me.name + " · " + S.me.role + " · " + pools;
  openFleet();
  route();
}

function isAdmin() { return Boolean(S.me && S.me.role === "admin"); }
function canOperate() { return S.me && (S.me.role === "admin" || S.me.role === "operator"); }
function canSubmit() { return Boolean(S.me && ["admin", "operator", "submitter"].includes(S.me.role)); }
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
  const page = ["jobs", "workers", "tokens"].includes(parts[0]) ? parts[0] : "fleet";
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  try {
    if (page === "jobs" && parts[1]) await jobPage(main, parts[1]);
    else if (page === "jobs") await jobsPage(main, params);
    else if (page === "workers") await workersPage(main);
    else if (page === "tokens") await tokensPage(main);
    else await fleetPage(main);
  } catch (e) {
    if (e.status !== 401) main.replaceChildren(h("h1", {}, "Could not load this page"), h("p", { class: "error" }, e.message));
  }
}

// ---- fleet overview ---------------------------------------------------------------------------

// A GPU's own idle use: a driver with no process on the GPU still counts some memory as
// used (a few hundred MiB), and utilisation flickers a few percent. Above these, someone
// is using it.
const IDLE_GPU_MIB = 1024;
const IDLE_GPU_UTIL = 10;

// The gpufleet jobs (claimed or running) that hold this GPU of this worker.
function jobsOnGpu(worker, gpu, running) {
  return running.filter((j) => j.worker_id === worker.id && (j.gpus || []).includes(gpu.index));
}

// What of a GPU's memory and utilisation gpufleet's own jobs do not explain: {mib, util}
// (util null when jobs share the GPU: NVML does not split utilisation by process), or
// null when nothing else is seen or it cannot be told (a job that has not reported its
// GPU memory yet, a simulated GPU).
function otherUse(gpu, held) {
  if (gpu.simulated) return null;
  const used = Math.max(0, gpu.total_mib - gpu.free_mib);
  const util = gpu.util_percent === null || gpu.util_percent === undefined ? null : gpu.util_percent;
  if (!held.length) {
    const busy = used > IDLE_GPU_MIB || (util !== null && util >= IDLE_GPU_UTIL);
    return busy ? { mib: used, util } : null;
  }
  if (held.some((j) => j.gpu_mib === null || j.gpu_mib === undefined)) return null;
  // a job's GPU memory is over all its GPUs: each of them gets its share
  const own = held.reduce((sum, j) => sum + j.gpu_mib / Math.max(1, j.gpus.length), 0);
  const other = Math.round(used - own);
  return other > IDLE_GPU_MIB ? { mib: other, util: null } : null;
}

function otherText(other) {
  return "used by other processes: " + mib(other.mib) + (other.util === null ? "" : ", " + other.util + " %");
}

// What a worker's [hosts.NAME] declaration takes from what it would offer, and where it
// was declared, as `gpufleet workers` says it.
function hostNote(host) {
  const said = host.narrows.length ? host.narrows.join(", ") : "priority=" + host.policy.priority;
  const where = host.file ? host.file.split(/[\\/]/).pop() : "manifest " + host.manifest;
  return said + " by hosts." + host.name + " in " + where;
}

// "0 of 2 GPUs offered (cuda=false by hosts.box in lab.toml)", or null when no declaration
// narrows the worker.
function offeredText(w) {
  if (!w.host || !w.host.narrows.length) return null;
  if (!Array.isArray(w.gpus_offered) || !w.gpus.length) return hostNote(w.host);
  return w.gpus_offered.length + " of " + w.gpus.length + " GPUs offered (" + hostNote(w.host) + ")";
}

function gpuOffered(worker, gpu) {
  return !Array.isArray(worker.gpus_offered) || worker.gpus_offered.some((g) => g.index === gpu.index);
}

function gpuCard(worker, gpu, running) {
  const used = Math.max(0, gpu.total_mib - gpu.free_mib);
  const util = gpu.util_percent;
  const held = jobsOnGpu(worker, gpu, running || []);
  const other = otherUse(gpu, held);
  const offered = gpuOffered(worker, gpu);
  return h("div", { class: "gpu" + (offered ? "" : " not-offered"), "data-gpu": worker.name + "/" + gpu.index },
    h("strong", {}, "GPU " + gpu.index + " · " + gpu.name + (gpu.simulated ? " (simulated)" : "")),
    h("span", { class: "muted" }, worker.name),
    offered ? null : h("span", { class: "offered" }, "not offered to jobs (" + hostNote(worker.host) + ")"),
    bar("memory of GPU " + gpu.index + " on " + worker.name, used, gpu.total_mib,
      "memory " + mib(used) + " / " + mib(gpu.total_mib)),
    util === null || util === undefined
      ? h("span", { class: "muted" }, "utilisation not reported")
      : bar("utilisation of GPU " + gpu.index + " on " + worker.name, util, 100, "utilisation " + util + " %"),
    h("span", { class: "gpu-jobs" }, "gpufleet: ", held.length
      ? held.map((j, i) => [i ? ", " : "", h("a", { href: jobHref(j.id) }, j.name)])
      : "no job"),
    other ? h("span", { class: "other" }, otherText(other)) : null);
}

function jobsTable(jobs, caption) {
  if (!jobs.length) return h("p", { class: "muted" }, "No jobs.");
  return h("table", {},
    h("caption", { class: "muted" }, caption || ""),
    h("thead", {}, h("tr", {}, ["Name", "Status", "Pool", "Worker", "Progress", "Created"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, jobs.map((j) => h("tr", {},
      h("td", { class: "name" }, h("a", { href: jobHref(j.id) }, j.name), h("div", { class: "muted mono" }, j.id)),
      h("td", {}, badge(j.status), j.stopped_early ? h("div", { class: "muted" }, "stopped early") : null,
        j.status === "failed" && j.failure ? h("div", {}, failureBadge(j.failure)) : null),
      h("td", {}, j.pool || ""),
      h("td", {}, j.worker || ""),
      h("td", {}, buildingEnv(j) ? buildingNote(j) : progressText(j.progress)),
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
    const [status, workers, jobs, running] = await Promise.all([
      api("/v1/status"), api("/v1/workers"),
      api("/v1/jobs?status=claimed,running,pending&order=newest&limit=25"),
      api("/v1/jobs?status=claimed,running&limit=1000"),
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
        h("td", {}, badge(w.status)),
        h("td", {}, w.pool),
        h("td", {}, w.gpus.length ? w.gpus.map((g) => g.name).join(", ") : "none",
          offeredText(w) ? h("div", { class: "muted offered" }, offeredText(w)) : null),
        h("td", {}, String(w.running.length)),
        h("td", {}, ago(w.last_heartbeat)))))) : h("p", { class: "muted" }, "No workers have joined yet."));
    const cards = workers.filter((w) => w.status !== "offline").flatMap((w) => w.gpus.map((g) => gpuCard(w, g, running)));
    gpus.replaceChildren(...(cards.length ? cards : [h("p", { class: "muted" }, "No GPUs online.")]));
    queue.replaceChildren(jobsTable(jobs, "Newest first; at most 25"));
  };
  await refresh();
  onFleet(throttle(refresh, 1000));
}

// ---- jobs -------------------------------------------------------------------------------------

// Where each page of the jobs list came from, by the cursor of the page after it: "Newer"
// goes back there (the API pages back only; this page's memory is enough for the way back).
const NEWER = new Map();

function jobsLink(filters, cursor, at, text, id) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) if (v) q.set(k, v);
  if (cursor) { q.set("before", cursor); q.set("at", String(at)); }
  return h("a", { href: "#/jobs" + (q.toString() ? "?" + q : ""), id, class: "button" }, text);
}

// The pager: its links and which jobs of how many the page shows; nothing on a lone page.
function pagerParts(filters, before, at, jobs, more, total) {
  const older = more ? jobs[jobs.length - 1].id : null;
  if (older) NEWER.set(older, { before, at });
  const back = before ? NEWER.get(before) : null;
  const parts = [
    before && (!back || back.before) ? jobsLink(filters, "", 1, "« Newest", "newest") : null,
    back ? jobsLink(filters, back.before, back.at, "‹ Newer", "newer") : null,
    older ? jobsLink(filters, older, at + jobs.length, "Older ›", "older") : null,
  ].filter(Boolean);
  if (!parts.length) return [];
  const range = jobs.length ? "jobs " + at + " to " + (at + jobs.length - 1) + " of " + total : "no jobs here";
  return [...parts, h("span", { class: "muted", id: "page-range" }, range)];
}

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
  const pager = h("nav", { class: "pager", "aria-label": "Pages of jobs" });
  main.append(h("h1", {}, "Jobs"), form, table, pager);

  const at = Math.max(1, Math.floor(Number(params.get("at"))) || 1); // this page's first job's place
  const load = async () => {
    // one more than a page: whether an older page exists, without an empty last page
    const q = new URLSearchParams({ order: "newest", limit: String(PAGE + 1) });
    if (status) q.set("status", status);
    if (pool) q.set("pool", pool);
    if (name) q.set("name", name);
    if (before) q.set("before", before);
    const { data: got, headers } = await api("/v1/jobs?" + q, { withHeaders: true });
    const more = got.length > PAGE;
    const jobs = got.slice(0, PAGE);
    const total = Number(headers.get("X-Total-Count") || jobs.length);
    table.replaceChildren(jobsTable(jobs, total + " matching jobs, newest first"));
    table.setAttribute("data-count", String(jobs.length));
    fill(pager, pagerParts({ status, pool, name }, before, at, jobs, more, total));
  };
  await load();
  // a job's status changed: the first page shows it (a page further back stays put)
  const reload = throttle(load, 1000);
  onFleet((kind) => { if (kind === "job" && !before) reload(); });
}

// ---- workers ------------------------------------------------------------------------------------

async function workersPage(main) {
  const box = h("div", { class: "workers" });
  fill(main, h("h1", {}, "Workers"),
    isAdmin() ? h("p", {}, h("a", { href: "#/tokens", class: "button" }, "Add a worker…")) : null, box);
  const refresh = async () => {
    const [workers, running] = await Promise.all([api("/v1/workers"), api("/v1/jobs?status=claimed,running&limit=1000")]);
    box.replaceChildren(...(workers.length
      ? workers.map((w) => workerCard(w, running, refresh))
      : [h("p", { class: "muted" }, "No workers have joined yet.")]));
  };
  await refresh();
  onFleet(throttle(refresh, 1000));
}

function workerCard(w, running, refresh) {
  const names = new Map(running.map((j) => [j.id, j]));
  const others = w.gpus.map((g) => [g, otherUse(g, jobsOnGpu(w, g, running))]).filter(([, o]) => o);
  const actions = workerActions(w, refresh);
  return h("article", { class: "worker", "aria-label": "Worker " + w.name, "data-worker": w.name },
    h("h2", {}, w.name, badge(w.status)),
    h("dl", { class: "facts" },
      h("dt", {}, "pool"), h("dd", {}, w.pool),
      h("dt", {}, "heartbeat"), h("dd", {}, ago(w.last_heartbeat)),
      h("dt", {}, "slots"), h("dd", {}, Object.entries(w.slots).map(([k, v]) => k + " " + v).join(", ") || "–"),
      h("dt", {}, "labels"), h("dd", {}, Object.entries(w.labels).map(([k, v]) => k + "=" + v).join(", ") || "–"),
      h("dt", {}, "tools"), h("dd", {}, Object.entries(w.capability.tools || {}).map(([k, v]) => k + " " + v).join(", ") || "–"),
      offeredText(w) ? [h("dt", {}, "offers"), h("dd", { class: "offered" }, offeredText(w))] : null),
    w.gpus.length ? h("div", { class: "gpus" }, w.gpus.map((g) => gpuCard(w, g, running))) : h("p", { class: "muted" }, "No GPU (CPU jobs only)."),
    h("h3", {}, "Running"),
    w.running.length
      ? h("ul", {}, w.running.map((jid) => h("li", {}, h("a", { href: jobHref(jid) }, names.has(jid) ? names.get(jid).name : jid), " ", runningText(names.get(jid)))))
      : h("p", { class: "muted running-none" }, "No gpufleet job."),
    builtEnvs(w),
    others.length
      ? h("p", { class: "other" }, others.map(([g, o], i) => [i ? "; " : "", "GPU " + g.index + " is " + otherText(o)]))
      : null,
    ownerNote(w),
    actions);
}

// A worker under an owner policy: the GPUs the owner's processes hold, and why it takes
// no new jobs (the owner away rule, the hours, the battery, a yield), a line each.
function ownerNote(w) {
  const o = w.owner;
  if (!o) return null;
  const gib = (mib) => (mib >= 1024 ? (mib / 1024).toFixed(1) + " GiB" : mib + " MiB");
  const gpus = o.owned.map((i) => {
    const procs = o.foreign.filter((p) => p.gpu === i).slice(0, 3)
      .map((p) => "owner's process " + p.pid + (p.name ? " (" + p.name + ")" : "") + " uses " + gib(p.mib));
    return "GPU " + i + ": " + (procs.join("; ") || "owner processes") + "; not taking jobs";
  });
  const lines = [...gpus, ...o.reasons];
  return h("div", { class: "owner", "data-owner": w.name },
    h("h3", {}, "Owner policy"),
    lines.length ? h("ul", {}, lines.map((l) => h("li", {}, l))) : h("p", { class: "muted" }, "Taking jobs."));
}

function runningText(job) {
  if (!job) return "";
  return buildingEnv(job) ? buildingNote(job) : progressText(job.progress);
}

// The job environments a worker has built (its heartbeats list them): a count and their
// size, opening to one line each. Nothing for a worker that has built none.
function builtEnvs(w) {
  const envs = w.environments || [];
  if (!envs.length) return null;
  const total = envs.reduce((sum, e) => sum + (e.size_bytes || 0), 0);
  const newest = [...envs].sort((a, b) => b.last_used - a.last_used);
  return h("details", { class: "envs" },
    h("summary", {}, envs.length + (envs.length === 1 ? " environment, " : " environments, ") + bytes(total)),
    h("ul", {}, newest.map((e) => {
      const use = "last used " + ago(new Date(e.last_used * 1000).toISOString());
      return h("li", { "data-env": e.key },
        h("code", { class: "env-describe" }, e.describe || "(not described)"),
        h("div", { class: "muted" }, h("span", { class: "mono", title: "environment " + e.key }, e.key.slice(0, 12)),
          " · Python " + e.python + (e.torch_backend ? " · torch " + e.torch_backend : "") + " · " + bytes(e.size_bytes) + " · " + use));
    })));
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
  setInterval(tickBuilds, 1000); // rewrites the shown build times only: nothing is fetched
  try {
    S.me = await api("/v1/session", { signIn: true });
  } catch {
    S.me = null;
  }
  if (S.me && S.me.csrf) signedIn();
  else showSignIn();
}

document.addEventListener("DOMContentLoaded", start);
