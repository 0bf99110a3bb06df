// gpufleet dashboard: one job's page (#/jobs/ID): its status, progress, curves, timeline,
// "why", live logs, attempts and artifact, and the buttons that steer it. Loaded after
// app.js, whose helpers it uses; what a job wrote goes in as text.
"use strict";

// ---- one job ----------------------------------------------------------------------------------

const ENV_MARK = "[env] "; // how the worker marks the lines of a job's environment build
const SHORT_VERSIONS = 8; // an environment with more packages lists them folded

function cleanLine(text) {
  // a carriage-return progress bar: keep its last state
  if (text.includes("\r")) {
    const parts = text.split("\r").filter((p) => p.length);
    text = parts.length ? parts[parts.length - 1] : "";
  }
  return text;
}

function isBar(ev) {
  // a progress bar's state while it runs: the worker sends it ending in a carriage return
  return (ev.line || "").endsWith("\r");
}

function collapseBars(evs) {
  // each bar state gives way to the next line of its stream: the bar's latest state stays
  const out = [];
  const lastOf = new Map();
  for (const ev of evs) {
    const at = lastOf.get(ev.stream);
    if (at !== undefined && isBar(out[at])) out[at] = null;
    lastOf.set(ev.stream, out.length);
    out.push(ev);
  }
  return out.filter(Boolean);
}

function logLine(ev) {
  const text = cleanLine(ev.line || "");
  const line = h("div", { class: "line " + (ev.stream || "stdout"), "data-seq": ev.seq, "data-stream": ev.stream || "stdout" });
  if (text.startsWith(ENV_MARK)) line.classList.add("env"); // a line of the environment's build
  if (isBar(ev)) line.dataset.bar = "1";
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
    this.box.replaceChildren(...collapseBars(page.events.map((e) => e.data)).map(logLine));
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
    const lines = collapseBars(batch);
    // a bar's shown state gives way to the next line of its own stream, wherever the
    // other stream's lines put it (stdout and stderr interleave)
    for (const stream of new Set(lines.map((ev) => ev.stream || "stdout"))) {
      const last = this.lastOf(stream);
      if (last && last.dataset.bar) last.remove();
    }
    for (const ev of lines) frag.append(logLine(ev));
    this.box.append(frag);
    let extra = this.count() - MAX_LOG_LINES;
    if (extra > 0) this.older = true;
    while (extra-- > 0) this.box.firstElementChild.remove();
    if (stick) this.box.scrollTop = this.box.scrollHeight;
    this.update();
  }

  lastOf(stream) {
    for (let el = this.box.lastElementChild; el; el = el.previousElementSibling) {
      if (el.dataset.stream === stream) return el;
    }
    return null;
  }

  async loadOlder() {
    const first = this.box.firstElementChild;
    if (!first) return;
    this.loading = true;
    try {
      const page = await api(`/v1/jobs/${enc(this.jobId)}/events?format=json&types=log&before=${first.dataset.seq}&limit=500`);
      this.older = page.more;
      const height = this.box.scrollHeight;
      this.box.prepend(...collapseBars(page.events.map((e) => e.data)).map(logLine));
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

// ---- a job's environment ----------------------------------------------------------------------

// What a job's environment is built from (its spec's `environment`): its files with their
// blobs' first digits, its --with requirements, its Python, whether it resolves afresh.
function envSpec(env) {
  const file = (role, f) => f ? [h("dt", {}, role), h("dd", {}, h("code", {}, f.name), " ",
    h("span", { class: "muted", title: "blob " + f.sha256 }, "blob " + f.sha256.slice(0, 12) + " · " + bytes(f.size)))] : [];
  const withs = env.with || env.with_ || [];
  return h("dl", { class: "facts", id: "env-spec" },
    ...file("requirements", env.requirements),
    ...file("project", env.project),
    ...file("lock", env.lock),
    withs.length ? [h("dt", {}, "--with"), h("dd", {}, h("ul", { class: "plain" }, withs.map((r) => h("li", {}, h("code", {}, r)))))] : [],
    h("dt", {}, "Python"), h("dd", {}, env.python || "the worker's own"),
    h("dt", {}, "versions"), h("dd", {}, env.upgrade ? "resolved afresh (--upgrade)"
      : env.lock ? "as its " + env.lock.name + " pins them"
        : "the fleet's: the first build records the versions it resolved, later builds install them"));
}

// The packages an environment ran with, "name version" each; folded when there are many.
function versionList(versions) {
  const names = Object.keys(versions || {}).sort();
  const list = h("ul", { class: "versions" }, names.map((n) => h("li", {}, h("code", {}, n + " " + versions[n]))));
  if (names.length <= SHORT_VERSIONS) return names.length ? list : h("span", { class: "muted" }, "no packages listed");
  return h("details", {}, h("summary", {}, names.length + " packages"), list);
}

// The environment an attempt ran with, as its worker reported it at the start.
function envUsed(used) {
  const how = used.built ? "built in " + used.seconds.toFixed(1) + " s" : "cached (ready in " + used.seconds.toFixed(1) + " s)";
  const facts = ["Python " + used.python, used.torch_backend ? "torch " + used.torch_backend : null].filter(Boolean);
  return h("div", { class: "env-used" },
    h("div", {}, h("strong", {}, how), " · " + facts.join(" · ")),
    h("div", { class: "muted mono", title: "environment " + used.key }, used.key.slice(0, 12)),
    versionList(used.versions));
}

function attemptEnv(job, a) {
  if (a.environment) return envUsed(a.environment);
  if (!job.spec.environment) return h("span", { class: "muted" }, "the worker's own");
  if (a.failure === "environment") return h("span", {}, "not built");
  if (a.attempt === job.attempt && buildingEnv(job)) return buildingNote(job);
  return "";
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
  const cloneBox = h("div", { id: "clone" }); // kept while render() redraws the rest
  const facts = h("dl", { class: "facts" });
  const progress = h("div", { id: "progress" });
  const curves = new Curves();
  const timeline = h("ol", { class: "timeline", id: "timeline" });
  const attempts = h("div");
  const environment = h("section", { id: "environment" });
  const why = h("section", { id: "why" });
  const artifact = h("div", { id: "artifact" });
  const logs = new LogView(id);
  onCleanup(() => curves.destroy());
  main.append(head, actions, cloneBox, progress,
    h("div", { class: "grid2" },
      h("section", {}, h("h2", {}, "Loss and metrics"), curves.box),
      h("section", {}, h("h2", {}, "Details"), facts, h("h2", {}, "Timeline"), timeline)),
    environment, why, logs.el,
    h("h2", {}, "Attempts"), attempts,
    h("h2", {}, "Artifact"), artifact);

  const render = () => {
    head.replaceChildren(...[h("h1", {}, job.name), badge(job.status),
      job.status === "failed" ? failureBadge(job.failure) : null,
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
      if (["pending", "claimed", "running"].includes(job.status) && !job.pause_requested_at) actions.append(actionButton("Pause", "", post("pause")));
      if (job.status === "paused") actions.append(actionButton("Resume", "", post("resume")));
      if (["pending", "claimed", "running", "paused"].includes(job.status)) actions.append(actionButton("Cancel", "danger", post("cancel"), "Really cancel? Click again"));
      if (["failed", "cancelled"].includes(job.status)) actions.append(actionButton("Requeue", "", post("requeue")));
    }
    if (canSubmit()) actions.append(h("button", { type: "button", onclick: () => cloneForm(cloneBox, job) }, "Clone…"));
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
      ...row("preempted by", preemptedBy(job)),
      ...row("preempted", ((job.preemption || {}).preempted || []).map(jobRef).join("; ")),
      ...Object.entries(job.metrics || {}).flatMap(([k, v]) => row(k, fmt(v))));
    const p = job.progress;
    progress.replaceChildren();
    if (p) {
      let frac = null;
      if (p.progress !== undefined) frac = p.progress;
      else if (p.epoch !== undefined && p.epochs) frac = Math.min(1, p.epoch / p.epochs);
      else if (p.step !== undefined && p.steps) frac = Math.min(1, p.step / p.steps);
      if (buildingEnv(job)) progress.append(h("p", {}, buildingNote(job)));
      else {
        // a build's last word is stale once the job has ended (its environment failed)
        const message = p.message && !String(p.message).startsWith(ENV_BUILDING) ? p.message : "";
        const text = [progressText(p), p.eta_s !== undefined && job.status === "running" ? "ETA " + duration(p.eta_s) : "", message].filter(Boolean).join(" · ");
        if (frac !== null) progress.append(bar("progress", frac, 1, text));
        else if (text) progress.append(h("p", {}, text));
      }
    }
    fill(environment, job.spec.environment ? [h("h2", {}, "Environment"), envSpec(job.spec.environment)] : null);
    attempts.replaceChildren(job.history.length ? h("table", {},
      h("thead", {}, h("tr", {}, ["#", "Worker", "Claimed", "Ended", "Outcome", "Environment", "Error"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, job.history.map((a) => h("tr", { "data-attempt": a.attempt },
        h("td", {}, String(a.attempt)), h("td", {}, a.worker || ""), h("td", {}, when(a.claimed_at)),
        h("td", {}, when(a.finished_at)), h("td", {}, a.outcome || (a.finished_at ? "" : "running"), a.failure ? h("div", {}, failureBadge(a.failure)) : null),
        h("td", { class: "env" }, attemptEnv(job, a)),
        h("td", { class: "name" }, a.error || "", a.stderr_tail.length ? h("pre", { class: "mono" }, a.stderr_tail.join("\n")) : null))))) : h("p", { class: "muted" }, "Not claimed yet."));
    artifact.replaceChildren(job.artifact
      ? h("p", {}, h("a", { href: "/v1/blobs/" + enc(job.artifact.sha256), download: job.name + "-attempt" + job.artifact.attempt + ".tar.zst", id: "artifact-link" }, "Download the outputs"),
        " (" + job.artifact.file_count + " files, " + bytes(job.artifact.bytes) + " unpacked, " + bytes(job.artifact.size) + " archived)")
      : h("p", { class: "muted" }, ["succeeded", "failed", "cancelled"].includes(job.status) ? "No outputs were kept." : "Outputs are kept when the job ends."));
  };

  // Who preempted whom (text only: h() sets it as text, never as markup).
  const jobRef = (r) => "job " + r.job_id + " (" + r.name + "; " + (r.owner ? r.owner + ", " : "") + "priority " + r.priority + ") " + when(r.at);
  const preemptedBy = (j) => {
    const p = j.preemption;
    if (!p || !p.by) return "";
    return jobRef(p.by) + (p.requested_at && ["claimed", "running"].includes(j.status) ? " (its worker vacates it now)" : "");
  };

  const renderWhy = async () => {
    if (job.status !== "pending") { why.replaceChildren(); return; }
    const w = await api(`/v1/jobs/${enc(id)}/why`);
    fill(why, h("h2", {}, "Why is it waiting?"), h("p", {}, w.summary),
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

  // A progress record of an environment build: when the build began, by the record's
  // time less the build's time so far it says.
  const noteProgress = (d) => {
    const message = d.record && typeof d.record.message === "string" ? d.record.message : "";
    if (message.startsWith(ENV_BUILDING) && typeof d.ts === "number") noteBuild(id, d.attempt, 1000 * (d.ts - reportedSeconds(message)));
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
    else { noteProgress(e.data); curves.add(e.data.record); }
  }
  render(); // a build's start, from its records, replaces the guess from its message
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
    noteProgress(d);
    curves.add(d.record);
    job.progress = { ...(job.progress || {}), ...d.record };
    job.metrics = { ...(job.metrics || {}) };
    for (const [k, v] of Object.entries(d.record)) if (!["epoch", "epochs", "step", "steps", "progress", "eta_s", "message", "bytes", "bytes_total", "bytes_per_s"].includes(k)) job.metrics[k] = v;
    render();
  });
  take("state", (d) => { addState(d); job.status = d.status; render(); refreshSoon(); });
  source.addEventListener("end", () => { source.close(); refreshSoon(); });
}
