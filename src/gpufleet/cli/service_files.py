"""The files a persistent worker service is made of: a systemd unit and its root-only
environment file, or a PowerShell script that registers a Windows Scheduled Task and
the launcher it runs. Every value is checked and quoted for the file it lands in."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpufleet.config.files import write_file
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
    run_as: tuple[str, ...] = ()  # slot users jobs run as (GPUFLEET_RUN_AS)
    create_users: tuple[str, ...] = ()  # of those, the ones install makes (--slot-users)

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


def check_user(user: str | None, flag: str = "--user") -> str | None:
    if user is not None and not _USER.match(user):
        raise ConfigError(f"{flag} {user!r}: not a valid user name")
    return user


def slot_user_names(count: int) -> tuple[str, ...]:
    """The slot users ``--slot-users N`` makes: gpufleet-slot1 to gpufleet-slotN."""
    return tuple(f"gpufleet-slot{i}" for i in range(1, count + 1))


def useradd_argv(name: str) -> list[str]:
    """The command that makes a slot user: a system user with no home and no login."""
    shell = "/usr/sbin/nologin" if Path("/usr/sbin/nologin").exists() else "/bin/false"
    return ["useradd", "--system", "--no-create-home", "--user-group", "--shell", shell, name]


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
    if svc.run_as:  # slot users pass through the state dir to their jobs' folders
        user += [
            "# Root, to start each job as a slot user of its own (GPUFLEET_RUN_AS).",
            "StateDirectoryMode=0711",
            "CacheDirectoryMode=0700",
        ]
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
        _check_user_exists(svc.user, "--user")
    make_slot_users(svc.create_users)
    for name in svc.run_as:
        _check_user_exists(name, "--run-as")
    unit_path, env_path = unit_dir / svc.unit_name, env_dir / svc.env_name
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        env_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file(env_path, render_env_file(svc, masked=False), 0o600)
        write_file(unit_path, render_unit(svc, env_path), 0o644)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {exc.filename or unit_dir}: {exc.strerror or exc}"
        ) from exc
    return unit_path, env_path


def _user_exists(user: str) -> bool:
    import pwd

    try:
        pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def _check_user_exists(user: str, flag: str) -> None:
    if not _user_exists(user):
        raise ConfigError(f"{flag} {user}: no such user on this machine")


def make_slot_users(names: tuple[str, ...]) -> list[str]:
    """Make the slot users that do not exist yet (useradd); the names made."""
    import subprocess

    made = []
    for name in names:
        if _user_exists(name):
            continue
        argv = useradd_argv(name)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except OSError as exc:
            raise ConfigError(f"--slot-users: cannot run useradd: {exc.strerror or exc}") from exc
        if done.returncode != 0:
            raise ConfigError(
                f"--slot-users: `{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}"
            )
        made.append(name)
    return made


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
    launcher = render_launcher(svc)
    if any(line.startswith("'@") for line in launcher):  # cannot happen: values are one line
        raise ConfigError("a value would end the launcher's here-string")
    lines = [
        *_windows_token(svc, ps_quote(MASK if masked else svc.token)),
        "",
        "$LauncherText = @'",
        *launcher,
        "'@",
        "# UTF-8 with a BOM, so Windows PowerShell reads non-ASCII values right.",
        "$Utf8Bom = New-Object System.Text.UTF8Encoding $true",
        "[System.IO.File]::WriteAllText($Launcher, $LauncherText, $Utf8Bom)",
        "",
        *_windows_task(),
    ]
    return "\n".join(lines) + "\n"


def _windows_token(svc: WorkerService, token: str) -> list[str]:
    """The script's start: its names, a check that Python runs gpufleet, and the token
    written into a file only SYSTEM and Administrators may read."""
    base = f"worker{svc.suffix}"
    return [
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
    ]


def _windows_task() -> list[str]:
    """The script's end: register the task (its command line names the launcher only)
    and start it."""
    return [
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
