"""The ``gpufleet`` command line: thin over the SDK, the server and the worker.

A command pays only for what it uses: the root knows each command's name, module and
one-line help, and imports the module that holds a command only when that command runs
(or shows its own help). ``gpufleet --help`` imports neither httpx, pydantic nor the
server. ``tests/unit/test_cli_start.py`` keeps the table below true to the commands.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from gpufleet import __version__
from gpufleet.cli import _rich_help
from gpufleet.errors import GpufleetError
from gpufleet.terminal import visible
from gpufleet.tokens import redact

_rich_help.install()  # help and usage errors without rich's Markdown and Traceback

#: command -> (the module under gpufleet.cli whose ``register`` adds it, its help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": (
        "submit",
        "Queue one job. Prints the job id alone on the last line (with --wait: follows "
        "it, downloads its results, and exits non-zero unless it succeeded).",
    ),
    "apply": ("jobs", "Apply a manifest: new jobs are queued, existing ones keep their status."),
    "jobs": (
        "jobs",
        "List jobs, oldest first; a failed job's ERROR ends with the last line of its stderr.",
    ),
    "show": (
        "jobs",
        "Show one job: spec, state, why it failed (its stderr's last lines), what it "
        "waits for, its artifact, and every attempt.",
    ),
    "logs": ("jobs", "Print a job's output (stdout and stderr)."),
    "watch": (
        "watch",
        "Watch a job live: status, attempt, worker and GPUs, a progress bar with ETA, its"
        " latest metrics and a loss sparkline, and its last output lines, until it ends "
        "(exit code 1 unless it succeeded).",
    ),
    "stop": (
        "jobs",
        "Ask a running job to finish early and keep what it made: its process group gets "
        "SIGINT (a training script saves its model and exits); a SLEAP training job gets "
        "sleap-nn's own stop command instead (SIGINT only if it has not ended after "
        "--grace). Its outputs are kept, and it ends succeeded (stopped early) if it exits "
        "0. `cancel` kills and keeps nothing. A submitter token stops only the jobs it "
        "submitted.",
    ),
    "cancel": (
        "jobs",
        "Cancel a job; a running one is killed with its whole process group. A submitter "
        "token cancels only the jobs it submitted.",
    ),
    "pause": (
        "jobs",
        "Hold a job until `gpufleet resume`: a running one gets its grace signal, its "
        "checkpoint folder is kept and its slot (its GPU) freed within its grace period. "
        "A submitter token pauses only the jobs it submitted.",
    ),
    "resume": (
        "jobs",
        "Queue a paused job again: it goes on from its checkpoint on whichever worker "
        "fits. A submitter token resumes only the jobs it submitted.",
    ),
    "requeue": (
        "jobs",
        "Queue a failed or cancelled job again, with a fresh attempt budget. A submitter "
        "token requeues only the jobs it submitted.",
    ),
    "why": (
        "jobs",
        "Why a job waits: what it waits for (a job it needs, a backoff), its place in the"
        " queue, and for every worker its status and every constraint that keeps it from "
        "taking the job.",
    ),
    "download": ("data", "Download a job's artifact (its outputs) and unpack it."),
    "server": ("server", "Run the server (queue, fleet state, API) until SIGINT or SIGTERM."),
    "drain": (
        "fleet",
        "Stop giving a worker jobs; it finishes what it runs (or, with --deadline, vacates "
        "it then), then exits (and shows offline).",
    ),
    "status": (
        "fleet",
        "A summary of the fleet: jobs by status, workers by status, and the slots of the "
        "workers not offline, with how many are free (not running a job, not held for "
        "one).",
    ),
    "capability": ("worker", "Print what a worker on this machine would report, as JSON."),
    "audit": (
        "audit",
        "The audit log: every state-changing call, who made it, from where, and how it "
        "ended, and the server's lifecycle events (worker registered, offline, removed; "
        "lease lost) (admin, operator of every pool).",
    ),
    "whoami": (
        "tokens",
        "The token this CLI uses (or the session's): its id, name, role and pools; never "
        "its secret.",
    ),
    "blobs": ("data", "Content-addressed blobs on the server (power users, scripts)."),
    "worker": (
        "worker",
        "Run a worker: detect this machine, claim jobs that fit, run them, report back. "
        "It prints a session string; `gpufleet submit --session STRING` sends a job to "
        "it.",
    ),
    "workers": (
        "fleet",
        "List workers: status (connecting, available, reserved, busy, draining, offline),"
        " host, GPUs with free/total memory, running jobs, labels (* fixed by the "
        "worker's token), and when it was last seen or how long it has been gone. "
        "`workers rm` forgets an offline one.",
    ),
    "hosts": (
        "fleet",
        "List the manifests' [hosts.NAME] declarations: the host (the worker of that "
        "--name), what it narrows of what the worker offers (cuda, gpus, vram_gib, "
        "ram_gib, allow_jobs, deny_jobs), its priority, the manifest and file it came "
        "from, and when and by which token it was applied. A later manifest's entry for "
        "a host replaces it.",
    ),
    "usage": (
        "sharing",
        "Who used the fleet: GPU-hours per user and pool over a window, each user's "
        "weight, share and standing under fair share, and what its jobs hold now.",
    ),
    "envs": (
        "envs",
        "The Python environments workers have built for jobs: list them, or build one "
        "ahead of time on a worker.",
    ),
    "config": ("settings", "Show the effective configuration."),
    "tokens": ("tokens", "Create, list and revoke tokens (admin)."),
    "webhooks": (
        "webhooks",
        "Word when a job ends: webhooks for your jobs, a pool's or one job's.",
    ),
    "sleap": (
        "sleap",
        "SLEAP pose estimation: train a package exported by SLEAP on the fleet, track "
        "with the trained models, get models and predictions back.",
    ),
}


def load(module: str, only: str | None = None) -> Any:
    """The click group of the commands a module under ``gpufleet.cli`` registers; with
    ``only``, of that command alone (the others' options are never built)."""
    found = importlib.import_module(f"gpufleet.cli.{module}")
    holder = typer.Typer()
    found.register(holder)
    if only is not None:
        holder.registered_commands = [
            c
            for c in holder.registered_commands
            if (c.name or typer.main.get_command_name(getattr(c.callback, "__name__", ""))) == only
        ]
        holder.registered_groups = [g for g in holder.registered_groups if g.name == only]

    @holder.callback()
    def _group() -> None:  # a callback keeps a lone command a group of one
        """The commands of one module."""

    return typer.main.get_command(holder)


class LazyGroup(TyperGroup):
    """The root group: commands are imported when they are used. While the root's own
    help is drawn, each command is a stand-in with its help line, so listing them imports
    nothing."""

    listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return None
        module, help_line = COMMANDS[cmd_name]
        if self.listing:
            return typer.core.TyperCommand(name=cmd_name, help=help_line)
        return load(module, cmd_name).get_command(ctx, cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False


app = typer.Typer(
    cls=LazyGroup,
    name="gpufleet",
    help="Run ML training and inference jobs across a mixed fleet of machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback(invoke_without_command=True)
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


def _validation_error(exc: Exception) -> bool:
    """Whether ``exc`` is pydantic's ValidationError (only if pydantic was imported: a
    command that never loaded it cannot have raised one)."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(exc, pydantic.ValidationError)


def main() -> None:
    """Console entry point: errors become one clear line and a non-zero exit. An error
    never shows a token: anything token-shaped in it is cut to its hint. It may quote
    what others wrote (a server's message quotes names): its control characters are
    shown as escapes."""
    try:
        app()
    except GpufleetError as exc:
        print(f"error: {visible(redact(exc.message))}", file=sys.stderr)
        sys.exit(2 if exc.code in ("config_error", "manifest_error", "package_error") else 1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if not _validation_error(exc):
            raise
        # a flag value the API would refuse: say which, no traceback
        for problem in exc.errors():  # type: ignore[attr-defined]
            where = ".".join(str(p) for p in problem["loc"]) or "value"
            said = str(problem["msg"]).removeprefix("Value error, ")
            print(f"error: invalid {visible(where)}: {visible(redact(said))}", file=sys.stderr)
        sys.exit(2)


__all__ = ["COMMANDS", "app", "main"]
