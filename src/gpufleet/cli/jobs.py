"""Commands about jobs: apply, jobs, show, logs, stop, cancel, requeue, why (``submit``
and ``watch`` have their own modules)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gpufleet.cli._common import (
    CaOpt,
    SessionOpt,
    client,
    duration,
    err,
    out,
    print_json,
    setting_option,
    styled,
    when,
)
from gpufleet.cli.choose import session_client
from gpufleet.cli.show import error_line, show_detail
from gpufleet.client import Client
from gpufleet.domain.models import InputKind
from gpufleet.errors import ManifestError
from gpufleet.wire import (
    HostModel,
    InputModel,
    JobOut,
    JobSpecModel,
    LogEntry,
    ManifestApply,
)

ServerOpt = Annotated[str | None, setting_option("server")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
JobArg = Annotated[str, typer.Argument(help="Job id (or a name that only one job has).")]


def register(app: typer.Typer) -> None:
    for cmd in (apply, jobs, show, logs, stop, cancel, requeue, why):
        app.command()(cmd)


def default_name(command: list[str]) -> str:
    """The command's words, paths shortened to their last part (a name holds no ``/``,
    so ``gpufleet show NAME`` can address it)."""
    short = " ".join(word.rstrip("/").rsplit("/", 1)[-1] or word for word in command)
    return short.replace("/", "_")[:80]


def load_plan(file: Path, c: Client, quiet: bool) -> ManifestApply:
    """Parse a manifest and upload the packages its jobs name (each once)."""
    from gpufleet.cli.data import package_inputs  # only `apply` reads manifests
    from gpufleet.domain.manifest import parse_manifest

    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{file}: cannot read the manifest: {exc.strerror or exc}") from exc
    base = file.resolve().parent
    plan = parse_manifest(text, str(file), base_dir=str(base))
    uploaded: dict[tuple[str, str], InputModel] = {}
    jobs = []
    for spec in plan.jobs:
        local = [i for i in spec.inputs if i.kind == InputKind.LOCAL]
        for inp in local:
            key = (inp.ref, spec.pool)
            if key not in uploaded:
                item = inp.ref if inp.dest == "." else f"{inp.dest}={inp.ref}"
                uploaded[key] = package_inputs(c, [item], spec.pool, quiet, base)[0]
        rest = tuple(i for i in spec.inputs if i.kind != InputKind.LOCAL)
        model = JobSpecModel.from_domain(replace(spec, inputs=rest))
        staged = [uploaded[(i.ref, spec.pool)].model_copy(update={"dest": i.dest}) for i in local]
        jobs.append(model.model_copy(update={"inputs": staged + model.inputs}))
    return ManifestApply(
        name=plan.name, hosts=[HostModel.from_domain(h) for h in plan.hosts], jobs=jobs
    )


def apply(
    file: Annotated[Path, typer.Argument(help="The manifest (TOML).")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Apply a manifest: new jobs are queued, existing ones keep their status."""
    with client(server, ca) as c:
        plan = load_plan(file, c, as_json)
        result = c.apply(plan)
    if as_json:
        print_json(result)
        return
    out.print(
        f"manifest {result.manifest}: {len(result.created)} new job(s), "
        f"{len(result.updated)} updated, {len(result.unchanged)} unchanged, "
        f"{len(result.hosts)} host(s)"
    )
    for host in result.unknown_hosts:
        err.print(
            f"[yellow]warning:[/yellow] no registered worker is named {escape(repr(host))}; "
            "its hosts entry applies once one registers (workers are named by --name, "
            "default: hostname)"
        )
    for job_id, reason in result.unrunnable.items():
        err.print(f"[yellow]warning:[/yellow] {job_id}: {escape(reason)}")
    if result.absent:
        out.print(
            f"{len(result.absent)} job(s) of manifest {escape(result.manifest)} are no longer "
            f"in it; they stay (cancel those still queued to stop them): "
            + ", ".join(result.absent)
        )


def job_table(rows: list[JobOut]) -> Table:
    table = Table(box=None, header_style="bold")
    for col in (
        "ID",
        "NAME",
        "STATUS",
        "ATT",
        "WORKER",
        "GPUS",
        "STARTED",
        "TOOK",
        "EXIT",
        "ERROR",
    ):
        table.add_column(col, overflow="fold" if col == "ERROR" else "ellipsis")
    for j in rows:
        table.add_row(
            j.id,
            escape(j.name),
            styled(j.status),
            f"{j.attempts}/{j.max_attempts}",
            escape(j.worker or "-"),
            ",".join(map(str, j.gpus)) or "-",
            when(j.started_at),
            duration(j.started_at, j.finished_at),
            "-" if j.exit_code is None else str(j.exit_code),
            escape(error_line(j)[:160]),
        )
    return table


def jobs(
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    status: Annotated[
        str | None, typer.Option(help="Only these statuses, comma-separated.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many jobs.")] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, oldest first; a failed job's ERROR ends with the last line of its stderr."""
    with session_client(server, ca, session) as c:
        rows = c.jobs(status, limit)
    if as_json:
        print_json(rows)
    else:
        out.print(job_table(rows))


def show(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one job: spec, state, why it failed (its stderr's last lines), what it waits
    for, its artifact, and every attempt."""
    with session_client(server, ca, session) as c:
        d = c.job(job)
    if as_json:
        print_json(d)
        return
    show_detail(d)


def logs(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    follow_: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep printing until the job ends, then say how it ended (exit code 1 "
            "unless it succeeded).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print a job's output (stdout and stderr)."""
    with session_client(server, ca, session) as c:
        status = follow(c, job, as_json, keep_going=follow_)
        if not follow_:
            return
        d = c.job(job)
    said = f": {d.error}" if d.error and status != "cancelled" else ""
    err.print(f"job {d.id} {styled(status)}{escape(said)}")
    if status != "succeeded":
        raise typer.Exit(1)


def follow(c: Client, job: str, as_json: bool, keep_going: bool = True) -> str:
    """Print a job's output until it ends (or what it has, without ``keep_going``); its
    status. Following reads the job's event stream (SSE), which resumes after a broken
    connection with nothing missed or printed twice."""
    if not keep_going:
        after = 0
        while True:
            page = c.logs(job, after)
            _print_lines(page.lines, as_json)
            after = page.next
            if not page.more and len(page.lines) < 10_000:  # a page stops at a byte budget too
                return page.status
    d = c.job(job)
    status: str = d.status
    for event in c.follow(d.id):
        if event.type == "log":
            _print_lines([LogEntry.model_validate(event.data)], as_json)
        elif event.type in ("state", "end"):
            status = str(event.data["status"])
    return status


def _print_lines(lines: Sequence[LogEntry], as_json: bool) -> None:
    for ln in lines:
        if as_json:
            sys.stdout.write(ln.model_dump_json() + "\n")
        else:
            (sys.stdout if ln.stream == "stdout" else sys.stderr).write(ln.line + "\n")
    sys.stdout.flush()
    sys.stderr.flush()


def cancel(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a job; a running one is killed with its whole process group. A submitter
    token cancels only the jobs it submitted."""
    with session_client(server, ca, session) as c:
        j = c.cancel(job)
    _acted(j, as_json)


def stop(
    job: JobArg,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            "--stop-grace",
            min=0,
            help="Seconds the job has after SIGINT to save and exit; then SIGTERM, and "
            "SIGKILL 3 s later.",
        ),
    ] = 60.0,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Ask a running job to finish early and keep what it made: its process group gets
    SIGINT (a training script saves its model and exits), its outputs are kept, and it
    ends succeeded (stopped early) if it exits 0. `cancel` kills and keeps nothing. A
    submitter token stops only the jobs it submitted."""
    with session_client(server, ca, session) as c:
        j = c.stop(job, grace)
    if as_json:
        print_json(j)
    else:
        out.print(f"{j.id}: {styled(j.status)}, asked to stop (SIGINT; SIGTERM after {grace:g}s)")


def requeue(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue a failed or cancelled job again, with a fresh attempt budget. A submitter
    token requeues only the jobs it submitted."""
    with session_client(server, ca, session) as c:
        j = c.requeue(job)
    _acted(j, as_json)


def _acted(j: JobOut, as_json: bool) -> None:
    if as_json:
        print_json(j)
    else:
        out.print(f"{j.id}: {styled(j.status)}")


def why(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Why a job waits: what it waits for (a job it needs, a backoff), its place in the
    queue, and for every worker its status and every constraint that keeps it from
    taking the job."""
    with session_client(server, ca, session) as c:
        w = c.why(job)
    if as_json:
        print_json(w)
        return
    out.print(f"[bold]{w.job_id}[/bold] is {styled(w.status)}: {escape(w.summary)}")
    table = Table(box=None, header_style="bold")
    for col in ("WORKER", "STATUS", "VERDICT"):
        table.add_column(col)
    for r in w.workers:
        table.add_row(
            escape(r.name),
            styled(r.status),
            escape("\n".join(r.reasons) or r.reason or "") or "[green]may run it[/green]",
        )
    if w.workers:
        out.print(table)
