"""`gpufleet watch JOB`: one job, live, until it ends.

The view is redrawn about once a second from the job and its newest output lines: status,
attempt, worker and GPUs, how long it has run, why it failed, and the last lines it
wrote. Output lines are shown as text (never Rich markup), so a job cannot restyle the
terminal. Off a terminal, the final view is printed once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from gpufleet.cli._common import CaOpt, SessionOpt, duration, out, setting_option, styled
from gpufleet.cli.choose import session_client
from gpufleet.cli.show import placement
from gpufleet.domain.models import JobStatus
from gpufleet.wire import JobDetail, LogEntry


def watch(
    job: Annotated[str, typer.Argument(help="Job id (or a name that only one job has).")],
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=1, max=500, help="Output lines to show.")
    ] = 15,
    server: Annotated[str | None, setting_option("server")] = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
) -> None:
    """Watch a job live: status, attempt, worker and GPUs, how long it has run, and its
    last output lines, until it ends (exit code 1 unless it succeeded)."""
    with session_client(server, ca, session) as c:
        d = c.job(job)
        tail: deque[LogEntry] = deque(maxlen=lines)
        after = 0
        with Live(view(d, tail), console=out, refresh_per_second=4) as live:
            while True:
                page = c.logs(d.id, after)
                tail.extend(page.lines)
                after = page.next
                d = c.job(d.id)
                live.update(view(d, tail))
                if JobStatus(d.status).terminal and not page.lines:
                    break
                time.sleep(1.0)
    if d.status != "succeeded":
        raise typer.Exit(1)


def view(d: JobDetail, tail: deque[LogEntry]) -> RenderableType:
    where = f"  on {escape(d.worker)} ({placement(d)})" if d.worker else ""
    took = f"  {duration(d.started_at, d.finished_at)}" if d.started_at else ""
    attempt = d.history[-1].attempt if d.history else 0  # the one running, or the last
    head = (
        f"[bold]{d.id}[/bold] {escape(d.name)}: {styled(d.status)}"
        f"  attempt {attempt}/{d.max_attempts}{where}{took}"
    )
    parts: list[RenderableType] = [Text.from_markup(head)]
    if d.stopped_early:
        parts.append(Text("stopped early; outputs kept", style="green"))
    elif d.stop_requested_at and not JobStatus(d.status).terminal:
        parts.append(Text("asked to stop", style="yellow"))
    if d.error:
        parts.append(Text(f"error: {d.error}", style="red"))
        parts.extend(Text(f"  {line}", style="red") for line in d.stderr_tail[-5:])
    parts.append(Text(""))
    parts.extend(Text(line.line, style="dim" if line.stream == "stderr" else "") for line in tail)
    return Group(*parts)
