"""The ``gpufleet`` command line: thin over the SDK, the server and the worker."""

from __future__ import annotations

import sys

import typer
from pydantic import ValidationError

from gpufleet import __version__
from gpufleet.cli import data, fleet, jobs, sleap
from gpufleet.errors import GpufleetError
from gpufleet.tokens import redact

app = typer.Typer(
    name="gpufleet",
    help="Run ML training and inference jobs across a mixed fleet of machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
jobs.register(app)
data.register(app)
fleet.register(app)
sleap.register(app)


@app.callback(invoke_without_command=True)
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


def main() -> None:
    """Console entry point: errors become one clear line and a non-zero exit. An error
    never shows a token: anything token-shaped in it is cut to its hint."""
    try:
        app()
    except GpufleetError as exc:
        print(f"error: {redact(exc.message)}", file=sys.stderr)
        sys.exit(2 if exc.code in ("config_error", "manifest_error", "package_error") else 1)
    except ValidationError as exc:  # a flag value the API would refuse: say which, no traceback
        for problem in exc.errors():
            where = ".".join(str(p) for p in problem["loc"]) or "value"
            said = str(problem["msg"]).removeprefix("Value error, ")
            print(f"error: invalid {where}: {redact(said)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["app", "main"]
