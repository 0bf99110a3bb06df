"""The CLI starts light: the root knows its commands without importing them, and its
table of commands stays true to the commands themselves."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import typer

from gpufleet.cli import COMMANDS, app, load

HEAVY = ("httpx", "pydantic", "gpufleet.server", "gpufleet.client", "gpufleet.store")


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


def test_the_root_table_names_every_command_with_its_own_help() -> None:
    registered: dict[str, str] = {}
    for module in sorted({m for m, _ in COMMANDS.values()}):
        group = load(module)
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            registered[name] = module
            real = _first_paragraph(group.get_command(ctx, name).help)
            assert COMMANDS[name] == (module, real), f"COMMANDS[{name!r}] is stale: {real!r}"
    assert set(registered) == set(COMMANDS)
    root = typer.main.get_command(app)
    assert root.get_command(click.Context(root), "no-such-command") is None


def _imported(*args: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpufleet", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def test_help_imports_no_client_server_or_pydantic() -> None:
    """(A command that runs imports pydantic anyway: Typer 0.29 converts its options'
    values with it.)"""
    imported = _imported("--help")
    assert "typer" in imported  # the output was read
    heavy = sorted(n for n in imported if any(n == h or n.startswith(h + ".") for h in HEAVY))
    assert not heavy, f"gpufleet --help imports {heavy}"


def test_help_loads_neither_markdown_nor_tracebacks() -> None:
    """Typer draws help and usage errors with typer.rich_utils, which imports rich's
    Markdown and Traceback (markdown-it, pygments, attrs: a third of the start) for
    paths the CLI never takes; the CLI defers both."""
    imported = _imported("--help")
    assert "typer.rich_utils" in imported  # the help was drawn by Typer's rich code
    late = {"rich.markdown", "rich.traceback", "markdown_it", "pygments", "attr"} & imported
    assert not late, f"gpufleet --help imports {sorted(late)}"


DRAW = """
import sys
if sys.argv[1] == "as-typer-does":
    import typer.rich_utils  # loaded before the CLI: nothing is deferred
from gpufleet.cli import app
sys.argv = ["gpufleet", *sys.argv[2:]]
app()
"""

USE = """
import gpufleet.cli, sys, typer.rich_utils as ru
from typer.models import DeveloperExceptionConfig
md = ru._make_rich_text(text="*x*", markup_mode="markdown")
try:
    1 / 0
except ZeroDivisionError as exc:
    tb = ru.get_traceback(exc, DeveloperExceptionConfig(), [])
import rich.markdown, rich.traceback
assert type(md) is rich.markdown.Markdown, type(md)
assert type(tb) is rich.traceback.Traceback, type(tb)
print("real")
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_deferred_help_looks_as_typer_draws_it_and_the_real_classes_still_come() -> None:
    for args in (["--help"], ["jobs", "--help"], ["submit", "--help"], ["jobs", "--bogus"]):
        deferred, plain = (_run(DRAW, how, *args) for how in ("deferred", "as-typer-does"))
        assert deferred.returncode == plain.returncode, args
        assert deferred.stdout == plain.stdout and deferred.stderr == plain.stderr, args
        assert "Usage" in deferred.stdout + deferred.stderr, args
    used = _run(USE)
    assert used.returncode == 0 and used.stdout.strip() == "real", used.stderr[-2000:]
