"""Commands about the fleet's workers: workers (and ``workers rm``), drain, status, hosts."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import (
    CaOpt,
    JsonOpt,
    ServerOpt,
    client,
    day,
    err,
    out,
    print_json,
    shown,
    styled,
)
from gpufleet.cli.choose import worker_table
from gpufleet.domain.owner import state_lines
from gpufleet.wire import WorkerOut

workers_app = typer.Typer(subcommand_metavar="[COMMAND [ARGS]...]")


def register(app: typer.Typer) -> None:
    for cmd in (drain, status, hosts):
        app.command()(cmd)
    app.add_typer(workers_app, name="workers")  # `workers` lists them, plus `rm`


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
    for w in rows:
        if w.owner is not None:  # what its workstation's owner policy says now
            lines = state_lines(w.owner.to_domain()) or ["taking jobs"]
            out.print(f"{shown(w.name)} (owner policy):")
            for line in lines:
                out.print(f"  {shown(line)}")


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
    worker_ref: WorkerArg,
    deadline: Annotated[
        float | None,
        typer.Option(
            "--deadline",
            metavar="SECONDS",
            min=0,
            help="Vacate what it still runs after this long: each job gets its grace "
            "signal, its checkpoint is kept, and it goes back to the queue.",
        ),
    ] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop giving a worker jobs; it finishes what it runs (or, with --deadline, vacates
    it then), then exits (and shows offline)."""
    with client(server, ca) as c:
        w = c.drain(worker_ref, deadline)
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
