"""``gpufleet worker install``: a persistent worker as a systemd unit or a Scheduled Task.

The token never goes on a command line or into the unit. On Linux it sits in a root-only
environment file (mode 0600 from its creation) that systemd reads before it starts the
worker; on Windows in a file only SYSTEM and Administrators may read, which the task's
launcher script loads at start. Every value is quoted for the file it lands in, so a
label or URL with spaces, quotes or ``$`` stays one literal value.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Annotated, Any

import typer

from gpufleet import config, tokens
from gpufleet.cli._common import parse_pairs, resolve, setting_option
from gpufleet.cli.service_files import (
    ENV_DIR,
    STOP_SLACK,
    UNIT_DIR,
    WorkerService,
    check_name,
    check_user,
    check_value,
    current_euid,
    render_env_file,
    render_unit,
    render_windows,
    slot_user_names,
    systemd_defaults,
    useradd_argv,
    write_systemd,
)
from gpufleet.errors import ConfigError

# --------------------------------------------------------------------------- building


def read_token(token_file: Path | None, server: str) -> tuple[str, str]:
    """``(token, where it came from)``: ``--token-file``, else what the CLI would use."""
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise ConfigError(f"--token-file {token_file}: cannot read it: {why}") from exc
        where = f"--token-file {token_file}"
        if not token:
            raise ConfigError(f"{where}: the file is empty; put the worker's token in it")
    else:
        resolved = resolve(server=server)
        token = config.worker_token_for(server, resolved) or ""
        where = resolved.sources["token"].removeprefix("env ")
        if not resolved["token"]:
            where = f"the worker token saved for {server} in {config.credentials_path()}"
    if not token:
        raise ConfigError(
            f"no token for the worker service at {server}: set GPUFLEET_TOKEN or pass "
            "--token-file FILE (tokens never go on the command line); create one with "
            "`gpufleet tokens create --role worker --name HOST`"
        )
    return tokens.clean(token, where), where


@dataclass(frozen=True)
class Given:
    """The worker settings given to ``install``, as typed."""

    server: str | None = None
    pool: str | None = None
    name: str | None = None
    labels: str | None = None
    slots: int | None = None
    mount: tuple[str, ...] = ()
    work_dir: str | None = None
    cache_dir: str | None = None
    cache_size: str | None = None
    drain_grace: float | None = None
    ca: str | None = None
    run_as: str | None = None  # existing slot users, USER,USER
    slot_users: int | None = None  # slot users to make: gpufleet-slot1..N


def _slot_users(g: Given, user: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(users jobs run as, users to make)`` from ``--run-as`` or ``--slot-users``."""
    if g.run_as is not None and g.slot_users is not None:
        raise ConfigError("--run-as and --slot-users: give one of them")
    if g.slot_users is not None:
        names = slot_user_names(g.slot_users)
        made = names
    else:
        names = tuple(u.strip() for u in (g.run_as or "").split(",") if u.strip())
        made = ()
    for name in names:
        check_user(name, "--run-as")
    if names and user not in (None, "root", "0"):
        raise ConfigError(
            f"--user {user} with slot users: the worker must run as root to start each job "
            "as a slot user of its own; leave out --user"
        )
    return names, made


def _path(flag: str, raw: str, windows: bool) -> str:
    check_value(flag, raw)
    if not windows:
        return str(Path(raw).expanduser().absolute())
    if not PureWindowsPath(raw).is_absolute():
        raise ConfigError(f"{flag} {raw}: give an absolute Windows path, e.g. C:\\gpufleet\\work")
    return raw


def _settings(g: Given, server: str, windows: bool) -> dict[str, str]:
    env = {"GPUFLEET_SERVER": server}
    for key, value, flag in (
        ("POOL", g.pool, "--pool"),
        ("NAME", g.name, "--name"),
        ("LABELS", g.labels, "--labels"),
    ):
        if value is not None:
            env["GPUFLEET_" + key] = check_value(flag, value)
    if g.labels is not None:
        parse_pairs([g.labels], "--labels")
    if g.slots is not None:
        env["GPUFLEET_SLOTS"] = str(g.slots)
    if g.mount:
        mounts = [_path("--mount", m, windows) for m in g.mount]
        for m in mounts:
            if "," in m:
                raise ConfigError(f"--mount {m}: a mount path cannot hold a comma")
        env["GPUFLEET_MOUNT"] = ",".join(mounts)
    dirs = {} if windows else systemd_defaults(f"-{g.name}" if g.name else "")
    for key, raw, flag in (
        ("WORK_DIR", g.work_dir, "--work-dir"),
        ("CACHE_DIR", g.cache_dir, "--cache-dir"),
    ):
        if raw is not None:
            dirs["GPUFLEET_" + key] = _path(flag, raw, windows)
    env.update(dirs)
    if g.cache_size is not None:
        try:
            config.parse_size(g.cache_size)
        except ValueError as exc:
            raise ConfigError(f"--cache-size {g.cache_size!r}: {exc}") from None
        env["GPUFLEET_CACHE_SIZE"] = check_value("--cache-size", g.cache_size.strip())
    return env


def build_service(
    g: Given, *, token_file: Path | None, python: str, user: str | None, windows: bool
) -> WorkerService:
    """Check every value and gather what the service runs with (the token last)."""
    check_name(g.name)
    check_user(user)
    # The server, and the CA that verifies it, as the CLI here would use them.
    here = resolve(server=g.server, ca=g.ca)
    server = check_value("--server", here["server"])
    env = _settings(g, server, windows)
    if here["ca"] is not None:
        ca = g.ca if windows and g.ca is not None else str(here["ca"])
        env["GPUFLEET_CA"] = _path("--ca", ca, windows)
    grace = (
        config.SETTINGS["drain_grace"].default_value() if g.drain_grace is None else g.drain_grace
    )
    # Written even when it is the default, so the unit's stop timeout always matches it.
    env["GPUFLEET_DRAIN_GRACE"] = f"{grace:g}"
    run_as, create = _slot_users(g, user)
    if run_as:
        env["GPUFLEET_RUN_AS"] = ",".join(run_as)
    token, source = read_token(token_file, server)
    return WorkerService(
        g.name, check_value("--python", python), env, token, grace, user, source, run_as, create
    )


# --------------------------------------------------------------------------- the CLI


def worker_group(run: Callable[..., None]) -> typer.Typer:
    """``gpufleet worker``: ``run`` with its options, as before, plus ``install``."""
    signature = inspect.signature(run, eval_str=True)

    @functools.wraps(run)
    def callback(ctx: typer.Context, **options: Any) -> None:
        if ctx.invoked_subcommand is None:
            run(**options)
            return
        given = [p.opts[0] for p in ctx.command.params if p.name and _typed(ctx, p.name)]
        if given:
            sub = ctx.invoked_subcommand
            raise ConfigError(
                f"gpufleet worker {' '.join(given)} {sub}: options of `{sub}` go after it, "
                f"e.g. gpufleet worker {sub} {given[0]} ..."
            )

    ctx_param = inspect.Parameter(
        "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
    )
    params = [ctx_param, *signature.parameters.values()]
    callback.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    group = typer.Typer(subcommand_metavar="[COMMAND [ARGS]...]")
    group.callback(invoke_without_command=True)(callback)
    group.command("install")(install)
    return group


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave this option on the command line (not a default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _opt(help: str, *flags: str, **kw: Any) -> Any:
    return typer.Option(*flags, help=help, show_default=False, **kw)


_SYSTEMD_ONLY = ("--unit-dir", "--env-dir", "--user", "--run-as", "--slot-users")
Systemd = Annotated[
    bool, _opt("Write a systemd unit and its root-only environment file.", "--systemd")
]
Windows = Annotated[
    bool, _opt("Write a PowerShell script that registers a Scheduled Task.", "--windows")
]
Show = Annotated[
    bool, _opt("Show what would be written, the token masked; write nothing.", "--print")
]
Server = Annotated[str | None, setting_option("server")]
Ca = Annotated[str | None, setting_option("ca")]
Pool = Annotated[str | None, _opt("Pool the worker joins (default: the token's pool).")]
Name = Annotated[
    str | None,
    _opt("Worker name, also in the unit's name gpufleet-worker-NAME (default: hostname)."),
]
Labels = Annotated[str | None, _opt("Worker labels, k=v,k=v.")]
Slots = Annotated[int | None, _opt("Worker CPU slots (default: 1).", min=0)]
Mount = Annotated[list[str] | None, _opt("A shared path the worker can read; repeatable.")]
WorkDir = Annotated[
    str | None,
    _opt(
        "Where jobs run (default: /var/lib/gpufleet/worker[-NAME]/work, or beside the "
        "launcher on Windows)."
    ),
]
CacheDir = Annotated[
    str | None,
    _opt(
        "Where the worker caches packages (default: /var/cache/gpufleet/worker[-NAME], "
        "or beside the launcher on Windows)."
    ),
]
CacheSize = Annotated[str | None, _opt("Most bytes the package cache keeps, e.g. 50G.")]
DrainGrace = Annotated[
    float | None,
    _opt(
        "Seconds running jobs get to finish when the service stops (default: 60); the "
        f"unit waits {STOP_SLACK} s more before it kills.",
        min=0,
    ),
]
TokenFile = Annotated[
    Path | None,
    _opt(
        "File holding the worker's token (default: GPUFLEET_TOKEN, else the token "
        "saved for the server)."
    ),
]
User = Annotated[str | None, _opt("User the systemd service runs as (default: root).")]
RunAs = Annotated[
    str | None,
    _opt(
        "Run each job as a Unix user of its own, from USER,USER,... (one per CPU slot and "
        "GPU; the worker runs as root). Recommended for a worker that runs other people's jobs."
    ),
]
SlotUserCount = Annotated[
    int | None,
    _opt(
        "Make N slot users, gpufleet-slot1..N (useradd --system, no home, no login), unless "
        "they exist, and run each job as one of them (as --run-as).",
        min=1,
    ),
]
Python = Annotated[
    str | None,
    _opt(
        "The Python that runs `-m gpufleet worker` (default: this one; needed for "
        "--windows elsewhere than on Windows)."
    ),
]
UnitDir = Annotated[Path | None, _opt(f"Where the unit goes (default: {UNIT_DIR}).")]
EnvDir = Annotated[Path | None, _opt(f"Where the environment file goes (default: {ENV_DIR}).")]
OutFile = Annotated[
    Path | None,
    _opt(
        "Where the --windows script goes (default: ./install-gpufleet-worker[-NAME].ps1).",
        "--out",
    ),
]


def install(
    systemd: Systemd = False,
    windows: Windows = False,
    show: Show = False,
    server: Server = None,
    ca: Ca = None,
    pool: Pool = None,
    name: Name = None,
    labels: Labels = None,
    slots: Slots = None,
    mount: Mount = None,
    work_dir: WorkDir = None,
    cache_dir: CacheDir = None,
    cache_size: CacheSize = None,
    drain_grace: DrainGrace = None,
    token_file: TokenFile = None,
    user: User = None,
    run_as: RunAs = None,
    slot_users: SlotUserCount = None,
    python: Python = None,
    unit_dir: UnitDir = None,
    env_dir: EnvDir = None,
    out_file: OutFile = None,
) -> None:
    """Make a persistent worker: a systemd unit, or a Windows Scheduled Task script."""
    if systemd == windows:
        raise ConfigError("gpufleet worker install: choose one of --systemd or --windows")
    _refuse_others_options(
        systemd,
        {
            "--out": out_file,
            "--unit-dir": unit_dir,
            "--env-dir": env_dir,
            "--user": user,
            "--run-as": run_as,
            "--slot-users": slot_users,
        },
    )
    given = Given(
        server, pool, name, labels, slots, tuple(mount or ()), work_dir, cache_dir, cache_size,
        drain_grace, ca, run_as, slot_users,
    )  # fmt: skip
    svc = build_service(
        given, token_file=token_file, python=_python(python, windows), user=user, windows=windows
    )
    if systemd:
        _install_systemd(svc, unit_dir or UNIT_DIR, env_dir or ENV_DIR, show)
    else:
        _install_windows(svc, out_file or Path(f"install-{svc.task_name}.ps1"), show)


def _refuse_others_options(systemd: bool, given: dict[str, object]) -> None:
    """An option of the other kind of service (``--out`` is Windows', the rest systemd's)."""
    wrong = [
        flag
        for flag, value in given.items()
        if value is not None and (flag in _SYSTEMD_ONLY) != systemd
    ]
    if wrong:
        target = "--systemd" if systemd else "--windows"
        raise ConfigError(f"{', '.join(wrong)}: not an option of {target}")


def _python(given: str | None, windows: bool) -> str:
    if given:
        if not windows and not os.path.isabs(given):
            raise ConfigError(f"--python {given}: systemd needs an absolute path")
        return given
    if windows and os.name != "nt":
        raise ConfigError(
            "--windows from a machine that is not Windows needs --python: the python.exe "
            "gpufleet is installed in on the Windows machine"
        )
    return os.path.abspath(sys.executable)


def _install_systemd(svc: WorkerService, unit_dir: Path, env_dir: Path, show: bool) -> None:
    unit_path, env_path = unit_dir / svc.unit_name, env_dir / svc.env_name
    if show:
        if svc.create_users:
            print("# the slot users, made where missing:")
            print("\n".join(" ".join(useradd_argv(u)) for u in svc.create_users))
        print(f"# {unit_path}")
        print(render_unit(svc, env_path))
        print(f"# {env_path} (mode 0600, owner root; the token masked)")
        print(render_env_file(svc, masked=True), end="")
        return
    write_systemd(svc, unit_dir, env_dir, euid=current_euid())
    if svc.run_as:
        print(f"jobs run as {', '.join(svc.run_as)}, one user per running job")
    print(f"wrote {unit_path}")
    print(f"wrote {env_path} (mode 0600: it holds the token, from {svc.token_source})")
    unit = svc.unit_name if unit_dir == UNIT_DIR else str(unit_path)
    print("start it now and at every boot with:")
    print(f"  systemctl daemon-reload && systemctl enable --now {unit}")


def _install_windows(svc: WorkerService, out_file: Path, show: bool) -> None:
    if show:
        print(render_windows(svc, masked=True), end="")
        return
    try:
        config.write_file(out_file, render_windows(svc, masked=False), 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write {out_file}: {exc.strerror or exc}") from exc
    print(f"wrote {out_file} (mode 0600: it holds the token, from {svc.token_source})")
    print("on the Windows machine, in an elevated PowerShell, run it once, then delete it:")
    print(f'  powershell -NoProfile -ExecutionPolicy Bypass -File "{out_file.name}"')
