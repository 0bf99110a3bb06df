"""How one job reads at a terminal (`gpufleet show`), and a failed job's error in a line.

Everything a job or a user wrote (names, commands, errors, stderr) goes through
``shown`` before Rich renders it: markup in it is printed, not interpreted, and its
control characters show as escapes (``\\x1b``), so it cannot drive the terminal.
"""

from __future__ import annotations

from gpufleet.cli._common import out, shown, styled, when
from gpufleet.cli.choose import host_note
from gpufleet.domain.quota import size_text
from gpufleet.wire import EnvUsed, JobDetail, JobOut, JobRef


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
    """A job in full, as ``gpufleet show JOB`` prints it."""
    _spec(d)
    _state(d)
    _preemption(d)
    _inputs(d)
    _environment(d)
    _failure(d)
    _artifact(d)
    _checkpoints(d)
    _history(d)


def _spec(d: JobDetail) -> None:
    """The job's name, status, attempts and what it runs."""
    out.print(
        f"[bold]{shown(d.id)}[/bold] {shown(d.name)}: {styled(d.status)}"
        f"  attempt {d.attempt} (budget {d.attempts}/{d.max_attempts})  priority {d.priority}"
        + (f"  machines lost {d.losses} (not counted)" if d.losses else "")
    )
    out.print(f"  command: {shown(' '.join(d.spec.command))}")
    if d.spec.tags or d.spec.adapter:
        via = f" (progress and stop through its {d.spec.adapter} adapter)" if d.spec.adapter else ""
        out.print(f"  tags: {shown(', '.join(d.spec.tags) or '-')}{shown(via)}")
    if d.spec.hyper:
        pairs = ", ".join(f"{k}={v}" for k, v in d.spec.hyper.items())
        out.print(f"  hyper ({shown(d.spec.hyper_style)}): {shown(pairs)}")


def _state(d: JobDetail) -> None:
    """Where and since when it runs, what it uses, who submitted it, whether it was stopped."""
    if d.worker:
        out.print(f"  on: {shown(d.worker)} ({placement(d)}), started {when(d.started_at)}")
    if d.host and d.host.narrows:
        out.print(f"  its worker offers less than it has: {shown(host_note(d.host))}")
    if d.gpu_mib is not None:
        out.print(f"  GPU memory in use: {d.gpu_mib / 1024:.1f} GiB (its processes, NVML)")
    if d.progress:
        pairs = ", ".join(f"{k}={v}" for k, v in d.progress.items())
        out.print(f"  progress: {shown(pairs)}")
    if d.submitted_by:
        who = f"token {shown(d.submitted_by)}"
        if d.submitted_by_name:
            who = f"{shown(d.submitted_by_name)} ({who})"
        out.print(f"  submitted by {who}")
    if d.stopped_early:
        out.print("  [green]stopped early[/green] (gpufleet stop), outputs kept")
    elif d.stop_requested_at and d.status in ("claimed", "running"):
        out.print(f"  asked to stop at {when(d.stop_requested_at)}")
    if d.unrunnable:
        out.print(f"  [yellow]{shown(d.unrunnable)}[/yellow]")
    if d.pause_requested_at and d.status in ("claimed", "running"):
        out.print(f"  pausing since {when(d.pause_requested_at)}: its worker vacates it")
    elif d.status == "paused":
        out.print(f"  paused at {when(d.pause_requested_at)}: gpufleet resume {shown(d.id)}")
    if d.raised:
        out.print(f"  [yellow]more memory:[/yellow] {shown(d.raised)}")


def _preemption(d: JobDetail) -> None:
    """Who preempted it (and whether its worker vacates it now), and whom it preempted."""
    p = d.preemption
    if p is None:
        return
    if p.by is not None:
        now = " now: its worker vacates it" if p.requested_at else ""
        out.print(f"  [yellow]preempted[/yellow] by {_ref(p.by)}{now}")
    for v in p.preempted:
        out.print(f"  preempted {_ref(v)} to free its slot")


def _ref(r: JobRef) -> str:
    """Another job as a preemption names it: id, name, owner, priority and when."""
    who = f"{shown(r.owner)}, " if r.owner else ""
    return f"job {shown(r.job_id)} ({shown(r.name)}; {who}priority {r.priority}) at {when(r.at)}"


def _failure(d: JobDetail) -> None:
    """Its error and the last lines of its stderr."""
    if d.error:
        cls = f" ({shown(d.failure)} failure)" if d.failure else ""
        out.print(f"  error{cls}: {shown(d.error)}")
    if d.stderr_tail:
        out.print(f"  stderr, last {len(d.stderr_tail)} line(s):")
        for line in d.stderr_tail:
            out.print(f"    {shown(line)}", soft_wrap=True)


def _history(d: JobDetail) -> None:
    """Each attempt in a line, with its environment and what was late or cut."""
    for a in d.history:
        out.print(
            f"  attempt {a.attempt}: {shown(a.worker or '-')} gpus={shown(a.gpus or '-')} "
            f"{shown(a.outcome or 'in progress')} "
            f"exit={a.exit_code if a.exit_code is not None else '-'}"
            f"{' cause=' + shown(a.cause) if a.cause else ''}"
            f"{' error=' + shown(a.error) if a.error else ''}"
        )
        if a.restored is not None:
            r = a.restored
            out.print(
                f"    restored checkpoint {r.snapshot}: {r.files} file(s), "
                f"{size_text(r.bytes)} in {r.seconds:.1f}s"
            )
        if a.environment is not None:
            out.print(f"    {shown(environment_line(a.environment))}", soft_wrap=True)
        if a.late_result:
            out.print(f"    [yellow]late result:[/yellow] {shown(a.late_result)}")
        if a.output_dropped:
            out.print(
                f"    [yellow]output cut:[/yellow] {size_text(a.output_dropped)} dropped "
                "(past the server's output quota)"
            )


def _inputs(d: JobDetail) -> None:
    for dep in d.depends_on:
        mark = "" if dep.status == "succeeded" else " (waits for it to succeed)"
        out.print(
            f"  needs: job:{shown(dep.name)} ({shown(dep.job_id)}, {styled(dep.status)}){mark}",
        )
    packages = [i for i in d.spec.inputs if i.kind != "job"]
    for inp in packages:
        label = inp.label or inp.ref
        out.print(f"  input: {shown(label)} -> {shown(inp.dest)} ({shown(inp.kind)})")


def _environment(d: JobDetail) -> None:
    """What the job's environment is built from, each file with its blob."""
    env = d.spec.environment
    if env is None:
        return
    out.print(f"  environment: {shown(env.to_domain().describe())}")
    for f in (env.requirements, env.project, env.lock):
        if f is not None:
            out.print(f"    {shown(f.name)}: blob {shown(f.sha256[:12])}, {f.size} bytes")


def environment_line(env: EnvUsed) -> str:
    """The environment an attempt ran with, in a line: how it was had, its Python and
    torch build, and every version installed."""
    how = "built" if env.built else "found in the worker's cache"
    torch = f", torch {env.torch_backend}" if env.torch_backend else ""
    versions = ", ".join(f"{name}=={v}" for name, v in sorted(env.versions.items()))
    return (
        f"environment {env.key[:12]} {how} in {env.seconds:.1f}s, Python {env.python}{torch}: "
        f"{versions or 'no packages'}"
    )


def _checkpoints(d: JobDetail) -> None:
    """The snapshots kept of its checkpoint folder, newest first."""
    if d.spec.checkpoint_dir is None:
        return
    folder = shown(d.spec.checkpoint_dir)
    if not d.checkpoints:
        out.print(f"  checkpoints ({folder}): none kept yet")
        return
    out.print(f"  checkpoints ({folder}): {len(d.checkpoints)} kept")
    for c in d.checkpoints:
        at = ", ".join(f"{k} {v}" for k, v in c.progress.items() if k in ("epoch", "step"))
        out.print(
            f"    {c.id}: attempt {c.attempt}, {when(c.created_at)}, {c.file_count} file(s), "
            f"{size_text(c.bytes)}{', ' + shown(at) if at else ''}"
        )


def _artifact(d: JobDetail) -> None:
    a = d.artifact
    if a is None:
        return
    out.print(
        f"  artifact: {a.file_count} file(s), {a.bytes} bytes unpacked, attempt {a.attempt} "
        f"(gpufleet download {shown(d.id)})"
    )
    for f in a.files[:20]:
        out.print(f"    {shown(f.path)}  {f.size}")
    if a.file_count > 20:
        out.print(f"    ... and {a.file_count - 20} more")
