"""Choosing the worker a job runs on: --auto-select, --select and --session."""

from __future__ import annotations

import os
import sys
from pathlib import Path, PurePath

import typer
from rich.table import Table

from gpufleet.cli._common import age, client, err, resolve, shown, styled
from gpufleet.client import Client
from gpufleet.client.session import Session
from gpufleet.config.credentials import load_token, token_for
from gpufleet.config.values import normalize_url
from gpufleet.domain.quota import size_text
from gpufleet.errors import ConfigError
from gpufleet.wire import Candidate, GpuModel, HostOut, JobSpecModel, WorkerOut

SESSION_ENV = "GPUFLEET_SESSION"


def read_session(arg: str | None) -> Session | None:
    """The session from ``--session`` (the string, or ``@FILE``) or GPUFLEET_SESSION. A
    string that holds a token is refused on the command line: tokens never go in argv."""
    if arg is None:
        text = os.environ.get(SESSION_ENV, "").strip()
        return Session.decode(text) if text else None
    if arg.startswith("@"):
        try:
            return Session.decode(Path(arg[1:]).expanduser().read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--session {arg}: cannot read it: {exc.strerror or exc}") from exc
    session = Session.decode(arg)
    if session.token:
        raise ConfigError(
            "--session: this session string holds a token, and tokens are never taken from "
            f"the command line; pass it as {SESSION_ENV}=... or --session @FILE"
        )
    return session


def gpu_summary(gpus: list[GpuModel], simulated: bool) -> str:
    """Each GPU as "NAME free/total GiB", e.g. "A100 38.2/40 GiB"."""
    text = ", ".join(
        f"{g.name} {g.free_mib / 1024:.1f}/{g.total_mib / 1024:.0f} GiB"
        + (f" {g.util_percent}%" if g.util_percent is not None else "")
        for g in gpus
    )
    return (text + (" (simulated)" if simulated else "")) if text else "-"


def host_note(h: HostOut) -> str:
    """A host declaration and where it came from, e.g. "cuda=false by hosts.gpu-big in
    lab.toml" (the file's name as the applying client gave it, else the manifest's name;
    `gpufleet hosts` shows the whole path)."""
    said = ", ".join(h.narrows) or f"priority={h.policy.priority}"
    where = PurePath(h.file).name if h.file else f"manifest {h.manifest}"
    return f"{said} by hosts.{h.name} in {where}"


def gpu_cell(w: WorkerOut) -> str:
    """A worker's GPUs as jobs get them: what its host declaration still offers (with the
    declaration that narrowed them), then what the worker detected."""
    detected = gpu_summary(w.gpus, w.gpus_simulated)
    if w.host is None or not w.host.narrows:
        return detected
    if w.gpus_offered is None or not w.gpus:
        return f"{detected}; {host_note(w.host)}"
    offered = gpu_summary(w.gpus_offered, w.gpus_simulated) if w.gpus_offered else "0"
    return f"{offered} of {len(w.gpus)} offered ({host_note(w.host)}); detected: {detected}"


def labels_text(w: WorkerOut) -> str:
    """``k=v`` pairs, a ``*`` marking those the worker's token fixes (trustworthy)."""
    fixed = set(w.fixed_labels)
    return ",".join(f"{k}={v}{'*' if k in fixed else ''}" for k, v in w.labels.items()) or "-"


def tools_text(w: WorkerOut) -> str:
    """The tools a worker offers jobs, with their versions ("sleap-nn 0.3.5")."""
    return ", ".join(f"{name} {version}" for name, version in w.capability.tools.items()) or "-"


def seen(w: WorkerOut) -> str:
    """When the worker was last heard of; for an offline one, how long it has been gone."""
    if w.status == "offline" and w.offline_since:
        return f"gone {age(w.offline_since)}"
    return age(w.last_heartbeat) + " ago" if w.last_heartbeat else "-"


def worker_table(rows: list[WorkerOut]) -> Table:
    table = Table(box=None, header_style="bold")
    tools = any(w.capability.tools for w in rows)  # a column only when some worker has one
    envs = any(w.environments for w in rows)
    cols = ["ID", "NAME", "HOST", "POOL", "STATUS", "GPUS (free/total)", "RUNNING"]
    cols += ["LABELS", *(["TOOLS"] if tools else []), *(["ENVS"] if envs else []), "SEEN"]
    for col in cols:
        table.add_column(col)
    for w in rows:
        cells = [
            shown(w.id),
            shown(w.name),
            shown(w.capability.hostname),
            shown(w.pool),
            styled(w.status),
            shown(gpu_cell(w)),
            shown(", ".join(w.running) or "-"),
            shown(labels_text(w)),
            *([shown(tools_text(w))] if tools else []),
            *([envs_text(w)] if envs else []),
            seen(w),
        ]
        table.add_row(*cells)
    return table


def envs_text(w: WorkerOut) -> str:
    """How many environments the worker has built, and their size (`envs list` lists them)."""
    if not w.environments:
        return "-"
    return f"{len(w.environments)} ({size_text(sum(e.size_bytes for e in w.environments))})"


def session_client(server: str | None, ca: Path | None, session: str | None) -> Client:
    """The client a job command uses: with a session (``--session`` STRING or @FILE, or
    GPUFLEET_SESSION), the session's server and token, so whoever submitted through a
    session can follow, fetch and steer those jobs with nothing else configured; else the
    configured server and token."""
    target = read_session(session)
    if target is None:
        return client(server, ca)
    if server is not None and normalize_url(server) != normalize_url(target.server):
        raise ConfigError(
            f"--server {server}: the session is for {target.server}; give one or the other"
        )
    return client(target.server, ca, token=session_token(target))


def session_token(target: Session) -> str:
    """The token to send to the session's server: the session's own; else the configured
    token, but only if the session names the configured server; else the token saved for
    exactly that server. A token is never sent to a server it does not belong to: a
    session string is pasted from chat, and could name any server."""
    if target.token:
        return target.token
    settings = resolve(server=None)
    configured = str(settings["server"])
    same = normalize_url(configured) == normalize_url(target.server)
    token = token_for(configured, settings) if same else load_token(target.server)
    if not token:
        raise ConfigError(
            f"--session: the worker is on {target.server}, and your token is for "
            f"{configured}; a token is only ever sent to its own server. Use a session "
            "string with a token in it (the worker's --share-token), or set "
            "GPUFLEET_SERVER and GPUFLEET_TOKEN for that server"
        )
    return token


def _short_gpu(name: str) -> str:
    return name.removeprefix("NVIDIA ").removeprefix("GeForce ")


def gets_text(pick: Candidate) -> str:
    """What the job gets on the chosen worker: "GPU 0 (A100-PCIE-40GB 40 GiB), 38.0 GiB
    free", or "a CPU slot"."""
    if not pick.gpus:
        return "a CPU slot"
    gpus = [g for g in pick.worker.gpus if g.index in pick.gpus]
    models = ", ".join(sorted({f"{_short_gpu(g.name)} {g.total_mib / 1024:.0f} GiB" for g in gpus}))
    free = (pick.assigned_free_mib or 0) / 1024
    if len(pick.gpus) == 1:
        return f"GPU {pick.gpus[0]} ({models}), {free:.1f} GiB free"
    numbers = ", ".join(str(i) for i in pick.gpus)
    return f"GPUs {numbers} ({models}), at least {free:.1f} GiB free on each"


def _not_for_it(rows: list[Candidate], cpu: bool) -> str:
    """Why each worker was not chosen: its reason, or that it would run the job in a CPU
    slot (a job that did not ask for one)."""
    why = [
        f"{r.worker.name}: {r.reason or 'no GPU; it would run the job in a CPU slot'}"
        for r in rows
        if r.reason or not (cpu or r.on_gpu)
    ]
    return "; ".join(why) or "none"


def auto_select(c: Client, spec: JobSpecModel, wait: bool = False) -> Candidate | None:
    """The worker whose GPU (the one the job would get there) has the most free memory
    now; with ``cpu_only``, a free CPU slot, on a machine with few GPUs. A job that did
    not ask for a CPU never goes to a CPU slot. None: no worker can start it now, and
    ``wait``: the caller queues it for the first that frees, of those that could ever
    run it (refused when none could)."""
    rows = c.select(spec)
    cpu = spec.requirements.cpu_only
    fitting = [r for r in rows if r.fits and (cpu or r.on_gpu)]
    if fitting:
        return fitting[0]
    where = f" in pool {spec.pool!r}" if spec.pool else ""
    if not rows:
        raise ConfigError(f"--auto-select: no worker{where} is registered; see gpufleet workers")
    slot = "in a CPU slot" if cpu else "on a GPU"
    why = _not_for_it(rows, cpu)
    if not any(r.ever and (cpu or r.on_gpu) for r in rows):
        other = "" if cpu else "; --cpu runs it in a CPU slot"
        raise ConfigError(
            f"--auto-select: no worker{where} could ever run this job {slot} ({why}){other}"
        )
    if wait:
        return None
    instead = "a free CPU slot" if cpu else "the first GPU that frees"
    other = "" if cpu else ", or --cpu to run it in a CPU slot"
    raise ConfigError(
        f"--auto-select: no worker{where} can start this job {slot} now ({why}); add "
        f"--queue to wait for {instead}{other} (gpufleet workers shows who runs what)"
    )


def choice_table(rows: list[Candidate]) -> Table:
    """The workers to choose from, one line each at 80 columns: number, name, what the
    job would get there, how many GPUs it has, how many jobs it runs."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("WORKER", no_wrap=True, overflow="ellipsis", max_width=20)
    table.add_column("THE JOB GETS", no_wrap=True, overflow="ellipsis", max_width=44)
    table.add_column("GPUS", justify="right", no_wrap=True)
    table.add_column("RUNS", justify="right", no_wrap=True)
    for i, r in enumerate(rows, 1):
        table.add_row(
            str(i),
            shown(r.worker.name),
            shown(gets_text(r)),
            str(len(r.worker.gpus)),
            str(len(r.worker.running)),
        )
    return table


def interactive_select(c: Client, spec: JobSpecModel) -> Candidate:
    """A numbered list of the workers that can start the job now; the user picks one by
    number, ``r`` lists them again with fresh figures, ``q`` gives up."""
    if not sys.stdin.isatty():
        raise ConfigError("--select asks at a terminal; off one use --auto-select or --worker ID")
    while True:
        rows = c.select(spec)
        fitting = [r for r in rows if r.fits]
        if fitting:
            err.print(choice_table(fitting))
        else:
            err.print("no worker can start this job now")
        others = [r for r in rows if not r.fits]
        if others:
            err.print("[dim]not listed:[/dim]")
        for r in others:  # one line each, cut at the terminal's edge
            line = f"[dim]  {shown(r.worker.name)}: {shown(r.reason)}[/dim]"
            err.print(line, soft_wrap=False, no_wrap=True, overflow="ellipsis")
        span = f"1-{len(fitting)}, " if fitting else ""
        err.print(f"pick a worker ({span}r to refresh, q to quit): ", end="")
        try:
            answer = input().strip().lower()
        except EOFError:
            answer = "q"
        if answer in ("q", "quit"):
            err.print("nothing submitted")
            raise typer.Exit(1)
        if answer in ("r", ""):
            continue
        if answer.isdigit() and 1 <= int(answer) <= len(fitting):
            return fitting[int(answer) - 1]
        err.print(f"[yellow]{shown(repr(answer))} is not one of the choices[/yellow]")
