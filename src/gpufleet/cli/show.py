"""How one job reads at a terminal (`gpufleet show`), and a failed job's error in a line.

Everything a job or a user wrote (names, commands, errors, stderr) is escaped before Rich
renders it, so markup in a job's output is shown, not interpreted.
"""

from __future__ import annotations

from rich.markup import escape

from gpufleet.cli._common import out, styled, when
from gpufleet.domain.quota import size_text
from gpufleet.wire import JobDetail, JobOut


def error_line(j: JobOut) -> str:
    """A job's error with, when it failed, the last line it wrote to stderr: what a table
    has room for ("exit code 3: ValueError: column label is missing")."""
    last = next((line.strip() for line in reversed(j.stderr_tail) if line.strip()), "")
    if j.error and last:
        return f"{j.error}: {last}"
    return j.error or ""


def placement(j: JobOut) -> str:
    """Where on its worker a job runs: "GPU 0", "GPUs 0,1" or "a CPU slot"."""
    if not j.gpus:
        return "a CPU slot"
    return f"GPU{'s' if len(j.gpus) > 1 else ''} {','.join(map(str, j.gpus))}"


def show_detail(d: JobDetail) -> None:
    out.print(
        f"[bold]{d.id}[/bold] {escape(d.name)}: {styled(d.status)}"
        f"  attempt {d.attempt} (budget {d.attempts}/{d.max_attempts})  priority {d.priority}"
    )
    out.print(f"  command: {escape(' '.join(d.spec.command))}")
    if d.spec.tags or d.spec.adapter:
        via = f" (progress and stop through its {d.spec.adapter} adapter)" if d.spec.adapter else ""
        out.print(f"  tags: {escape(', '.join(d.spec.tags) or '-')}{escape(via)}")
    if d.spec.hyper:
        shown = ", ".join(f"{k}={v}" for k, v in d.spec.hyper.items())
        out.print(f"  hyper ({d.spec.hyper_style}): {escape(shown)}")
    if d.worker:
        out.print(f"  on: {escape(d.worker)} ({placement(d)}), started {when(d.started_at)}")
    if d.gpu_mib is not None:
        out.print(f"  GPU memory in use: {d.gpu_mib / 1024:.1f} GiB (its processes, NVML)")
    if d.progress:
        shown = ", ".join(f"{k}={v}" for k, v in d.progress.items())
        out.print(f"  progress: {escape(shown)}")
    if d.submitted_by:
        out.print(f"  submitted by token {d.submitted_by}")
    if d.stopped_early:
        out.print("  [green]stopped early[/green] (gpufleet stop), outputs kept")
    elif d.stop_requested_at and d.status in ("claimed", "running"):
        out.print(f"  asked to stop at {when(d.stop_requested_at)}")
    if d.unrunnable:
        out.print(f"  [yellow]{escape(d.unrunnable)}[/yellow]")
    _inputs(d)
    if d.error:
        out.print(f"  error: {escape(d.error)}")
    if d.stderr_tail:
        out.print(f"  stderr, last {len(d.stderr_tail)} line(s):")
        for line in d.stderr_tail:
            out.print(f"    {escape(line)}", soft_wrap=True)
    _artifact(d)
    for a in d.history:
        out.print(
            f"  attempt {a.attempt}: {escape(a.worker or '-')} gpus={a.gpus or '-'} "
            f"{a.outcome or 'in progress'} exit={a.exit_code if a.exit_code is not None else '-'}"
            f"{' error=' + escape(a.error) if a.error else ''}"
        )
        if a.late_result:
            out.print(f"    [yellow]late result:[/yellow] {escape(a.late_result)}")
        if a.output_dropped:
            out.print(
                f"    [yellow]output cut:[/yellow] {size_text(a.output_dropped)} dropped "
                "(past the server's output quota)"
            )


def _inputs(d: JobDetail) -> None:
    for dep in d.depends_on:
        mark = "" if dep.status == "succeeded" else " (waits for it to succeed)"
        out.print(
            f"  needs: job:{escape(dep.name)} ({dep.job_id}, {styled(dep.status)}){mark}",
        )
    packages = [i for i in d.spec.inputs if i.kind != "job"]
    for inp in packages:
        shown = inp.label or inp.ref
        out.print(f"  input: {escape(shown)} -> {escape(inp.dest)} ({inp.kind})")


def _artifact(d: JobDetail) -> None:
    a = d.artifact
    if a is None:
        return
    out.print(
        f"  artifact: {a.file_count} file(s), {a.bytes} bytes unpacked, attempt {a.attempt} "
        f"(gpufleet download {d.id})"
    )
    for f in a.files[:20]:
        out.print(f"    {escape(f.path)}  {f.size}")
    if a.file_count > 20:
        out.print(f"    ... and {a.file_count - 20} more")
