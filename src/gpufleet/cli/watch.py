"""`gpufleet watch JOB`: one job, live, until it ends.

The view follows the job's event stream (SSE, resumed after a break): status, attempt,
worker and GPUs, how long it has run, a progress bar with an ETA, the latest metrics, a
small sparkline of its loss, why it failed, and the last lines it wrote. It is redrawn
at most four times a second, however fast the job writes. Everything a job wrote is
shown as text (never Rich markup) with its control characters as visible escapes; its
output lines keep their colours. So a job cannot drive the terminal. Off a terminal, the
final view is printed once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gpufleet.cli._common import CaOpt, SessionOpt, duration, out, setting_option, shown, styled
from gpufleet.cli.attempts import attempt_lines
from gpufleet.cli.choose import session_client
from gpufleet.cli.show import placement
from gpufleet.domain import progress
from gpufleet.domain.models import JobStatus
from gpufleet.terminal import for_terminal, visible
from gpufleet.wire import BAR_END, JobDetail

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 40
REDRAW = 0.25  # seconds between redraws at most
ATTEMPT = "attempt"  # the tail's stream name for a failed attempt's lines


def register(app: typer.Typer) -> None:
    app.command()(watch)


def watch(
    job: Annotated[str, typer.Argument(help="Job id (or a name that only one job has).")],
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=1, max=500, help="Output lines to show.")
    ] = 15,
    server: Annotated[str | None, setting_option("server")] = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
) -> None:
    """Watch a job live: status, attempt, worker and GPUs, a progress bar with ETA, its
    latest metrics and a loss sparkline, and its last output lines, until it ends (exit
    code 1 unless it succeeded)."""
    with session_client(server, ca, session) as c:
        d = c.job(job)
        seen = Seen(tail=deque(maxlen=lines))
        drawn = 0.0
        with Live(view(d, seen), console=out, refresh_per_second=4) as live:
            for event in c.follow(d.id):
                if seen.take(event.type, event.data) or event.type == "end":
                    d = c.job(d.id)  # a new status: where it runs, which attempt
                now = time.monotonic()
                if now - drawn >= REDRAW or event.type == "end":
                    live.update(view(d, seen))
                    drawn = now
            live.update(view(d, seen))
    if d.status != "succeeded":
        raise typer.Exit(1)


@dataclass
class Seen:
    """What the stream has said so far: the last lines, the latest progress record, the
    last value of each metric, and the loss curve."""

    tail: deque[tuple[str, str]]
    record: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    curve: deque[float] = field(default_factory=lambda: deque(maxlen=SPARK_POINTS))
    curve_of: str | None = None
    since: float | None = None  # when the record stream began (for an ETA by rate)

    def take(self, kind: str, data: dict[str, Any]) -> bool:
        """Take one event; whether it changed the job's status."""
        if kind == "log":
            self.line(str(data.get("stream", "")), str(data.get("line", "")))
        elif kind == "state":  # a failed attempt says why among the lines, as it ends
            self.tail.extend((ATTEMPT, line) for line in attempt_lines(data))
        elif kind == "progress":
            record = data.get("record") or {}
            self.record = record
            self.metrics = progress.fold([record], self.metrics)
            self.since = self.since or float(data.get("ts") or time.time())
            name = self.curve_of or _loss_name(progress.metrics_of(record))
            if name is not None and isinstance(record.get(name), int | float):
                self.curve_of = name
                self.curve.append(float(record[name]))
        return kind == "state"

    def line(self, stream: str, line: str) -> None:
        """An output line; one that continues a progress bar (its stream's last line
        ended with ``BAR_END``) takes that line's place."""
        for at in range(len(self.tail) - 1, -1, -1):
            if self.tail[at][0] == stream:
                if self.tail[at][1].endswith(BAR_END):
                    self.tail[at] = (stream, line)
                    return
                break
        self.tail.append((stream, line))


def _loss_name(metrics: dict[str, Any]) -> str | None:
    """The metric to draw: ``loss`` when there is one, else the first with "loss" in
    its name, else the first."""
    names = [k for k, v in metrics.items() if v is not None]
    if "loss" in names:
        return "loss"
    return next((n for n in names if "loss" in n), names[0] if names else None)


def sparkline(values: deque[float] | list[float]) -> str:
    """Values as a line of block characters, lowest to highest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(SPARKS[min(7, int((v - low) / span * 7.999))] for v in values)


def eta(record: dict[str, Any], since: float | None) -> str | None:
    """The job's own ``eta_s``, else one from how fast it has gone so far."""
    if record.get("eta_s") is not None:
        return _span(float(record["eta_s"]))
    done = progress.fraction(record)
    if done is None or done <= 0 or since is None:
        return None
    elapsed = time.time() - since
    return _span(elapsed * (1 - done) / done)


def _span(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def view(d: JobDetail, seen: Seen) -> RenderableType:
    where = f"  on {shown(d.worker)} ({placement(d)})" if d.worker else ""
    took = f"  {duration(d.started_at, d.finished_at)}" if d.started_at else ""
    attempt = d.history[-1].attempt if d.history else 0  # the one running, or the last
    head = (
        f"[bold]{shown(d.id)}[/bold] {shown(d.name)}: {styled(d.status)}"
        f"  attempt {attempt}/{d.max_attempts}{where}{took}"
    )
    parts: list[RenderableType] = [Text.from_markup(head)]
    record = seen.record or d.progress or {}
    done = progress.fraction(record)
    if done is not None:
        bar = Table.grid(padding=(0, 1))
        left = eta(record, seen.since) if not JobStatus(d.status).terminal else None
        counts = _counts(record)
        bar.add_row(
            ProgressBar(total=1.0, completed=done, width=40),
            Text(visible(f"{done:6.1%}{counts}" + (f"  ETA {left}" if left else ""))),
        )
        parts.append(bar)
    if record.get("message"):
        parts.append(Text(visible(str(record["message"])), style="cyan"))
    metrics = seen.metrics or d.metrics
    if metrics:
        latest = "  ".join(f"{k}={_num(v)}" for k, v in list(metrics.items())[:8])
        parts.append(Text(visible(latest)))
    if len(seen.curve) > 1 and seen.curve_of:
        parts.append(Text(f"{visible(seen.curve_of)} {sparkline(seen.curve)}", style="magenta"))
    if d.stopped_early:
        parts.append(Text("stopped early; outputs kept", style="green"))
    elif d.stop_requested_at and not JobStatus(d.status).terminal:
        parts.append(Text("asked to stop", style="yellow"))
    if d.error:
        parts.append(Text(f"error: {visible(d.error)}", style="red"))
        parts.extend(Text(f"  {visible(line)}", style="red") for line in d.stderr_tail[-5:])
    parts.append(Text(""))
    parts.extend(output_line(line, stream) for stream, line in seen.tail)
    return Group(*parts)


def output_line(line: str, stream: str) -> Text:
    """An output line as ``logs`` prints it (its colours kept, every other control shown
    as an escape), at its last carriage return: what a terminal shows of a progress bar
    redrawn in place. Stderr dimmed."""
    if stream == ATTEMPT:  # our own words, the job's already escaped
        return Text(line, style="yellow")
    text = for_terminal(line.removesuffix(BAR_END))  # a bar's state: drawn as it is now
    return Text.from_ansi(text, style="dim" if stream == "stderr" else "")


def _counts(record: dict[str, Any]) -> str:
    for done, total, word in (("epoch", "epochs", "epoch"), ("step", "steps", "step")):
        if record.get(done) is not None and record.get(total):
            return f"  {word} {record[done]}/{record[total]}"
    return ""


def _num(value: float | None) -> str:
    if value is None:
        return "nan"
    return f"{value:.4g}"
