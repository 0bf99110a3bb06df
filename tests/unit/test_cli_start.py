"""The CLI starts light: the root knows its commands without importing them, and its
table of commands stays true to the commands themselves."""

from __future__ import annotations

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
