"""Commands about jobs: apply, jobs, show, logs, stop, cancel, pause, resume, requeue,
why (``submit`` and ``watch`` have their own modules)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.table import Table

from gpufleet.cli._common import (
    CaOpt,
    JsonOpt,
    ServerOpt,
    SessionOpt,
    client,
    duration,
    err,
    out,
    print_json,
    shown,
    styled,
    when,
)
from gpufleet.cli.attempts import attempt_lines
from gpufleet.cli.choose import host_note, session_client
from gpufleet.cli.show import error_line, show_detail
from gpufleet.client import Client
from gpufleet.domain.environments import EnvRequest
from gpufleet.domain.models import InputKind
from gpufleet.errors import ConfigError, ManifestError
from gpufleet.terminal import for_terminal
from gpufleet.wire import (
    BAR_END,
    EnvironmentModel,
    HostModel,
    InputModel,
    JobOut,
    JobSpecModel,
    LogEntry,
    ManifestApply,
)

JobArg = Annotated[str, typer.Argument(help="Job id (or a name that only one job has).")]


def register(app: typer.Typer) -> None:
    for cmd in (apply, jobs, show, logs, stop, cancel, pause, resume, requeue, why):
        app.command()(cmd)


def default_name(command: list[str]) -> str:
    """The command's words, paths shortened to their last part (a name holds no ``/``,
    so ``gpufleet show NAME`` can address it)."""
    short = " ".join(word.rstrip("/").rsplit("/", 1)[-1] or word for word in command)
    return short.replace("/", "_")[:80]


def load_plan(file: Path, c: Client, quiet: bool, hyper_check: bool = True) -> ManifestApply:
    """Parse a manifest, check its jobs' hyper.* keys against their scripts' options
    (unless not ``hyper_check``), and upload the packages its jobs name (each once)."""
    from gpufleet.cli.data import package_inputs  # only `apply` reads manifests
    from gpufleet.cli.environments import environment_model
    from gpufleet.cli.hypercheck import check_hyper
    from gpufleet.domain.manifest import parse_manifest

    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{file}: cannot read the manifest: {exc.strerror or exc}") from exc
    base = file.resolve().parent
    plan = parse_manifest(text, str(file), base_dir=str(base))
    if hyper_check:  # before anything is uploaded: a refused manifest writes nothing
        check_hyper(plan, base, lambda line: err.print(f"[yellow]note:[/yellow] {shown(line)}"))
    uploaded: dict[tuple[str, str], InputModel] = {}
    environments: dict[EnvRequest, EnvironmentModel] = {}
    jobs = []
    for spec in plan.jobs:
        env = None
        if isinstance(spec.environment, EnvRequest):
            if spec.environment not in environments:
                environments[spec.environment] = environment_model(c, spec.environment, base)
            env = environments[spec.environment]
            spec = replace(spec, environment=None)
        local = [i for i in spec.inputs if i.kind == InputKind.LOCAL]
        for inp in local:
            key = (inp.ref, spec.pool)
            if key not in uploaded:
                item = inp.ref if inp.dest == "." else f"{inp.dest}={inp.ref}"
                uploaded[key] = package_inputs(c, [item], spec.pool, quiet, base)[0]
        rest = tuple(i for i in spec.inputs if i.kind != InputKind.LOCAL)
        model = JobSpecModel.from_domain(replace(spec, inputs=rest))
        staged = [uploaded[(i.ref, spec.pool)].model_copy(update={"dest": i.dest}) for i in local]
        jobs.append(model.model_copy(update={"inputs": staged + model.inputs, "environment": env}))
    return ManifestApply(
        name=plan.name,
        hosts=[HostModel.from_domain(h) for h in plan.hosts],
        jobs=jobs,
        file=str(file),
    )


def apply(
    file: Annotated[Path, typer.Argument(help="The manifest (TOML).")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    hyper_check: Annotated[
        bool,
        typer.Option(
            "--hyper-check/--no-hyper-check",
            help="Refuse a job's hyper.* key that its Python script does not take, read "
            "from the script's --help, which runs here as you, as `python train.py --help` "
            "would (20 s at most, none of your environment but PATH and the locale, no "
            "network only where unshare allows); --no-hyper-check skips it.",
        ),
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Apply a manifest: new jobs are queued, existing ones keep their status.

    A job's hyper.* keys are checked against its script's --help first, when it can be
    run."""
    with client(server, ca) as c:
        plan = load_plan(file, c, as_json, hyper_check)
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
            f"[yellow]warning:[/yellow] no registered worker is named {shown(repr(host))}; "
            "its hosts entry applies once one registers (workers are named by --name, "
            "default: hostname)"
        )
    for job_id, reason in result.unrunnable.items():
        err.print(f"[yellow]warning:[/yellow] {shown(job_id)}: {shown(reason)}")
    if result.absent:
        out.print(
            f"{len(result.absent)} job(s) of manifest {shown(result.manifest)} are no longer "
            f"in it; they stay (cancel those still queued to stop them): "
            + shown(", ".join(result.absent))
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
            shown(j.id),
            shown(j.name),
            styled(j.status),
            f"{j.attempts}/{j.max_attempts}",
            shown(j.worker or "-"),
            ",".join(map(str, j.gpus)) or "-",
            when(j.started_at),
            duration(j.started_at, j.finished_at),
            "-" if j.exit_code is None else str(j.exit_code),
            shown(error_line(j)[:160]),
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
            help="Keep printing until the job ends, with each failed attempt as it ends "
            "(why, its stderr's last lines, when it is retried), then say how the job "
            "ended (exit code 1 unless it succeeded).",
        ),
    ] = False,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="Print the lines as the job wrote them, every control character included "
            "(to pipe them to a file or a pager that reads them).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print a job's output (stdout and stderr).

    A job's colours, carriage returns (progress bars) and tabs reach the terminal; every
    other control character or sequence (a window title, a screen clear, a clipboard
    write, a cursor move) is shown as an escape such as \\x1b, so what a job printed
    cannot drive your terminal. --raw prints the lines untouched. A progress bar the job
    redraws without a newline comes while it runs, at most two states a second: drawn
    over one line on a terminal, a line each into a file or a pipe."""
    if raw and as_json:
        raise ConfigError("--raw and --json: choose one (--json escapes every line as JSON)")
    with session_client(server, ca, session) as c:
        status = follow(c, job, as_json, keep_going=follow_, raw=raw)
        if not follow_:
            return
        d = c.job(job)
    said = f": {d.error}" if d.error and status != "cancelled" else ""
    err.print(f"job {shown(d.id)} {styled(status)}{shown(said)}")
    if status != "succeeded":
        raise typer.Exit(1)


def follow(c: Client, job: str, as_json: bool, keep_going: bool = True, raw: bool = False) -> str:
    """Print a job's output until it ends (or what it has, without ``keep_going``); its
    status. Following reads the job's event stream (SSE), which resumes after a broken
    connection with nothing missed or printed twice. ``raw``: the lines as written, not
    escaped for a terminal."""
    if not keep_going:
        after = 0
        while True:
            page = c.logs(job, after)
            _print_lines(page.lines, as_json, raw)
            after = page.next
            if not page.more and len(page.lines) < 10_000:  # a page stops at a byte budget too
                _bar.end()
                return page.status
    d = c.job(job)
    status: str = d.status
    for event in c.follow(d.id):
        if event.type == "log":
            _print_lines([LogEntry.model_validate(event.data)], as_json, raw)
        elif event.type in ("state", "end"):
            status = str(event.data["status"])
            _say_attempt(event.data)
    _bar.end()
    return status


def _say_attempt(data: dict[str, object]) -> None:
    """A failed attempt, as it ends: on stderr, whatever the output's form."""
    lines = attempt_lines(data)
    if lines:
        _bar.end()  # a bar being drawn ends its line first
        sys.stdout.flush()
        sys.stderr.write("".join(line + "\n" for line in lines))
        sys.stderr.flush()


def _print_lines(lines: Sequence[LogEntry], as_json: bool, raw: bool = False) -> None:
    """Each line to the stream it was written to, escaped for a terminal, or ``raw``;
    or as a JSON record a line on stdout (ASCII only: JSON escapes every control). A
    progress bar's states (lines ending with ``BAR_END``) redraw one line on a terminal,
    and are a line each off one; ``raw`` writes them as the job did, with no newline."""
    if raw:  # bytes go past the text layers: what those hold goes first
        sys.stdout.flush()
        sys.stderr.flush()
    for ln in lines:
        if as_json:
            sys.stdout.write(json.dumps(ln.model_dump(mode="json"), separators=(",", ":")) + "\n")
            continue
        stream = sys.stdout if ln.stream == "stdout" else sys.stderr
        if raw:
            _write_raw(stream, ln.line if ln.line.endswith(BAR_END) else ln.line + "\n")
        else:
            _bar.write(stream, ln.line)
    sys.stdout.flush()
    sys.stderr.flush()


class _Bar:
    """A job's progress bar drawn on a terminal and not finished: the stream it is on.
    Its next state, or its finished line, is drawn over it; any other line ends it first."""

    def __init__(self) -> None:
        self.on: TextIO | None = None

    def write(self, stream: TextIO, line: str) -> None:
        state = line.endswith(BAR_END)
        text = for_terminal(line.removesuffix(BAR_END))
        if self.on is not None and self.on is not stream:
            self.end()
        if not stream.isatty():  # a file or a pipe: a line per state
            stream.write(text + "\n")
            return
        if self.on is stream:
            stream.write("\r\x1b[K")  # back to the line's start, and clear it
        stream.write(text if state else text + "\n")
        self.on = stream if state else None

    def end(self) -> None:
        """Leave the bar as it is drawn, and go to the next line."""
        if self.on is not None:
            self.on.write("\n")
            self.on.flush()
            self.on = None


_bar = _Bar()


def _write_raw(stream: TextIO, text: str) -> None:
    """``text`` as UTF-8 bytes, past the stream's own encoding and error handling: what
    the job wrote, byte for byte, whatever the locale."""
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        stream.write(text)
    else:
        buffer.write(text.encode("utf-8", "surrogatepass"))


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
    SIGINT (a training script saves its model and exits); a SLEAP training job gets
    sleap-nn's own stop command instead (SIGINT only if it has not ended after --grace).
    Its outputs are kept, and it ends succeeded (stopped early) if it exits 0. `cancel`
    kills and keeps nothing. A submitter token stops only the jobs it submitted."""
    with session_client(server, ca, session) as c:
        j = c.stop(job, grace)
        sleap_train = not as_json and c.job(j.id).spec.adapter == "sleap-train"
    if as_json:
        print_json(j)
    elif sleap_train:
        asked = f"sent sleap-nn's stop command (SIGINT after {grace:g}s, then SIGTERM)"
        out.print(f"{shown(j.id)}: {styled(j.status)}, {asked}")
    else:
        asked = f"asked to stop (SIGINT; SIGTERM after {grace:g}s)"
        out.print(f"{shown(j.id)}: {styled(j.status)}, {asked}")


def pause(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Hold a job until `gpufleet resume`: a running one gets its grace signal, its
    checkpoint folder is kept and its slot (its GPU) freed within its grace period. A
    submitter token pauses only the jobs it submitted."""
    with session_client(server, ca, session) as c:
        j = c.pause(job)
    if as_json:
        print_json(j)
    elif j.status in ("claimed", "running"):
        out.print(f"{shown(j.id)}: {styled(j.status)}, pausing (its worker vacates it)")
    else:
        _acted(j, as_json)


def resume(
    job: JobArg,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue a paused job again: it goes on from its checkpoint on whichever worker fits.
    A submitter token resumes only the jobs it submitted."""
    with session_client(server, ca, session) as c:
        j = c.resume(job)
    _acted(j, as_json)


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
        out.print(f"{shown(j.id)}: {styled(j.status)}")


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
    out.print(f"[bold]{shown(w.job_id)}[/bold] is {styled(w.status)}: {shown(w.summary)}")
    table = Table(box=None, header_style="bold")
    for col in ("WORKER", "STATUS", "VERDICT"):
        table.add_column(col)
    for r in w.workers:
        verdict = "\n".join(map(shown, r.reasons or [r.reason or ""]))
        verdict = verdict or "[green]may run it[/green]"
        if r.host and r.host.narrows:
            verdict += f"\n[dim]its host declaration: {shown(host_note(r.host))}[/dim]"
        if r.environment_built is not None:
            verdict += "\n[dim]its environment: " + (
                "built here[/dim]"
                if r.environment_built
                else "not built here (built on taking it)[/dim]"
            )
        table.add_row(shown(r.name), styled(r.status), verdict)
    if w.workers:
        out.print(table)
