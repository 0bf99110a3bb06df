"""``gpufleet webhooks``: word when a job ends (add, list, remove webhooks)."""

from __future__ import annotations

import getpass
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import CaOpt, JsonOpt, ServerOpt, client, err, out, print_json, shown
from gpufleet.domain.webhooks import EVENTS
from gpufleet.errors import ConfigError
from gpufleet.wire import WebhookCreate

if TYPE_CHECKING:
    from gpufleet.client import Client

webhooks_app = typer.Typer(
    help="Word when a job ends: webhooks for your jobs, a pool's or one job's.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(webhooks_app, name="webhooks")


def read_secret(path: Path | None, prompt: bool, what: str = "--secret-file") -> str | None:
    """A webhook secret from a file (``-``: stdin) or a prompt; None: the server makes one.
    Never from argv, where other users of the machine would see it."""
    if path is not None:
        text = sys.stdin.read() if str(path) == "-" else _read(path, what)
        secret = text.strip()
        if not secret:
            raise ConfigError(f"{what}: {path} is empty")
        return secret
    if prompt:
        return getpass.getpass("webhook secret (not shown): ").strip() or None
    return None


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path}: {exc.strerror}") from None


def show_made(secret: str | None, hook_id: str) -> None:
    """The secret the server made, alone on stdout (once); the rest on stderr."""
    if secret is None:
        err.print(f"webhook {shown(hook_id)} set")
        return
    err.print(f"webhook {shown(hook_id)} set; its signing secret is shown once:")
    print(secret, flush=True)


@webhooks_app.command("add")
def webhooks_add(
    url: Annotated[
        str, typer.Argument(help="The http(s) URL to POST to; '-': read it from stdin.")
    ],
    events: Annotated[
        list[str] | None,
        typer.Option(
            "--event",
            help=f"One of {', '.join(EVENTS)} (repeatable; default: succeeded, failed, preempted).",
        ),
    ] = None,
    running_past: Annotated[
        float | None, typer.Option(help="Seconds: say once when a job runs longer.")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="A pool's jobs (operators, admins).")] = None,
    job: Annotated[str | None, typer.Option(help="One job's events (its id).")] = None,
    secret_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the signing secret ('-': stdin); default: the "
            "server makes one and it is printed once."
        ),
    ] = None,
    prompt_secret: Annotated[bool, typer.Option(help="Type the secret at a prompt.")] = False,
    server: ServerOpt = None,
    ca: CaOpt = None,
) -> None:
    """Set a webhook: the server POSTs Slack-compatible JSON, signed, when a job ends."""
    if url == "-":
        url = sys.stdin.readline().strip()
    secret = read_secret(secret_file, prompt_secret)
    body = WebhookCreate(
        url=url, secret=secret, events=events or [], running_past=running_past, pool=pool, job=job
    )
    with client(server, ca) as c:
        made = c.create_webhook(body)
    show_made(made.secret, made.id)


@webhooks_app.command("list")
def webhooks_list(server: ServerOpt = None, ca: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Your webhooks (an operator: also its pools'): id, scope, events, the URL's host
    (never the URL or the secret)."""
    with client(server, ca) as c:
        rows = c.webhooks()
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("ID", "SCOPE", "OF", "HOST", "EVENTS", "CREATED"):
        table.add_column(col)
    for h in rows:
        table.add_row(
            shown(h.id), h.scope, shown(h.target), shown(h.host), shown(", ".join(h.events)),
            f"{h.created_at:%Y-%m-%d %H:%M}",
        )  # fmt: skip
    out.print(table)


@webhooks_app.command("remove")
def webhooks_remove(
    hook_id: Annotated[str, typer.Argument(help="The webhook's id (h-...).")],
    server: ServerOpt = None,
    ca: CaOpt = None,
) -> None:
    """Remove a webhook; deliveries still due are dropped."""
    with client(server, ca) as c:
        c.remove_webhook(hook_id)
    err.print(f"webhook {shown(hook_id)} removed")


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def duration(text: str, flag: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` in seconds."""
    m = _DURATION.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"{flag}: {text!r} is not a duration (such as 90s, 30m, 2h or 1d)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def notify_of(
    c: Client, job_id: str, url: str, secret_file: Path | None, after: str | None
) -> None:
    """``submit --notify``: a webhook of the one job just queued. ``url`` ``-``: a line
    of stdin (a Slack URL is a secret: on the command line, any user of the machine
    sees it in the process list)."""
    if url == "-":
        if secret_file is not None and str(secret_file) == "-":
            raise ConfigError("--notify - and --notify-secret-file -: only one may read stdin")
        url = sys.stdin.readline().strip()
        if not url:
            raise ConfigError("--notify -: no URL on stdin")
    secret = read_secret(secret_file, False, "--notify-secret-file")
    past = duration(after, "--notify-after") if after else None
    made = c.create_webhook(WebhookCreate(url=url, secret=secret, job=job_id, running_past=past))
    if made.secret is not None:
        # straight to stderr: the console would cut it as it cuts any token it shows
        sys.stderr.write(f"--notify: the signing secret, shown once: {made.secret}\n")
