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
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Annotated, Any

import typer

from gpufleet import config, tokens
from gpufleet.cli._common import parse_pairs, resolve, setting_option
from gpufleet.errors import ConfigError

UNIT_DIR = Path("/etc/systemd/system")
ENV_DIR = Path("/etc/gpufleet")
MASK = "****"
STOP_SLACK = 30  # seconds past the drain grace: the 3 s job kill, the 10 s final report, margin

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PS_QUOTES = "'\u2018\u2019\u201a\u201b"  # PowerShell ends a '...' string at any of these


def current_euid() -> int:
    """The effective user id (a seam for tests; 0 where there is none, i.e. Windows)."""
    geteuid: Callable[[], int] | None = getattr(os, "geteuid", None)
    return geteuid() if geteuid else 0


# --------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class WorkerService:
    """What a service worker runs with: its settings as ``GPUFLEET_*`` variables."""

    name: str | None  # also the unit / task suffix; None = the host's name at run time
    python: str  # the interpreter that runs ``-m gpufleet worker``
    env: dict[str, str]  # GPUFLEET_* -> value, without the token
    token: str
    drain_grace: float
    user: str | None = None
    token_source: str = ""

    @property
    def suffix(self) -> str:
        return f"-{self.name}" if self.name else ""

    @property
    def unit_name(self) -> str:
        return f"gpufleet-worker{self.suffix}.service"

    @property
    def task_name(self) -> str:
        return f"gpufleet-worker{self.suffix}"

    @property
    def env_name(self) -> str:
        return f"worker{self.suffix}.env"

    @property
    def stop_timeout(self) -> int:
        return math.ceil(self.drain_grace) + STOP_SLACK


def check_value(what: str, value: str) -> str:
    """Refuse control characters (a newline would end the value in every file format)."""
    if _CONTROL.search(value):
        raise ConfigError(
            f"{what} {value!r}: control characters (such as a newline) cannot go into "
            "a service's settings"
        )
    return value


def check_name(name: str | None) -> str | None:
    if name is not None and not _NAME.match(name):
        raise ConfigError(
            f"--name {name!r}: a service worker's name is 1-64 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (it is part of the unit and task name)"
        )
    return name


def check_user(user: str | None) -> str | None:
    if user is not None and not _USER.match(user):
        raise ConfigError(f"--user {user!r}: not a valid user name")
    return user


# --------------------------------------------------------------------------- quoting


def env_quote(value: str) -> str:
    """A double-quoted value meaning the same to systemd's EnvironmentFile= and to sh."""
    escaped = re.sub(r'([\\"$`])', r"\\\1", check_value("value", value))
    return f'"{escaped}"'


def unit_quote(word: str) -> str:
    """One ExecStart= word: quoted when needed, ``%`` and ``$`` kept literal."""
    check_value("value", word)
    if re.search(r"[\s\"'\\;]", word) or word == "":
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return unit_literal(word)


def unit_literal(value: str) -> str:
    """A whole-line unit setting (a path): systemd expands ``%`` specifiers and ``$``."""
    return check_value("value", value).replace("%", "%%").replace("$", "$$")


def ps_quote(value: str) -> str:
    """A PowerShell single-quoted literal: no expansion; every quote character doubled."""
    doubled = "".join(c * 2 if c in _PS_QUOTES else c for c in check_value("value", value))
    return f"'{doubled}'"


# --------------------------------------------------------------------------- systemd


def render_env_file(svc: WorkerService, *, masked: bool) -> str:
    lines = [
        f"# Settings of the {svc.unit_name}, read by systemd before it starts the worker.",
        "# Root only (mode 0600): it holds the worker's token.",
        *(f"{key}={env_quote(value)}" for key, value in svc.env.items()),
        f"GPUFLEET_TOKEN={env_quote(MASK if masked else svc.token)}",
    ]
    return "\n".join(lines) + "\n"


def render_unit(svc: WorkerService, env_path: Path) -> str:
    state = f"gpufleet/worker{svc.suffix}"
    user = [f"User={svc.user}"] if svc.user else []
    grace = f"{svc.drain_grace:g}"
    lines = [
        "# Written by `gpufleet worker install --systemd`. The settings and the token are",
        f"# in {env_path} (root only); after editing it:",
        f"#   systemctl restart {svc.unit_name}",
        "[Unit]",
        f"Description=gpufleet worker {svc.name or '(named after the host)'}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"EnvironmentFile={unit_literal(str(env_path))}",
        "ExecStart=" + " ".join(unit_quote(w) for w in (svc.python, "-m", "gpufleet", "worker")),
        *user,
        f"StateDirectory={state}",
        f"CacheDirectory={state}",
        f"WorkingDirectory=/var/lib/{state}",
        "# Restarted after a crash or an error, but not after exit 0: that is a worker",
        "# drained by `gpufleet drain`, which stays stopped until `systemctl start`.",
        "Restart=always",
        "RestartPreventExitStatus=0",
        "RestartSec=5",
        f"# SIGTERM drains the worker: no new jobs, running ones get {grace} s to finish.",
        "# mixed: the SIGTERM goes to the worker alone, so its jobs run on while it drains",
        "# (control-group would SIGTERM them at once); whatever is left when it exits, or",
        f"# when TimeoutStopSec (the drain grace + {STOP_SLACK} s) is up, is SIGKILLed.",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={svc.stop_timeout}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


def systemd_defaults(svc_suffix: str) -> dict[str, str]:
    """Work and cache dirs systemd creates for the unit (StateDirectory=, CacheDirectory=)."""
    return {
        "GPUFLEET_WORK_DIR": f"/var/lib/gpufleet/worker{svc_suffix}/work",
        "GPUFLEET_CACHE_DIR": f"/var/cache/gpufleet/worker{svc_suffix}",
    }


def write_systemd(
    svc: WorkerService, unit_dir: Path, env_dir: Path, *, euid: int
) -> tuple[Path, Path]:
    """Write the unit (0644) and the env file (0600); root needed for the system dirs."""
    system = [str(d) for d, default in ((unit_dir, UNIT_DIR), (env_dir, ENV_DIR)) if d == default]
    if euid != 0 and system:
        raise ConfigError(
            f"writing to {' and '.join(system)} needs root: run it with sudo (pass the "
            "token with --token-file, which sudo keeps), or see it first with --print"
        )
    if svc.user:
        _check_user_exists(svc.user)
    unit_path, env_path = unit_dir / svc.unit_name, env_dir / svc.env_name
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        env_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        config.write_file(env_path, render_env_file(svc, masked=False), 0o600)
        config.write_file(unit_path, render_unit(svc, env_path), 0o644)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {exc.filename or unit_dir}: {exc.strerror or exc}"
        ) from exc
    return unit_path, env_path


def _check_user_exists(user: str) -> None:
    import pwd

    try:
        pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"--user {user}: no such user on this machine") from None


# --------------------------------------------------------------------------- Windows


def render_launcher(svc: WorkerService) -> list[str]:
    """The script the task runs: settings into the environment, the token from its file."""
    base = f"worker{svc.suffix}"
    env = {
        "GPUFLEET_WORK_DIR": f"(Join-Path $PSScriptRoot {ps_quote(base + chr(92) + 'work')})",
        "GPUFLEET_CACHE_DIR": f"(Join-Path $PSScriptRoot {ps_quote(base + chr(92) + 'cache')})",
    }
    env.update({k: ps_quote(v) for k, v in svc.env.items()})
    token_file = f"(Join-Path $PSScriptRoot {ps_quote(base + '.token')})"
    return [
        f"# Started at boot by the Scheduled Task {svc.task_name}; written by",
        "# `gpufleet worker install --windows`.",
        *(f"$env:{k} = {v}" for k, v in env.items()),
        f"$env:GPUFLEET_TOKEN = (Get-Content -Raw -LiteralPath {token_file}).Trim()",
        f"$Out = Join-Path $PSScriptRoot {ps_quote(base + '.log')}",
        f"$Err = Join-Path $PSScriptRoot {ps_quote(base + '.err.log')}",
        "while ($true) {",
        f"    $p = Start-Process -FilePath {ps_quote(svc.python)} "
        "-ArgumentList '-m', 'gpufleet', 'worker' `",
        "        -NoNewWindow -Wait -PassThru -RedirectStandardOutput $Out "
        "-RedirectStandardError $Err",
        "    # 0: drained (`gpufleet drain`), so stay stopped until the next start",
        "    if ($p.ExitCode -eq 0) { exit 0 }",
        "    Start-Sleep -Seconds 10",
        "}",
    ]


def render_windows(svc: WorkerService, *, masked: bool) -> str:
    """A PowerShell script registering the worker as a Scheduled Task run as SYSTEM."""
    base = f"worker{svc.suffix}"
    token = ps_quote(MASK if masked else svc.token)
    launcher = render_launcher(svc)
    if any(line.startswith("'@") for line in launcher):  # cannot happen: values are one line
        raise ConfigError("a value would end the launcher's here-string")
    lines = [
        f"# Registers the Scheduled Task {svc.task_name}: a gpufleet worker started at boot,",
        "# as SYSTEM, and restarted when it fails. Written by `gpufleet worker install",
        "# --windows`. Run it once in an elevated PowerShell, then delete it: it holds the",
        "# worker's token.",
        "#Requires -RunAsAdministrator",
        "$ErrorActionPreference = 'Stop'",
        f"$TaskName = {ps_quote(svc.task_name)}",
        f"$Python = {ps_quote(svc.python)}",
        "$Dir = Join-Path $env:ProgramData 'gpufleet'",
        f"$TokenFile = Join-Path $Dir {ps_quote(base + '.token')}",
        f"$Launcher = Join-Path $Dir {ps_quote(base + '.ps1')}",
        "",
        "& $Python -m gpufleet --version | Out-Null",
        'if ($LASTEXITCODE -ne 0) { throw "$Python cannot run gpufleet: pass --python" }',
        "",
        "# Only SYSTEM (S-1-5-18) and Administrators (S-1-5-32-544) may read the folder,",
        "# and the token file is locked down before the token goes in.",
        "New-Item -ItemType Directory -Force -Path $Dir | Out-Null",
        "icacls $Dir /inheritance:r /grant:r '*S-1-5-18:(OI)(CI)F' '*S-1-5-32-544:(OI)(CI)F'"
        " | Out-Null",
        'if ($LASTEXITCODE -ne 0) { throw "icacls failed on $Dir" }',
        "New-Item -ItemType File -Force -Path $TokenFile | Out-Null",
        "icacls $TokenFile /inheritance:r /grant:r '*S-1-5-18:F' '*S-1-5-32-544:F' | Out-Null",
        'if ($LASTEXITCODE -ne 0) { throw "icacls failed on $TokenFile" }',
        f"Set-Content -LiteralPath $TokenFile -NoNewline -Encoding ascii -Value {token}",
        "",
        "$LauncherText = @'",
        *launcher,
        "'@",
        "# UTF-8 with a BOM, so Windows PowerShell reads non-ASCII values right.",
        "$Utf8Bom = New-Object System.Text.UTF8Encoding $true",
        "[System.IO.File]::WriteAllText($Launcher, $LauncherText, $Utf8Bom)",
        "",
        "# The task's command line names the launcher only: no token, no settings.",
        "$Action = New-ScheduledTaskAction -Execute 'powershell.exe' "
        "-Argument ('-NoProfile -NonInteractive -ExecutionPolicy Bypass -File \"{0}\"' "
        "-f $Launcher)",
        "$Trigger = New-ScheduledTaskTrigger -AtStartup",
        "$Principal = New-ScheduledTaskPrincipal -UserId 'SYSTEM' -LogonType ServiceAccount "
        "-RunLevel Highest",
        "$Settings = New-ScheduledTaskSettingsSet -ExecutionTimeLimit ([TimeSpan]::Zero) `",
        "    -RestartCount 999 -RestartInterval (New-TimeSpan -Minutes 1) -StartWhenAvailable `",
        "    -AllowStartIfOnBatteries -DontStopIfGoingOnBatteries -MultipleInstances IgnoreNew",
        "Register-ScheduledTask -TaskName $TaskName -Action $Action -Trigger $Trigger "
        "-Principal $Principal -Settings $Settings -Force | Out-Null",
        "Start-ScheduledTask -TaskName $TaskName",
        'Write-Host "Scheduled Task $TaskName registered and started; logs in $Dir."',
        'Write-Host "Delete this script now: it holds the worker\'s token."',
    ]
    return "\n".join(lines) + "\n"


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
        token = config.token_for(server, resolved) or ""
        where = resolved.sources["token"].removeprefix("env ")
        if not resolved["token"]:
            where = f"the token saved for {server} in {config.credentials_path()}"
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
    token, source = read_token(token_file, server)
    return WorkerService(g.name, check_value("--python", python), env, token, grace, user, source)


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


def install(
    systemd: Annotated[
        bool, _opt("Write a systemd unit and its root-only environment file.", "--systemd")
    ] = False,
    windows: Annotated[
        bool, _opt("Write a PowerShell script that registers a Scheduled Task.", "--windows")
    ] = False,
    show: Annotated[
        bool, _opt("Show what would be written, the token masked; write nothing.", "--print")
    ] = False,
    server: Annotated[str | None, setting_option("server")] = None,
    ca: Annotated[str | None, setting_option("ca")] = None,
    pool: Annotated[str | None, _opt("Pool the worker joins (default: the token's pool).")] = None,
    name: Annotated[
        str | None,
        _opt("Worker name, also in the unit's name gpufleet-worker-NAME (default: hostname)."),
    ] = None,
    labels: Annotated[str | None, _opt("Worker labels, k=v,k=v.")] = None,
    slots: Annotated[int | None, _opt("Worker CPU slots (default: 1).", min=0)] = None,
    mount: Annotated[
        list[str] | None, _opt("A shared path the worker can read; repeatable.")
    ] = None,
    work_dir: Annotated[
        str | None,
        _opt(
            "Where jobs run (default: /var/lib/gpufleet/worker[-NAME]/work, or beside the "
            "launcher on Windows)."
        ),
    ] = None,
    cache_dir: Annotated[
        str | None,
        _opt(
            "Where the worker caches packages (default: /var/cache/gpufleet/worker[-NAME], "
            "or beside the launcher on Windows)."
        ),
    ] = None,
    cache_size: Annotated[str | None, _opt("Most bytes the package cache keeps, e.g. 50G.")] = None,
    drain_grace: Annotated[
        float | None,
        _opt(
            "Seconds running jobs get to finish when the service stops (default: 60); the "
            f"unit waits {STOP_SLACK} s more before it kills.",
            min=0,
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        _opt(
            "File holding the worker's token (default: GPUFLEET_TOKEN, else the token "
            "saved for the server)."
        ),
    ] = None,
    user: Annotated[str | None, _opt("User the systemd service runs as (default: root).")] = None,
    python: Annotated[
        str | None,
        _opt(
            "The Python that runs `-m gpufleet worker` (default: this one; needed for "
            "--windows elsewhere than on Windows)."
        ),
    ] = None,
    unit_dir: Annotated[Path | None, _opt(f"Where the unit goes (default: {UNIT_DIR}).")] = None,
    env_dir: Annotated[
        Path | None, _opt(f"Where the environment file goes (default: {ENV_DIR}).")
    ] = None,
    out_file: Annotated[
        Path | None,
        _opt(
            "Where the --windows script goes (default: ./install-gpufleet-worker[-NAME].ps1).",
            "--out",
        ),
    ] = None,
) -> None:
    """Make a persistent worker: a systemd unit, or a Windows Scheduled Task script."""
    if systemd == windows:
        raise ConfigError("gpufleet worker install: choose one of --systemd or --windows")
    wrong = [f for f, v in (("--out", out_file),) if v is not None and systemd] + [
        f
        for f, v in (("--unit-dir", unit_dir), ("--env-dir", env_dir), ("--user", user))
        if v is not None and windows
    ]
    if wrong:
        target = "--systemd" if systemd else "--windows"
        raise ConfigError(f"{', '.join(wrong)}: not an option of {target}")
    given = Given(
        server,
        pool,
        name,
        labels,
        slots,
        tuple(mount or ()),
        work_dir,
        cache_dir,
        cache_size,
        drain_grace,
        ca,
    )
    svc = build_service(
        given, token_file=token_file, python=_python(python, windows), user=user, windows=windows
    )
    if systemd:
        _install_systemd(svc, unit_dir or UNIT_DIR, env_dir or ENV_DIR, show)
    else:
        _install_windows(svc, out_file or Path(f"install-{svc.task_name}.ps1"), show)


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
        print(f"# {unit_path}")
        print(render_unit(svc, env_path))
        print(f"# {env_path} (mode 0600, owner root; the token masked)")
        print(render_env_file(svc, masked=True), end="")
        return
    write_systemd(svc, unit_dir, env_dir, euid=current_euid())
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
