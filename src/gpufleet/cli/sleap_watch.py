"""Following ``gpufleet sleap`` jobs on the terminal with --wait: each job's status
changes, its epochs with their loss (a training) or its tenths of the frames (tracking),
and why one failed, in sleap-nn's words."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rich.markup import escape

from gpufleet.cli._common import err, shown, styled
from gpufleet.cli.attempts import attempt_lines
from gpufleet.client import Client
from gpufleet.domain import sleap
from gpufleet.domain.models import Adapter
from gpufleet.wire import JobOut


def watch(connect: Callable[[], Client], jobs: list[JobOut], quiet: bool) -> dict[str, str]:
    """Follow the jobs (each over its event stream, in a thread of its own) until every
    one has ended, printing each status change and each epoch with its loss and val loss
    (tracking: every tenth of the frames). Their end statuses."""
    statuses: dict[str, str] = {}
    failures: list[BaseException] = []

    def one(job: JobOut) -> None:
        try:
            with connect() as c:
                statuses[job.id] = _follow(c, job, quiet)
        except BaseException as exc:  # shown by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # a short join at a time, so Ctrl-C is seen
            t.join(0.5)
    if failures:
        raise failures[0]
    return statuses


def _follow(c: Client, job: JobOut, quiet: bool) -> str:
    status: str = job.status
    tenth = -1
    for event in c.follow(job.id):
        line, notices = None, []
        if event.type == "state":
            status = str(event.data["status"])
            by = event.data.get("by")
            who = "submitted by" if event.data.get("event") == "submit" else "by"
            line = styled(status) + (f" ({who} {shown(str(by))})" if by else "")
            notices = attempt_lines(event.data)  # a failed attempt: why, stderr, the retry
        elif event.type == "end":
            status = str(event.data["status"])
        elif event.type == "progress":
            record = event.data.get("record")
            record = record if isinstance(record, dict) else {}
            said, tenth = _record_line(record, tenth)
            line = shown(said) if said else None  # the record's values are the job's
        if line and not quiet:
            err.print(f"{shown(job.name)}: {line}")
        for notice in [] if quiet else notices:  # already shown as visible escapes
            err.print(f"{shown(job.name)}: {escape(notice)}")
    if status == "failed" and not quiet:
        _why_failed(c, job)
    return status


def _why_failed(c: Client, job: JobOut) -> None:
    """Why a job failed: gpufleet's word, then sleap-nn's own error line (the last of its
    stderr), and for a training where to find what it left."""
    d = c.job(job.id)
    err.print(f"{shown(job.name)}: [red]failed[/red]: {shown(d.error or '')}")
    said = sleap.error_line(d.stderr_tail)
    if said:
        err.print(f"{shown(job.name)}: sleap-nn said: {shown(said)}")
    if d.spec.adapter == Adapter.SLEAP_TRAIN.value:
        err.print(
            f"{shown(job.name)}: what it left (its best.ckpt so far): gpufleet download "
            f"{shown(job.id)}, or --download-failed with --wait"
        )


def _record_line(record: dict[str, Any], tenth: int) -> tuple[str | None, int]:
    """What to print of a progress record: an epoch's end (it has the loss), or tracking
    having passed another tenth of the frames."""
    if "loss" in record and record.get("epoch") is not None:
        said = f"epoch {record['epoch']}" + (f"/{record['epochs']}" if record.get("epochs") else "")
        for key in ("loss", "val_loss"):
            if isinstance(record.get(key), int | float):
                said += f", {key} {record[key]:.4g}"
        return said, tenth
    done = record.get("progress")
    if isinstance(done, int | float) and int(done * 10) > tenth:
        frames = f" of {record['steps']} frames" if record.get("steps") else ""
        return f"{100 * done:.0f}%{frames}", int(done * 10)
    return None, tenth
