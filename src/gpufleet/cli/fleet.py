"""Commands about the fleet: server, worker, workers, drain, status, capability, config, tokens."""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from gpufleet import config, tokens
from gpufleet.cli import install
from gpufleet.cli._common import (
    CaOpt,
    SessionOpt,
    client,
    day,
    err,
    out,
    parse_pairs,
    print_json,
    resolve,
    setting_help,
    setting_option,
    shown,
    styled,
)
from gpufleet.cli.choose import session_client, worker_table
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.wire import TokenCreate, TokenCreated, WorkerOut

if TYPE_CHECKING:
    from gpufleet.worker.options import WorkerOptions

SHARE_TOKEN_ENV = "GPUFLEET_SHARE_TOKEN"
ServerOpt = Annotated[str | None, setting_option("server")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
SimOpt = Annotated[str | None, setting_option("simulate_gpus", extra=', as "NAME:VRAM_GIB,..."')]

config_app = typer.Typer(help="Show the effective configuration.", no_args_is_help=True)
tokens_app = typer.Typer(help="Create, list and revoke tokens (admin).", no_args_is_help=True)
workers_app = typer.Typer(subcommand_metavar="[COMMAND [ARGS]...]")


def register(app: typer.Typer) -> None:
    for cmd in (server, drain, status, hosts, capability, audit, whoami):
        app.command()(cmd)
    app.add_typer(install.worker_group(worker), name="worker")  # `worker` runs it, plus `install`
    app.add_typer(workers_app, name="workers")  # `workers` lists them, plus `rm`
    app.add_typer(config_app, name="config")
    app.add_typer(tokens_app, name="tokens")


def server(
    host: Annotated[str | None, setting_option("host")] = None,
    port: Annotated[int | None, setting_option("port")] = None,
    data_dir: Annotated[Path | None, setting_option("data_dir")] = None,
    db: Annotated[
        str | None, setting_option("db", extra=", e.g. postgresql://user@host/db")
    ] = None,
    lease_timeout: Annotated[float | None, setting_option("lease_timeout")] = None,
    prefer_cuda_grace: Annotated[float | None, setting_option("prefer_cuda_grace")] = None,
    retry_backoff: Annotated[float | None, setting_option("retry_backoff")] = None,
    ephemeral_ttl: Annotated[float | None, setting_option("ephemeral_ttl")] = None,
    log_retention: Annotated[float | None, setting_option("log_retention")] = None,
    audit_retention: Annotated[float | None, setting_option("audit_retention")] = None,
    output_quota: Annotated[str | None, setting_option("output_quota")] = None,
    output_rate: Annotated[str | None, setting_option("output_rate")] = None,
    output_burst: Annotated[str | None, setting_option("output_burst")] = None,
    max_blob_size: Annotated[str | None, setting_option("max_blob_size")] = None,
    blob_store: Annotated[str | None, setting_option("blob_store")] = None,
    s3_endpoint: Annotated[str | None, setting_option("s3_endpoint")] = None,
    tls_cert: Annotated[Path | None, setting_option("tls_cert")] = None,
    tls_key: Annotated[Path | None, setting_option("tls_key")] = None,
    access_log: Annotated[
        bool | None,
        typer.Option("--access-log", help=setting_help("access_log"), show_default=False),
    ] = None,
    metrics_public: Annotated[
        bool | None,
        typer.Option("--metrics-public", help=setting_help("metrics_public"), show_default=False),
    ] = None,
    api_docs: Annotated[
        bool | None,
        typer.Option("--api-docs", help=setting_help("api_docs"), show_default=False),
    ] = None,
    trusted_proxies: Annotated[
        str | None,
        typer.Option("--trusted-proxies", help=setting_help("trusted_proxies"), show_default=False),
    ] = None,
) -> None:
    """Run the server (queue, fleet state, API) until SIGINT or SIGTERM."""
    from gpufleet.domain.quota import OutputQuota
    from gpufleet.server import QueueSettings, ServerOptions, serve
    from gpufleet.server.limits import Limits

    s = resolve(
        host=host,
        port=port,
        data_dir=data_dir,
        db=db,
        lease_timeout=lease_timeout,
        prefer_cuda_grace=prefer_cuda_grace,
        retry_backoff=retry_backoff,
        ephemeral_ttl=ephemeral_ttl,
        log_retention=log_retention,
        audit_retention=audit_retention,
        output_quota=output_quota,
        output_rate=output_rate,
        output_burst=output_burst,
        max_blob_size=max_blob_size,
        blob_store=blob_store,
        s3_endpoint=s3_endpoint,
        tls_cert=tls_cert,
        tls_key=tls_key,
        access_log=access_log,
        metrics_public=metrics_public,
        api_docs=api_docs,
        trusted_proxies=trusted_proxies,
    )
    queue = QueueSettings(
        lease_timeout=s["lease_timeout"],
        prefer_cuda_grace=s["prefer_cuda_grace"],
        retry_backoff=s["retry_backoff"],
        ephemeral_ttl=s["ephemeral_ttl"],
        log_retention=_seconds(s["log_retention"], DAY),
        audit_retention=_seconds(s["audit_retention"], DAY),
        output_quota=OutputQuota(s["output_quota"], s["output_rate"], s["output_burst"]),
    )
    serve(
        ServerOptions(
            host=s["host"],
            port=s["port"],
            data_dir=s["data_dir"],
            db=s["db"],
            queue=queue,
            max_blob_size=s["max_blob_size"],
            blob_store=s["blob_store"],
            s3_endpoint=s["s3_endpoint"],
            tls_cert=s["tls_cert"],
            tls_key=s["tls_key"],
            access_log=s["access_log"],
            metrics_public=s["metrics_public"],
            api_docs=s["api_docs"],
            limits=Limits(trusted_proxies=proxies(s["trusted_proxies"])),
        )
    )


DAY, HOUR = 86400.0, 3600.0


def proxies(given: str | None) -> tuple[str, ...]:
    """``--trusted-proxies`` as addresses and networks; a bad one is named."""
    import ipaddress

    found = tuple(p.strip() for p in (given or "").split(",") if p.strip())
    for entry in found:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ConfigError(
                f"--trusted-proxies: {entry!r} is not an address or network (such as "
                "127.0.0.1 or 10.0.0.0/8)"
            ) from None
    return found


def _seconds(retention: float, unit: float) -> float | None:
    """A retention setting (in days or hours, ``unit`` seconds each) in seconds; None
    (keep forever) for 0."""
    return retention * unit if retention > 0 else None


Ephemeral = Annotated[
    bool | None,
    typer.Option("--ephemeral", help=setting_help("ephemeral"), show_default=False),
]
PythonDownloads = Annotated[
    bool | None,
    typer.Option(
        "--env-python-downloads",
        help=setting_help("env_python_downloads"),
        show_default=False,
    ),
]
ShareToken = Annotated[
    bool,
    typer.Option(
        "--share-token",
        help="Put the submit token in GPUFLEET_SHARE_TOKEN (a submitter token of this "
        "worker's pool only) into the session string the worker prints, so whoever gets "
        "the string can send jobs here. Off a terminal the string goes to a 0600 file.",
    ),
]
Mounts = Annotated[list[str] | None, setting_option("mount", extra="; repeatable")]


def worker(
    server: ServerOpt = None,
    name: Annotated[str | None, setting_option("name")] = None,
    labels: Annotated[str | None, setting_option("labels")] = None,
    slots: Annotated[int | None, setting_option("slots")] = None,
    ephemeral: Ephemeral = None,
    heartbeat: Annotated[float | None, setting_option("heartbeat")] = None,
    simulate_gpus: SimOpt = None,
    work_dir: Annotated[Path | None, setting_option("work_dir")] = None,
    drain_grace: Annotated[float | None, setting_option("drain_grace")] = None,
    pool: Annotated[str | None, setting_option("pool")] = None,
    cache_dir: Annotated[Path | None, setting_option("cache_dir")] = None,
    cache_size: Annotated[str | None, setting_option("cache_size")] = None,
    log_backlog: Annotated[str | None, setting_option("log_backlog")] = None,
    work_dir_retention: Annotated[float | None, setting_option("work_dir_retention")] = None,
    env_cache_dir: Annotated[Path | None, setting_option("env_cache_dir")] = None,
    env_cache_size: Annotated[str | None, setting_option("env_cache_size")] = None,
    env_find_links: Annotated[str | None, setting_option("env_find_links")] = None,
    env_index_url: Annotated[str | None, setting_option("env_index_url")] = None,
    env_build_timeout: Annotated[float | None, setting_option("env_build_timeout")] = None,
    env_python_downloads: PythonDownloads = None,
    env_torch_backend: Annotated[str | None, setting_option("env_torch_backend")] = None,
    env_builds: Annotated[str | None, setting_option("env_builds")] = None,
    mount: Mounts = None,
    ca: CaOpt = None,
    share_token: ShareToken = False,
    run_as: Annotated[str | None, setting_option("run_as")] = None,
) -> None:
    """Run a worker: detect this machine, claim jobs that fit, run them, report back.
    It prints a session string; `gpufleet submit --session STRING` sends a job to it.

    Its token: GPUFLEET_TOKEN (or `token` in a config file), else the worker token the
    server on this machine saved for its workers (pool default); never the admin's."""
    from gpufleet.worker.agent import run_worker
    from gpufleet.worker.capability import detect

    s = resolve(
        server=server,
        name=name,
        labels=labels,
        slots=slots,
        ephemeral=ephemeral,
        heartbeat=heartbeat,
        simulate_gpus=simulate_gpus,
        work_dir=work_dir,
        drain_grace=drain_grace,
        pool=pool,
        cache_dir=cache_dir,
        cache_size=cache_size,
        log_backlog=log_backlog,
        work_dir_retention=work_dir_retention,
        env_cache_dir=env_cache_dir,
        env_cache_size=env_cache_size,
        env_find_links=env_find_links,
        env_index_url=env_index_url,
        env_build_timeout=env_build_timeout,
        env_python_downloads=env_python_downloads,
        env_torch_backend=env_torch_backend,
        env_builds=env_builds,
        mount=",".join(mount) if mount else None,
        ca=ca,
        run_as=run_as,
    )
    notes: list[str] = []
    cap = detect(simulate=s["simulate_gpus"], notes=notes)
    for note in notes:
        err.print(f"[yellow]note:[/yellow] {shown(note)}")
    raise typer.Exit(run_worker(_worker_options(s, share_token), cap))


def _worker_options(s: config.Resolved, share_token: bool) -> WorkerOptions:
    """The worker's options from its resolved settings; every ``--mount`` must exist."""
    from gpufleet.worker.options import WorkerOptions

    mounts = tuple(str(Path(m).expanduser().resolve()) for m in s["mount"].split(",") if m.strip())
    for m in mounts:
        if not Path(m).is_dir():
            raise GpufleetError(f"--mount {m}: no such folder on this machine")
    return WorkerOptions(
        server=s["server"],
        token=_worker_token(s),
        name=s["name"],
        labels=parse_pairs([s["labels"]], "--labels"),
        cpu_slots=1 if s["slots"] is None else s["slots"],
        ephemeral=s["ephemeral"],
        heartbeat=s["heartbeat"],
        work_dir=s["work_dir"],
        drain_grace=s["drain_grace"],
        pool=s["pool"],
        cache_dir=s["cache_dir"],
        cache_size=s["cache_size"],
        log_backlog=s["log_backlog"],
        work_dir_retention=_seconds(s["work_dir_retention"], HOUR),
        mounts=mounts,
        ca=s["ca"],
        share_token=_share_token() if share_token else None,
        run_as=tuple(u.strip() for u in s["run_as"].split(",") if u.strip()),
        env_cache_dir=s["env_cache_dir"],
        env_cache_size=s["env_cache_size"],
        env_find_links=tuple(f.strip() for f in s["env_find_links"].split(",") if f.strip()),
        env_index_url=s["env_index_url"] or None,
        env_build_timeout=s["env_build_timeout"],
        env_python_downloads=s["env_python_downloads"],
        env_torch_backend=s["env_torch_backend"],
        env_allow_builds=_builds(s["env_builds"]),
    )


def _builds(value: str) -> bool | None:
    """``--env-builds``: auto (None: only where the worker is not root), always, never."""
    choices = {"auto": None, "always": True, "never": False}
    if value not in choices:
        raise ConfigError(f"--env-builds {value!r}: expected auto, always or never")
    return choices[value]


def _worker_token(s: config.Resolved) -> str | None:
    """The configured token; else the worker token the local server saved for this
    machine's workers (pool default), never the admin's: a job must not act as the admin."""
    token = config.worker_token_for(s["server"], s)
    configured = bool(str(s["token"] or "").strip())
    if token and not configured and s["pool"] not in (None, "default"):
        raise ConfigError(
            f"--pool {s['pool']}: the worker token this machine's server saved is for pool "
            "'default'; make one for this pool (gpufleet tokens create --role worker --pool "
            f"{s['pool']} --name NAME) and give it as GPUFLEET_TOKEN"
        )
    if token is None and config.load_token(s["server"]):
        raise ConfigError(
            f"no worker token for {s['server']}: a worker does not run with the admin's "
            "token. Start the server on this machine again (it saves one for its local "
            "workers), or make one (gpufleet tokens create --role worker --name NAME) and "
            "give it as GPUFLEET_TOKEN"
        )
    return token


def _share_token() -> str:
    token = os.environ.get(SHARE_TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError(
            f"--share-token: set {SHARE_TOKEN_ENV} to a submitter token of this worker's pool "
            "(gpufleet tokens create --role submitter --pool POOL); tokens are never taken "
            "from the command line"
        )
    return tokens.clean(token, SHARE_TOKEN_ENV)


@workers_app.callback(invoke_without_command=True)
def workers(
    ctx: typer.Context,
    pool: Annotated[str | None, typer.Option(help="Only this pool's workers.")] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List workers: status (connecting, available, reserved, busy, draining, offline),
    host, GPUs with free/total memory, running jobs, labels (* fixed by the worker's
    token), and when it was last seen or how long it has been gone. `workers rm` forgets
    an offline one."""
    if ctx.invoked_subcommand is not None:
        return
    with client(server, ca) as c:
        rows = c.workers(pool)
    if as_json:
        print_json(rows)
        return
    if not rows:
        err.print("no workers" + (f" in pool {shown(repr(pool))}" if pool else ""))
        return
    out.print(worker_table(rows))


def hosts(server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False) -> None:
    """List the manifests' [hosts.NAME] declarations: the host (the worker of that
    --name), what it narrows of what the worker offers (cuda, gpus, vram_gib, ram_gib,
    allow_jobs, deny_jobs), its priority, the manifest and file it came from, and when and
    by which token it was applied. A later manifest's entry for a host replaces it."""
    with client(server, ca) as c:
        rows = c.hosts()
    if as_json:
        print_json(rows)
        return
    if not rows:
        err.print("no host declarations (a manifest's [hosts.NAME] tables; gpufleet apply)")
        return
    table = Table(box=None, header_style="bold")
    for col in ("HOST", "NARROWS", "PRIORITY", "MANIFEST", "FILE", "APPLIED", "BY"):
        table.add_column(col)
    for h in rows:
        table.add_row(
            shown(h.name),
            shown(", ".join(h.narrows) or "-"),
            str(h.policy.priority),
            shown(h.manifest),
            shown(h.file or "-"),
            day(h.applied_at),
            shown(h.applied_by or "-"),
        )
    out.print(table)


def audit(
    since: Annotated[
        str | None,
        typer.Option(
            help="Only calls since then: a duration back from now (30m, 2h, 7d) or a date "
            "and time (2026-11-23, 2026-11-23T09:00)."
        ),
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, oldest first.", min=1)] = 1000,
    after: Annotated[int, typer.Option(help="Only records past this SEQ (to page on).", min=0)] = 0,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The audit log: every state-changing call, who made it, from where, and how it ended,
    and the server's lifecycle events (worker registered, offline, removed; lease lost)
    (admin, operator of every pool)."""
    start = parse_since(since) if since else None
    with client(server, ca) as c:
        rows = c.audit(start, limit, after)
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("SEQ", "WHEN", "WHO", "ROLE", "FROM", "CALL OR EVENT", "STATUS", "TARGET"):
        table.add_column(col, overflow="fold" if col == "CALL OR EVENT" else "ellipsis")
    for a in rows:
        who = f"{a.token_name} ({a.token_id})" if a.token_id else "-"
        what = f"{a.event}: {a.detail}" if a.event else f"{a.method} {a.path}"
        table.add_row(
            str(a.seq),
            a.at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
            shown(who),
            shown(a.role or ("server" if a.event else "-")),
            shown(a.address),
            shown(what),
            "-" if a.status is None else str(a.status),
            shown(a.target or "-"),
        )
    out.print(table)
    if len(rows) == limit:
        err.print(f"more records follow: gpufleet audit --after {rows[-1].seq}")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``30m``, ``2h``, ``7d``, ``45s`` back from ``now``, or an ISO date/time (local time
    unless it names a zone). ConfigError naming the flag otherwise."""
    now = now or datetime.now(UTC)
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"--since {text!r}: expected a duration like 30m, 2h or 7d, or a date like "
            "2026-11-23 or 2026-11-23T09:00"
        ) from None
    return when if when.tzinfo else when.astimezone()


WorkerArg = Annotated[str, typer.Argument(metavar="WORKER", help="Worker id or name.")]


def _acted(w: WorkerOut, as_json: bool, what: str) -> None:
    if as_json:
        print_json(w)
    else:
        out.print(f"{shown(w.name)} ({shown(w.id)}): {what}")


@workers_app.command("rm")
def workers_rm(
    worker_ref: WorkerArg, server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False
) -> None:
    """Forget an offline worker (admin, operator). A worker that is not offline is
    refused: drain it first. Its jobs' history keeps its name."""
    with client(server, ca) as c:
        w = c.remove_worker(worker_ref)
    _acted(w, as_json, "removed")


def drain(
    worker_ref: WorkerArg, server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False
) -> None:
    """Stop giving a worker jobs; it finishes what it runs, then exits (and shows offline)."""
    with client(server, ca) as c:
        w = c.drain(worker_ref)
    _acted(w, as_json, styled(w.status))


def status(server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False) -> None:
    """A summary of the fleet: jobs by status, workers by status, and the slots of the
    workers not offline, with how many are free (not running a job, not held for one)."""
    with client(server, ca) as c:
        s = c.status()
    if as_json:
        print_json(s)
        return
    jobs = shown(", ".join(f"{n} {k}" for k, n in sorted(s.jobs.items())) or "no jobs")
    ws = shown(", ".join(f"{n} {k}" for k, n in sorted(s.workers.items())) or "no workers")
    out.print(
        f"jobs: {jobs}\nworkers: {ws}\n"
        f"slots of the workers not offline: {s.cpu_slots} CPU ({s.cpu_slots_free} free), "
        f"{s.gpus} GPU ({s.gpus_free} free)\n"
        "free: not running a job and not held for one that waits for that worker"
    )


def whoami(
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The token this CLI uses (or the session's): its id, name, role and pools; never its
    secret."""
    with session_client(server, ca, session) as c:
        me = c.whoami()
        url = c.server
    if as_json:
        print_json(me)
        return
    pools = ", ".join(me.pools) or "every pool"
    who = f"{shown(me.id)} ({shown(me.name)}): {shown(me.role)}"
    out.print(f"{who} of {shown(pools)} on {shown(url)}")


def capability(simulate_gpus: SimOpt = None) -> None:
    """Print what a worker on this machine would report, as JSON."""
    from gpufleet.worker.capability import capability_json, detect

    s = resolve(simulate_gpus=simulate_gpus)
    notes: list[str] = []
    cap = detect(simulate=s["simulate_gpus"], notes=notes)
    for note in notes:
        err.print(f"[yellow]note:[/yellow] {shown(note)}")
    sys.stdout.write(json.dumps(capability_json(cap), indent=2) + "\n")


@config_app.command("show")
def config_show(as_json: JsonOpt = False) -> None:
    """Every effective setting, its value and where it came from."""
    resolved = config.resolve()
    rows = resolved.rows()
    if resolved["token"] is None and config.load_token(resolved["server"]):
        saved = f"file {config.credentials_path()} (for {resolved['server']})"
        rows = [(n, "****", saved) if n == "token" else (n, v, s) for n, v, s in rows]
    if as_json:
        print_json([{"name": n, "value": v, "source": s} for n, v, s in rows])
        return
    table = Table(box=None, header_style="bold")
    for col in ("SETTING", "VALUE", "SOURCE", "ENV"):
        table.add_column(col)
    for n, v, s in rows:
        table.add_row(n, shown(v), shown(s), config.SETTINGS[n].env)
    out.print(table)


def _enroll_hint(server: str, pool: str, name: str) -> str:
    """The commands that enroll a machine with a new worker token (the token is pasted at a
    prompt into the environment, so it is in no argv and no shell history)."""
    return (
        "To enroll a machine as a worker of pool "
        f"{pool!r}, run there and paste the token at the prompt:\n"
        "  read -rs GPUFLEET_TOKEN && export GPUFLEET_TOKEN\n"
        f"  gpufleet worker --server {shlex.quote(server)} --pool {shlex.quote(pool)} "
        f"--name {shlex.quote(name)}\n"
        "or, for a worker that starts with the machine: gpufleet worker install --systemd"
    )


def _show_secret(t: TokenCreated, server: str, what: str, as_json: bool = False) -> None:
    """The secret alone on stdout (for scripts), everything else on stderr; or all of it
    as JSON on stdout."""
    if as_json:
        sys.stdout.write(json.dumps(t.model_dump(mode="json"), indent=2) + "\n")
        return
    scope = f", pool {shown(', '.join(t.pools))}" if t.pools else ""
    expires = f", expires {t.expires_at:%Y-%m-%d %H:%M} UTC" if t.expires_at else ""
    err.print(
        f"token {shown(t.id)} ({shown(t.role)}{scope}{expires}) {what}; the secret is shown once:"
    )
    print(t.token, flush=True)
    if t.role == "worker":
        hint = _enroll_hint(server, t.pools[0], t.name)
        err.print("\n".join(map(shown, hint.splitlines())))


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="A label for the token, e.g. the machine it is for.")],
    role: Annotated[str, typer.Option(help="admin, operator, submitter or worker.")] = "worker",
    pool: Annotated[
        list[str] | None,
        typer.Option(
            help="Pool the token is scoped to (repeatable for a submitter or operator; a "
            "worker token has exactly one; default: 'default'). An operator token without "
            "--pool, and an admin token, act on every pool."
        ),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            help="k=v (repeatable), worker tokens: a label every worker enrolled with this "
            "token carries, whatever it declares (jobs can trust it, e.g. team=nlp)."
        ),
    ] = None,
    expires: Annotated[
        float | None, typer.Option(help="Days until the token stops working (default: never).")
    ] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the token as JSON (its secret included).")
    ] = False,
) -> None:
    """Create a token and print its secret once (the server keeps only its hash); for a
    worker token, also the command that enrolls a machine."""
    labels = parse_pairs(label or [], "--label")
    body = TokenCreate(name=name, role=role, pools=pool or [], expires_days=expires, labels=labels)
    with client(server, ca) as c:
        t = c.create_token(body)
        url = c.server
    _show_secret(t, url, "created", as_json)


@tokens_app.command("ls")
def tokens_list(server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False) -> None:
    """List tokens: id, name, role, pools, the secret's first characters, dates (never a
    secret)."""
    with client(server, ca) as c:
        rows = c.tokens()
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in (
        "ID",
        "NAME",
        "ROLE",
        "POOLS",
        "LABELS",
        "STARTS",
        "CREATED",
        "EXPIRES",
        "REVOKED",
    ):
        table.add_column(col)
    for t in rows:
        table.add_row(
            shown(t.id),
            shown(t.name),
            shown(t.role),
            shown(",".join(t.pools) or "(all)"),
            shown(",".join(f"{k}={v}" for k, v in t.labels.items()) or "-"),
            shown(t.hint),
            day(t.created_at),
            day(t.expires_at),
            day(t.revoked_at),
        )
    out.print(table)


tokens_app.command("list", hidden=True)(tokens_list)


SecretJsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the token as JSON (its new secret included).")
]


@tokens_app.command("rotate")
def tokens_rotate(
    token_id: Annotated[str, typer.Argument(help="Token id.")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: SecretJsonOpt = False,
) -> None:
    """Give a token a new secret (same id, role and pools); the old secret fails at once."""
    with client(server, ca) as c:
        t = c.rotate_token(token_id)
        url = c.server
    _show_secret(t, url, "rotated", as_json)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="Token id.")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke a token at once; workers it enrolled go offline and their jobs are requeued."""
    with client(server, ca) as c:
        t = c.revoke_token(token_id)
    if as_json:
        print_json(t)
        return
    out.print(f"{shown(token_id)}: revoked")
