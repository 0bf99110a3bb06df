// gpufleet dashboard: what changes the fleet. Tokens (#/tokens, admins), a worker's drain
// and removal (operators and admins), and a job's clone (anyone who may submit). Loaded
// after app.js, whose helpers (h, api, flash, actionButton, ...) it uses. A button a role
// cannot use is not shown, and the server refuses the call anyway (403); every change
// carries the session's CSRF token (api() adds it). What users wrote goes in as text.
"use strict";

const ROLES = ["worker", "submitter", "operator", "admin"];

// ---- tokens -------------------------------------------------------------------------------------

// A word for sh or bash: as it is when it is plain, else in single quotes.
function shellWord(text) {
  return /^[A-Za-z0-9._:/=@%+,-]+$/.test(text) ? text : "'" + text.replace(/'/g, "'\\''") + "'";
}

// What starts a worker with a new worker token, as `gpufleet tokens create` prints it: the
// token is pasted at a prompt into the environment, so it is in no argv and no history.
function startCommand(made) {
  return "read -rs GPUFLEET_TOKEN && export GPUFLEET_TOKEN\n" +
    "gpufleet worker --server " + shellWord(location.origin) +
    " --pool " + shellWord(made.pools[0] || "default") + " --name " + shellWord(made.name);
}

// A new secret, shown this once (it is in no URL and no storage; "Done" forgets it).
function showSecret(box, made, what) {
  const secret = h("input", {
    id: "new-token", type: "text", readonly: true, class: "mono", size: 48,
    spellcheck: "false", autocomplete: "off", "aria-label": "The new token's secret",
  });
  secret.value = made.token;
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(secret.value);
      flash("Copied the token.");
    } catch {
      secret.select();
      flash("Press Ctrl+C to copy the selected token.");
    }
  };
  const forWorker = made.role === "worker" ? [
    h("p", {}, "On the machine that is to be the worker, run these and paste the token at " +
      "the prompt (it goes in no command line and no shell history):"),
    h("pre", { class: "command", id: "start-command" }, startCommand(made)),
    h("p", { class: "muted" }, "For a worker that starts with the machine, set GPUFLEET_TOKEN " +
      "the same way and run ", h("code", {}, "gpufleet worker install --systemd"), "."),
  ] : [
    h("p", {}, "Its holder signs in to this dashboard with it, or sets it for the CLI with ",
      h("code", {}, "read -rs GPUFLEET_TOKEN && export GPUFLEET_TOKEN"), "."),
  ];
  box.replaceChildren(h("section", { class: "secret", id: "secret", "aria-labelledby": "secret-title" },
    h("h2", { id: "secret-title" }, "Token “" + made.name + "” (" + made.role + ") " + what),
    h("p", {}, h("strong", {}, "It is shown this once: copy it now."),
      " The server keeps only its hash; a lost token is rotated, not shown again."),
    h("div", { class: "copy" }, secret, h("button", { type: "button", onclick: copy }, "Copy")),
    forWorker,
    h("button", { type: "button", class: "primary", onclick: () => box.replaceChildren() }, "Done")));
  secret.focus();
  secret.select();
}

function poolsHelp(role) {
  return {
    worker: "Pool (exactly one)",
    submitter: "Pools, comma-separated (empty: default)",
    operator: "Pools, comma-separated (empty: every pool)",
    admin: "Pools (an admin has every pool)",
  }[role];
}

function tokenForm(secretBox, refresh) {
  const name = h("input", { id: "t-name", name: "name", required: true, maxlength: 200, size: 22, placeholder: "gpu-box-1" });
  const role = h("select", { id: "t-role", name: "role" }, ROLES.map((r) => h("option", { value: r }, r)));
  const pools = h("input", { id: "t-pools", name: "pools", value: "default", size: 22 });
  const poolsText = h("span", {}, poolsHelp("worker"));
  const days = h("input", { id: "t-days", name: "expires_days", type: "number", min: "1", max: "3650", step: "any", size: 8, placeholder: "never" });
  const error = h("p", { class: "error", role: "alert" });
  role.addEventListener("change", () => {
    poolsText.textContent = poolsHelp(role.value);
    pools.disabled = role.value === "admin";
    if (role.value === "admin") pools.value = "";
  });
  const form = h("form", {
    class: "filters", id: "token-form", "aria-label": "Create a token",
    onsubmit: async (ev) => {
      ev.preventDefault();
      error.textContent = "";
      const body = {
        name: name.value.trim(),
        role: role.value,
        pools: pools.value.split(",").map((p) => p.trim()).filter(Boolean),
      };
      if (days.value) body.expires_days = Number(days.value);
      try {
        const made = await api("/v1/tokens", { method: "POST", body });
        name.value = "";
        showSecret(secretBox, made, "created");
        await refresh();
      } catch (e) {
        error.textContent = e.message;
      }
    },
  },
  h("label", { for: "t-name" }, "Name (a worker's: its machine)", name),
  h("label", { for: "t-role" }, "Role", role),
  h("label", { for: "t-pools" }, poolsText, pools),
  h("label", { for: "t-days" }, "Expires after (days)", days),
  h("button", { type: "submit", class: "primary" }, "Create token"));
  return [form, error];
}

function tokenRow(t, secretBox, refresh) {
  const mine = S.me && t.id === S.me.id;
  const state = t.revoked_at ? "revoked " + ago(t.revoked_at)
    : t.expires_at && new Date(t.expires_at) < new Date() ? "expired"
      : t.expires_at ? "expires " + when(t.expires_at) : "active";
  const actions = h("td", { class: "actions" });
  if (mine) actions.append(h("span", { class: "muted" }, "this session's"));
  else if (!t.revoked_at) {
    actions.append(
      actionButton("Rotate", "", async () => {
        const made = await api(`/v1/tokens/${enc(t.id)}/rotate`, { method: "POST" });
        showSecret(secretBox, made, "rotated: its old secret no longer works");
        await refresh();
      }, "Really rotate? Click again"),
      actionButton("Revoke", "danger", async () => {
        await api(`/v1/tokens/${enc(t.id)}`, { method: "DELETE" });
        flash("Revoked " + t.name + (t.role === "worker" ? ": its workers go offline" : ""));
        await refresh();
      }, "Really revoke? Click again"));
  }
  return h("tr", { "data-token": t.name, class: t.revoked_at ? "revoked" : "" },
    h("td", { class: "name" }, t.name, h("div", { class: "muted mono" }, t.id)),
    h("td", {}, t.role),
    h("td", {}, t.pools.length ? t.pools.join(", ") : "every pool"),
    h("td", { class: "mono" }, t.hint),
    h("td", { title: when(t.created_at) }, ago(t.created_at)),
    h("td", {}, state),
    actions);
}

async function tokensPage(main) {
  main.append(h("h1", {}, "Tokens"));
  if (!isAdmin()) {
    main.append(h("p", { class: "error" }, "Only an admin manages tokens."));
    return;
  }
  const secretBox = h("div");
  const list = h("div");
  const refresh = async () => {
    const tokens = await api("/v1/tokens");
    const table = h("table", { id: "tokens" },
      h("thead", {}, h("tr", {}, ["Name", "Role", "Pools", "Starts with", "Created", "State", ""].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, tokens.map((t) => tokenRow(t, secretBox, refresh))));
    list.replaceChildren(table);
  };
  main.append(
    h("p", { class: "muted" }, "A worker token enrolls a machine as a worker of one pool. " +
      "A secret is shown once, when it is made or rotated; the list shows only its first characters."),
    h("h2", {}, "Add a worker, or a user"), ...tokenForm(secretBox, refresh), secretBox,
    h("h2", {}, "Every token"), list);
  onCleanup(() => secretBox.replaceChildren()); // leaving the page forgets the secret
  await refresh();
}

// ---- a worker's drain and removal -----------------------------------------------------------

function workerActions(w, refresh) {
  if (!canOperate()) return null; // the server says 403 to the others too
  const buttons = [];
  if (!["draining", "offline"].includes(w.status)) {
    buttons.push(actionButton("Drain", "", async () => {
      await api(`/v1/workers/${enc(w.id)}/drain`, { method: "POST" });
      flash(w.name + " is draining: it finishes what it runs and takes nothing new");
      await refresh();
    }, "Really drain? Click again"));
  }
  if (w.status === "offline") {
    buttons.push(actionButton("Remove", "danger", async () => {
      await api(`/v1/workers/${enc(w.id)}`, { method: "DELETE" });
      flash(w.name + " is removed; its jobs' history keeps its name");
      await refresh();
    }, "Really remove? Click again"));
  }
  return buttons.length ? h("div", { class: "actions" }, buttons) : null;
}

// ---- a job's clone ----------------------------------------------------------------------------------

// A number field's value: the number, null when empty, or an error naming the field.
function numberField(input, label, { integer = false, empty = null } = {}) {
  const text = input.value.trim();
  // a number field holding what is not a number reads as empty: say so, not the default
  if (input.validity && input.validity.badInput) throw new Error(label + ": not a number");
  if (!text) return empty;
  const n = Number(text);
  if (!Number.isFinite(n) || (integer && !Number.isInteger(n))) {
    throw new Error(label + ": " + JSON.stringify(text) + " is not " + (integer ? "a whole number" : "a number"));
  }
  return n;
}

// The command, one argument a row (an argument may hold newlines: a script for -c).
function argvEditor(argv) {
  const list = h("ol", { class: "argv", id: "clone-argv" });
  const add = (value) => {
    const area = h("textarea", { rows: Math.min(8, value.split("\n").length), spellcheck: "false", class: "mono", "aria-label": "argument" });
    area.value = value;
    const row = h("li", {}, area, h("button", { type: "button", class: "quiet", "aria-label": "Remove this argument", onclick: () => row.remove() }, "✕"));
    list.append(row);
    return area;
  };
  for (const arg of argv) add(arg);
  const more = h("button", { type: "button", onclick: () => add("").focus() }, "Add an argument");
  return { el: h("div", {}, list, more), values: () => [...list.querySelectorAll("textarea")].map((a) => a.value) };
}

// The worker the original was aimed at (--worker, --select): the clone runs on any worker
// that fits unless that one is chosen, so a busy or removed worker does not refuse it.
function aimField(worker) {
  if (!worker) return null;
  const input = h("select", { id: "clone-worker", name: "worker" },
    h("option", { value: "" }, "any worker that fits"),
    h("option", { value: worker }, worker + " (as the original; waits while it is busy)"));
  input.value = "";
  return { input, el: h("div", { class: "filters" }, h("label", { for: "clone-worker" }, "Run on worker", input)) };
}

function cloneForm(box, job) {
  const spec = job.spec;
  const req = spec.requirements || {};
  const field = (id, label, value, props) => {
    const input = h("input", { id, name: id, size: 10, ...props });
    input.value = value === null || value === undefined ? "" : String(value);
    return [h("label", { for: id }, label, input), input];
  };
  const [nameL, name] = field("clone-name", "Name", spec.name, { size: 30, required: true, maxlength: 200 });
  const [prioL, priority] = field("clone-priority", "Priority (higher runs first)", spec.priority, { type: "number", step: "1" });
  const [gpusL, gpus] = field("clone-gpus", "GPUs", req.gpu_count || 0, { type: "number", min: "0", max: "64", step: "1" });
  const [vramL, vram] = field("clone-vram", "GPU memory at least (GiB)", req.min_vram_gib || "", { type: "number", min: "0", step: "any" });
  const [ramL, ram] = field("clone-ram", "RAM at least (GiB)", req.min_ram_gib || "", { type: "number", min: "0", step: "any" });
  const [triesL, tries] = field("clone-attempts", "Attempts at most", spec.max_attempts, { type: "number", min: "1", max: "100", step: "1" });
  const [timeL, timeout] = field("clone-timeout", "Timeout (s; empty: none)", spec.timeout, { type: "number", min: "1", step: "any" });
  const cpu = h("input", { id: "clone-cpu", type: "checkbox" });
  cpu.checked = Boolean(req.cpu_only);
  const argv = argvEditor(spec.command || []);
  const aim = aimField(req.worker);
  const error = h("p", { class: "error", role: "alert" });
  const submit = async (ev) => {
    ev.preventDefault();
    error.textContent = "";
    let body;
    try {
      body = {
        ...spec,
        name: name.value.trim(),
        command: argv.values(),
        priority: numberField(priority, "Priority", { integer: true, empty: 0 }),
        max_attempts: numberField(tries, "Attempts", { integer: true, empty: spec.max_attempts }),
        timeout: numberField(timeout, "Timeout"),
        requirements: {
          ...req,
          gpu_count: numberField(gpus, "GPUs", { integer: true, empty: 0 }),
          min_vram_gib: numberField(vram, "GPU memory", { empty: 0 }),
          min_ram_gib: numberField(ram, "RAM", { empty: 0 }),
          cpu_only: cpu.checked,
          worker: aim ? aim.input.value || null : null,
        },
      };
      if (!body.command.length) throw new Error("Command: it needs at least one argument");
    } catch (e) {
      error.textContent = e.message;
      return;
    }
    try {
      // kept on its worker, it waits there when that worker is busy (not a 409)
      const path = body.requirements.worker ? "/v1/jobs?queue=true" : "/v1/jobs";
      const done = await api(path, { method: "POST", body });
      flash("Submitted " + done.job.name + " as a clone of " + job.name + (done.warning ? ". " + done.warning : ""), Boolean(done.warning));
      location.hash = jobHref(done.job.id);
    } catch (e) {
      error.textContent = e.message; // the server's own words: which field, and why
    }
  };
  box.replaceChildren(h("section", { class: "clone", "aria-labelledby": "clone-title" },
    h("h2", { id: "clone-title" }, "Clone into a new job"),
    h("p", { class: "muted" }, "The new job keeps this one's pool (" + (spec.pool || "default") + "), inputs, " +
      "outputs, environment and settings; change what you need below."),
    h("form", { id: "clone-form", onsubmit: submit },
      h("div", { class: "filters" }, nameL, prioL, triesL, timeL),
      h("fieldset", {}, h("legend", {}, "Command" + (spec.shell ? " (run by the shell)" : "") + ": one argument a row"), argv.el),
      h("fieldset", {}, h("legend", {}, "Resources"),
        h("div", { class: "filters" }, gpusL, vramL, ramL,
          h("label", { for: "clone-cpu", class: "check" }, cpu, "CPU only")),
        aim ? aim.el : null),
      error,
      h("div", { class: "actions" },
        h("button", { type: "submit", class: "primary" }, "Submit the clone"),
        h("button", { type: "button", onclick: () => box.replaceChildren() }, "Cancel")))));
  name.focus();
}
