"""``gpufleet tokens`` (create, list, rotate and revoke tokens: admin) and ``gpufleet
whoami`` (the token this CLI uses)."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import (
    CaOpt,
    JsonOpt,
    ServerOpt,
    SessionOpt,
    client,
    day,
    err,
    out,
    parse_pairs,
    print_json,
    shown,
)
from gpufleet.cli.choose import session_client
from gpufleet.wire import TokenCreate, TokenCreated

tokens_app = typer.Typer(help="Create, list and revoke tokens (admin).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command()(whoami)
    app.add_typer(tokens_app, name="tokens")


def whoami(
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The token this CLI uses (or the session's): its id, name, role and pools; never its
    secret."""
    with session_client(server, ca, session) as c:
        me = c.whoami()
        url = c.server
    if as_json:
        print_json(me)
        return
    pools = ", ".join(me.pools) or "every pool"
    who = f"{shown(me.id)} ({shown(me.name)}): {shown(me.role)}"
    out.print(f"{who} of {shown(pools)} on {shown(url)}")


def _enroll_hint(server: str, pool: str, name: str) -> str:
    """The commands that enroll a machine with a new worker token (the token is pasted at a
    prompt into the environment, so it is in no argv and no shell history)."""
    return (
        "To enroll a machine as a worker of pool "
        f"{pool!r}, run there and paste the token at the prompt:\n"
        "  read -rs GPUFLEET_TOKEN && export GPUFLEET_TOKEN\n"
        f"  gpufleet worker --server {shlex.quote(server)} --pool {shlex.quote(pool)} "
        f"--name {shlex.quote(name)}\n"
        "or, for a worker that starts with the machine: gpufleet worker install --systemd"
    )


def _show_secret(t: TokenCreated, server: str, what: str, as_json: bool = False) -> None:
    """The secret alone on stdout (for scripts), everything else on stderr; or all of it
    as JSON on stdout."""
    if as_json:
        sys.stdout.write(json.dumps(t.model_dump(mode="json"), indent=2) + "\n")
        return
    scope = f", pool {shown(', '.join(t.pools))}" if t.pools else ""
    expires = f", expires {t.expires_at:%Y-%m-%d %H:%M} UTC" if t.expires_at else ""
    err.print(
        f"token {shown(t.id)} ({shown(t.role)}{scope}{expires}) {what}; the secret is shown once:"
    )
    print(t.token, flush=True)
    if t.role == "worker":
        hint = _enroll_hint(server, t.pools[0], t.name)
        err.print("\n".join(map(shown, hint.splitlines())))


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="A label for the token, e.g. the machine it is for.")],
    role: Annotated[str, typer.Option(help="admin, operator, submitter or worker.")] = "worker",
    pool: Annotated[
        list[str] | None,
        typer.Option(
            help="Pool the token is scoped to (repeatable for a submitter or operator; a "
            "worker token has exactly one; default: 'default'). An operator token without "
            "--pool, and an admin token, act on every pool."
        ),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            help="k=v (repeatable), worker tokens: a label every worker enrolled with this "
            "token carries, whatever it declares (jobs can trust it, e.g. team=nlp)."
        ),
    ] = None,
    expires: Annotated[
        float | None, typer.Option(help="Days until the token stops working (default: never).")
    ] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the token as JSON (its secret included).")
    ] = False,
) -> None:
    """Create a token and print its secret once (the server keeps only its hash); for a
    worker token, also the command that enrolls a machine."""
    labels = parse_pairs(label or [], "--label")
    body = TokenCreate(name=name, role=role, pools=pool or [], expires_days=expires, labels=labels)
    with client(server, ca) as c:
        t = c.create_token(body)
        url = c.server
    _show_secret(t, url, "created", as_json)


@tokens_app.command("ls")
def tokens_list(server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False) -> None:
    """List tokens: id, name, role, pools, the secret's first characters, dates (never a
    secret)."""
    with client(server, ca) as c:
        rows = c.tokens()
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in (
        "ID",
        "NAME",
        "ROLE",
        "POOLS",
        "LABELS",
        "STARTS",
        "CREATED",
        "EXPIRES",
        "REVOKED",
    ):
        table.add_column(col)
    for t in rows:
        table.add_row(
            shown(t.id),
            shown(t.name),
            shown(t.role),
            shown(",".join(t.pools) or "(all)"),
            shown(",".join(f"{k}={v}" for k, v in t.labels.items()) or "-"),
            shown(t.hint),
            day(t.created_at),
            day(t.expires_at),
            day(t.revoked_at),
        )
    out.print(table)


tokens_app.command("list", hidden=True)(tokens_list)


SecretJsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the token as JSON (its new secret included).")
]


@tokens_app.command("rotate")
def tokens_rotate(
    token_id: Annotated[str, typer.Argument(help="Token id.")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: SecretJsonOpt = False,
) -> None:
    """Give a token a new secret (same id, role and pools); the old secret fails at once."""
    with client(server, ca) as c:
        t = c.rotate_token(token_id)
        url = c.server
    _show_secret(t, url, "rotated", as_json)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="Token id.")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke a token at once; workers it enrolled go offline and their jobs are requeued."""
    with client(server, ca) as c:
        t = c.revoke_token(token_id)
    if as_json:
        print_json(t)
        return
    out.print(f"{shown(token_id)}: revoked")
