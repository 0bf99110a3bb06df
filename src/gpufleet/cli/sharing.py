"""``gpufleet usage``: who used the fleet, and where each user stands under fair share."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import CaOpt, JsonOpt, ServerOpt, client, err, out, print_json, shown
from gpufleet.errors import ConfigError

_UNITS = {"h": 1.0, "d": 24.0, "w": 168.0}


def register(app: typer.Typer) -> None:
    app.command()(usage)


def _window(text: str) -> float:
    """Hours of a window such as "24h", "7d", "2w" (a bare number is hours)."""
    t = text.strip().lower()
    unit = t[-1:] if t[-1:] in _UNITS else "h"
    try:
        hours = float(t[:-1] if t[-1:] in _UNITS else t) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"--window: {text!r} is not a window such as 24h, 7d or 2w") from None
    if not 0 < hours <= 24 * 366:
        raise ConfigError(f"--window: {text!r} must be above 0 and at most a year")
    return hours


def usage(
    window: Annotated[
        str, typer.Option(help="How far back GPU-hours are summed: 24h, 7d, 2w.")
    ] = "7d",
    pool: Annotated[str | None, typer.Option(help="Only this pool.")] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Who used the fleet: GPU-hours per user and pool over a window, each user's
    weight, share and standing under fair share, and what its jobs hold now."""
    hours = _window(window)
    with client(server, ca) as c:
        got = c.usage(hours, pool)
    if as_json:
        print_json(got)
        return
    mode = (
        f"fair share on (half-life {got.half_life_hours:g} h)"
        if got.fair_share
        else "fair share off: jobs of one priority run oldest first"
    )
    err.print(f"usage over {window}; {mode}")
    if not got.rows:
        err.print("no usage in this window")
        return
    table = Table(box=None, header_style="bold")
    for col in ("USER", "POOL", "GPU-H", "CPU-H", "WEIGHT", "SHARE", "USED", "STANDING", "NOW"):
        table.add_column(col, justify="right" if col not in ("USER", "POOL", "NOW") else "left")
    for r in got.rows:
        now = f"{r.gpus_now} GPU, {r.cpu_slots_now} CPU ({r.jobs_now} jobs)" if r.jobs_now else "-"
        table.add_row(
            shown(r.owner or "(no token)"),
            shown(r.pool),
            f"{r.gpu_hours:.2f}",
            f"{r.cpu_hours:.2f}",
            f"{r.weight:g}",
            f"{r.share:.0%}",
            f"{r.used_share:.0%}",
            _standing(r.standing, got.fair_share),
            now,
        )
    out.print(table)


def _standing(value: float, on: bool) -> str:
    if not on:
        return "-"
    if value < 0.9:
        return f"{value:.2f} below"
    if value > 1.1:
        return f"{value:.2f} above"
    return f"{value:.2f} at"
