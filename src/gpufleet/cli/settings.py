"""``gpufleet config``: the effective configuration, each setting with where it came from."""

from __future__ import annotations

import typer
from rich.table import Table

from gpufleet import config
from gpufleet.cli._common import JsonOpt, out, print_json, shown

config_app = typer.Typer(help="Show the effective configuration.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(as_json: JsonOpt = False) -> None:
    """Every effective setting, its value and where it came from."""
    resolved = config.resolve()
    rows = resolved.rows()
    if resolved["token"] is None and config.load_token(resolved["server"]):
        saved = f"file {config.credentials_path()} (for {resolved['server']})"
        rows = [(n, "****", saved) if n == "token" else (n, v, s) for n, v, s in rows]
    if as_json:
        print_json([{"name": n, "value": v, "source": s} for n, v, s in rows])
        return
    table = Table(box=None, header_style="bold")
    for col in ("SETTING", "VALUE", "SOURCE", "ENV"):
        table.add_column(col)
    for n, v, s in rows:
        table.add_row(n, shown(v), shown(s), config.SETTINGS[n].env)
    out.print(table)
