"""Commands about the fleet: server, worker, workers, drain, status, capability, config, tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gpufleet import config
from gpufleet.cli._common import (
    client,
    err,
    out,
    parse_pairs,
    print_json,
    resolve,
    setting_help,
    setting_option,
    styled,
    when,
)
from gpufleet.errors import GpufleetError
from gpufleet.wire import TokenCreate

ServerOpt = Annotated[str | None, setting_option("server")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
SimOpt = Annotated[str | None, setting_option("simulate_gpus", extra=', as "NAME:VRAM_GIB,..."')]

config_app = typer.Typer(help="Show the effective configuration.", no_args_is_help=True)
tokens_app = typer.Typer(help="Create, list and revoke tokens (admin).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    for cmd in (server, worker, workers, drain, status, capability):
        app.command()(cmd)
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
    max_blob_size: Annotated[str | None, setting_option("max_blob_size")] = None,
) -> None:
    """Run the server (queue, fleet state, API) until SIGINT or SIGTERM."""
    from gpufleet.server import QueueSettings, ServerOptions, serve

    s = resolve(
        host=host,
        port=port,
        data_dir=data_dir,
        db=db,
        lease_timeout=lease_timeout,
        prefer_cuda_grace=prefer_cuda_grace,
        retry_backoff=retry_backoff,
        max_blob_size=max_blob_size,
    )
    queue = QueueSettings(
        lease_timeout=s["lease_timeout"],
        prefer_cuda_grace=s["prefer_cuda_grace"],
        retry_backoff=s["retry_backoff"],
    )
    serve(
        ServerOptions(
            host=s["host"],
            port=s["port"],
            data_dir=s["data_dir"],
            db=s["db"],
            queue=queue,
            max_blob_size=s["max_blob_size"],
        )
    )


def worker(
    server: ServerOpt = None,
    name: Annotated[str | None, setting_option("name")] = None,
    labels: Annotated[str | None, setting_option("labels")] = None,
    slots: Annotated[int | None, setting_option("slots")] = None,
    ephemeral: Annotated[
        bool | None,
        typer.Option(
            "--ephemeral",
            help=setting_help("ephemeral"),
            show_default=False,
        ),
    ] = None,
    heartbeat: Annotated[float | None, setting_option("heartbeat")] = None,
    simulate_gpus: SimOpt = None,
    work_dir: Annotated[Path | None, setting_option("work_dir")] = None,
    drain_grace: Annotated[float | None, setting_option("drain_grace")] = None,
    pool: Annotated[str | None, setting_option("pool")] = None,
    cache_dir: Annotated[Path | None, setting_option("cache_dir")] = None,
    cache_size: Annotated[str | None, setting_option("cache_size")] = None,
    mount: Annotated[list[str] | None, setting_option("mount", extra="; repeatable")] = None,
) -> None:
    """Run a worker: detect this machine, claim jobs that fit, run them, report back."""
    from gpufleet.worker.agent import WorkerOptions, run_worker
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
        mount=",".join(mount) if mount else None,
    )
    cap = detect(simulate=s["simulate_gpus"])
    mounts = tuple(str(Path(m).expanduser().resolve()) for m in s["mount"].split(",") if m.strip())
    for m in mounts:
        if not Path(m).is_dir():
            raise GpufleetError(f"--mount {m}: no such folder on this machine")
    opts = WorkerOptions(
        server=s["server"],
        token=config.token_for(s["server"], s),
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
        mounts=mounts,
    )
    raise typer.Exit(run_worker(opts, cap))


def workers(server: ServerOpt = None, as_json: JsonOpt = False) -> None:
    """List workers: status, slots, GPUs, last heartbeat."""
    with client(server) as c:
        rows = c.workers()
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "STATUS", "SLOTS", "GPUS", "RUNNING", "HEARTBEAT"):
        table.add_column(col)
    for w in rows:
        sim = " (simulated)" if w.gpus_simulated else ""
        gpus = escape(", ".join(f"{g.name} {g.total_mib / 1024:.0f}GiB" for g in w.gpus) or "-")
        table.add_row(
            w.id,
            escape(w.name),
            styled(w.status),
            f"{w.slots['cpu']} cpu + {w.slots['gpu']} gpu",
            gpus + sim,
            str(len(w.running)),
            when(w.last_heartbeat),
        )
    out.print(table)


def drain(
    worker_ref: Annotated[str, typer.Argument(metavar="WORKER", help="Worker id or name.")],
    server: ServerOpt = None,
) -> None:
    """Stop giving a worker jobs; it finishes what it runs, then exits."""
    with client(server) as c:
        w = c.drain(worker_ref)
    out.print(f"{escape(w.name)} ({w.id}): {styled(w.status)}")


def status(server: ServerOpt = None, as_json: JsonOpt = False) -> None:
    """A summary of the fleet: jobs by status, workers by status, slots."""
    with client(server) as c:
        s = c.status()
    if as_json:
        print_json(s)
        return
    jobs = ", ".join(f"{n} {k}" for k, n in sorted(s.jobs.items())) or "no jobs"
    ws = ", ".join(f"{n} {k}" for k, n in sorted(s.workers.items())) or "no workers"
    out.print(
        f"jobs: {jobs}\nworkers: {ws}\nslots: {s.cpu_slots} CPU, {s.gpus} GPU ({s.gpus_free} free)"
    )


def capability(simulate_gpus: SimOpt = None) -> None:
    """Print what a worker on this machine would report, as JSON."""
    from gpufleet.worker.capability import capability_json, detect

    s = resolve(simulate_gpus=simulate_gpus)
    sys.stdout.write(
        json.dumps(capability_json(detect(simulate=s["simulate_gpus"])), indent=2) + "\n"
    )


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
        table.add_row(n, v, s, config.SETTINGS[n].env)
    out.print(table)


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="A label for the token, e.g. the machine it is for.")],
    role: Annotated[str, typer.Option(help="admin, operator, submitter or worker.")] = "worker",
    pool: Annotated[str | None, typer.Option(help="Pool the token is scoped to.")] = None,
    server: ServerOpt = None,
) -> None:
    """Create a token and print its secret once (the server keeps only its hash)."""
    with client(server) as c:
        t = c.create_token(TokenCreate(name=name, role=role, pool=pool))
    err.print(f"token {t.id} ({t.role}) created; the secret is shown once:")
    print(t.token)


@tokens_app.command("list")
def tokens_list(server: ServerOpt = None, as_json: JsonOpt = False) -> None:
    """List tokens (never their secrets)."""
    with client(server) as c:
        rows = c.tokens()
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "ROLE", "POOL", "CREATED", "REVOKED"):
        table.add_column(col)
    for t in rows:
        table.add_row(
            t.id,
            escape(t.name),
            t.role,
            escape(t.pool or "-"),
            when(t.created_at),
            when(t.revoked_at),
        )
    out.print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="Token id.")], server: ServerOpt = None
) -> None:
    """Revoke a token at once."""
    with client(server) as c:
        c.revoke_token(token_id)
    out.print(f"{token_id}: revoked")
