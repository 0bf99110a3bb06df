"""Docs a user reads first stay true: the CLI reference, env variables in --help, README."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from typer.testing import CliRunner

from gpufleet import config
from gpufleet.cli import app
from gpufleet.cli.reference import _commands, render

ROOT = Path(__file__).resolve().parents[2]


def test_cli_reference_is_up_to_date() -> None:
    assert (ROOT / "docs" / "cli.md").read_text() == render(app), (
        "docs/cli.md is stale: run `.venv/bin/python -m gpufleet.cli.reference > docs/cli.md`"
    )


def test_every_command_and_option_is_documented() -> None:
    for path, cmd in _commands(typer.main.get_command(app), "gpufleet"):
        assert (cmd.help or "").strip(), f"{path} has no help"
        for param in cmd.params:
            assert getattr(param, "help", None), f"{path} {param.name} has no help"


def test_every_setting_backed_flag_shows_its_environment_variable() -> None:
    seen = set()
    for path, cmd in _commands(typer.main.get_command(app), "gpufleet"):
        for param in cmd.params:
            named = re.search(r"\(env: (GPUFLEET_\w+)\)", param.help or "")
            if named is None:
                continue
            setting = config.SETTINGS[param.name]
            assert named.group(1) == setting.env, f"{path} --{param.name} names the wrong variable"
            seen.add(setting.name)
    # Every setting but the secret token can be given as a flag somewhere.
    assert seen == set(config.SETTINGS) - {"token"}


def test_help_runs_for_every_command() -> None:
    runner = CliRunner()
    for path, _ in _commands(typer.main.get_command(app), "gpufleet"):
        args = [*path.split()[1:], "--help"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (path, result.output)


def test_readme_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^make \w+", readme, flags=re.M)
    assert commands[:2] == ["make demo", "make test"]
