"""``gpufleet audit``: the server's audit log (admin, operator of every pool)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import CaOpt, JsonOpt, ServerOpt, client, err, out, print_json, shown
from gpufleet.errors import ConfigError


def register(app: typer.Typer) -> None:
    app.command()(audit)


def audit(
    since: Annotated[
        str | None,
        typer.Option(
            help="Only calls since then: a duration back from now (30m, 2h, 7d) or a date "
            "and time (2026-11-23, 2026-11-23T09:00)."
        ),
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, oldest first.", min=1)] = 1000,
    after: Annotated[int, typer.Option(help="Only records past this SEQ (to page on).", min=0)] = 0,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The audit log: every state-changing call, who made it, from where, and how it ended,
    and the server's lifecycle events (worker registered, offline, removed; lease lost)
    (admin, operator of every pool)."""
    start = parse_since(since) if since else None
    with client(server, ca) as c:
        rows = c.audit(start, limit, after)
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("SEQ", "WHEN", "WHO", "ROLE", "FROM", "CALL OR EVENT", "STATUS", "TARGET"):
        table.add_column(col, overflow="fold" if col == "CALL OR EVENT" else "ellipsis")
    for a in rows:
        who = f"{a.token_name} ({a.token_id})" if a.token_id else "-"
        what = f"{a.event}: {a.detail}" if a.event else f"{a.method} {a.path}"
        table.add_row(
            str(a.seq),
            a.at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
            shown(who),
            shown(a.role or ("server" if a.event else "-")),
            shown(a.address),
            shown(what),
            "-" if a.status is None else str(a.status),
            shown(a.target or "-"),
        )
    out.print(table)
    if len(rows) == limit:
        err.print(f"more records follow: gpufleet audit --after {rows[-1].seq}")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``30m``, ``2h``, ``7d``, ``45s`` back from ``now``, or an ISO date/time (local time
    unless it names a zone). ConfigError naming the flag otherwise."""
    now = now or datetime.now(UTC)
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"--since {text!r}: expected a duration like 30m, 2h or 7d, or a date like "
            "2026-11-23 or 2026-11-23T09:00"
        ) from None
    return when if when.tzinfo else when.astimezone()
