"""``gpufleet worker`` (run a worker; ``worker install`` is in ``install.py``) and
``gpufleet capability`` (what a worker on this machine would report)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet import config, tokens
from gpufleet.cli import install
from gpufleet.cli._common import (
    HOUR,
    CaOpt,
    ServerOpt,
    err,
    parse_pairs,
    resolve,
    retention_seconds,
    setting_help,
    setting_option,
    shown,
)
from gpufleet.cli._flags import SettingFlags
from gpufleet.errors import ConfigError, GpufleetError

if TYPE_CHECKING:
    from gpufleet.domain.models import Capability
    from gpufleet.worker.options import WorkerOptions

SHARE_TOKEN_ENV = "GPUFLEET_SHARE_TOKEN"
SimOpt = Annotated[str | None, setting_option("simulate_gpus", extra=', as "NAME:VRAM_GIB,..."')]


def register(app: typer.Typer) -> None:
    app.command()(capability)
    app.add_typer(install.worker_group(worker), name="worker")  # `worker` runs it, plus `install`


Ephemeral = Annotated[
    bool | None,
    typer.Option("--ephemeral", help=setting_help("ephemeral"), show_default=False),
]
PythonDownloads = Annotated[
    bool | None,
    typer.Option(
        "--env-python-downloads",
        help=setting_help("env_python_downloads"),
        show_default=False,
    ),
]
ShareToken = Annotated[
    bool,
    typer.Option(
        "--share-token",
        help="Put the submit token in GPUFLEET_SHARE_TOKEN (a submitter token of this "
        "worker's pool only) into the session string the worker prints, so whoever gets "
        "the string can send jobs here. Off a terminal the string goes to a 0600 file.",
    ),
]
Mounts = Annotated[list[str] | None, setting_option("mount", extra="; repeatable")]
Yield = Annotated[
    bool,
    typer.Option(
        "--yield",
        help="From the owner's shell: tell the worker running on this machine (with this "
        "--work-dir) to vacate every job now and take none until --unyield; no token needed",
    ),
]
Unyield = Annotated[
    bool, typer.Option("--unyield", help="End a --yield: the worker takes jobs again")
]
YieldFor = Annotated[
    float | None,
    typer.Option(
        "--yield-for",
        min=1,
        metavar="SECONDS",
        help="As --yield, for this many seconds only",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class WorkerFlags(SettingFlags):
    """The options of ``gpufleet worker``: all but ``share_token`` are settings of the
    same name."""

    not_settings = frozenset({"share_token", "yield_now", "unyield", "yield_for"})

    server: ServerOpt = None
    name: Annotated[str | None, setting_option("name")] = None
    labels: Annotated[str | None, setting_option("labels")] = None
    slots: Annotated[int | None, setting_option("slots")] = None
    ephemeral: Ephemeral = None
    heartbeat: Annotated[float | None, setting_option("heartbeat")] = None
    simulate_gpus: SimOpt = None
    work_dir: Annotated[Path | None, setting_option("work_dir")] = None
    drain_grace: Annotated[float | None, setting_option("drain_grace")] = None
    pool: Annotated[str | None, setting_option("pool")] = None
    cache_dir: Annotated[Path | None, setting_option("cache_dir")] = None
    cache_size: Annotated[str | None, setting_option("cache_size")] = None
    log_backlog: Annotated[str | None, setting_option("log_backlog")] = None
    work_dir_retention: Annotated[float | None, setting_option("work_dir_retention")] = None
    env_cache_dir: Annotated[Path | None, setting_option("env_cache_dir")] = None
    env_cache_size: Annotated[str | None, setting_option("env_cache_size")] = None
    env_find_links: Annotated[str | None, setting_option("env_find_links")] = None
    env_index_url: Annotated[str | None, setting_option("env_index_url")] = None
    env_build_timeout: Annotated[float | None, setting_option("env_build_timeout")] = None
    env_python_downloads: PythonDownloads = None
    env_torch_backend: Annotated[str | None, setting_option("env_torch_backend")] = None
    env_builds: Annotated[str | None, setting_option("env_builds")] = None
    mount: Mounts = None
    ca: CaOpt = None
    share_token: ShareToken = False
    run_as: Annotated[str | None, setting_option("run_as")] = None
    owner_policy: Annotated[Path | None, setting_option("owner_policy")] = None
    yield_now: Yield = False
    unyield: Unyield = False
    yield_for: YieldFor = None

    def given(self) -> dict[str, Any]:
        """As :meth:`SettingFlags.given`, with ``--mount`` repeated as one list."""
        return super().given() | {"mount": ",".join(self.mount) if self.mount else None}


@WorkerFlags.command
def worker(**given: Any) -> None:
    """Run a worker: detect this machine, claim jobs that fit, run them, report back.
    It prints a session string; `gpufleet submit --session STRING` sends a job to it.

    Its token: GPUFLEET_TOKEN (or `token` in a config file), else the worker token the
    server on this machine saved for its workers (pool default); never the admin's."""
    from gpufleet.worker.agent import run_worker

    flags = WorkerFlags(**given)
    s = flags.resolved()
    if flags.yield_now or flags.unyield or flags.yield_for is not None:
        raise typer.Exit(_yield(s["work_dir"], flags))
    cap = _detect(s["simulate_gpus"])
    raise typer.Exit(run_worker(_worker_options(s, flags.share_token), cap))


def _worker_options(s: config.Resolved, share_token: bool) -> WorkerOptions:
    """The worker's options from its resolved settings; every ``--mount`` must exist."""
    from gpufleet.worker.options import WorkerOptions

    mounts = tuple(str(Path(m).expanduser().resolve()) for m in s["mount"].split(",") if m.strip())
    for m in mounts:
        if not Path(m).is_dir():
            raise GpufleetError(f"--mount {m}: no such folder on this machine")
    return WorkerOptions(
        server=s["server"],
        token=_worker_token(s),
        name=s["name"],
        labels=parse_pairs([s["labels"]], "--labels"),
        cpu_slots=1 if s["slots"] is None else s["slots"],
        ephemeral=s["ephemeral"],
        heartbeat=s["heartbeat"],
        work_dir=s["work_dir"],
        drain_grace=s["drain_grace"],
        pool=s["pool"],
        cache_dir=s["cache_dir"],
        cache_size=s["cache_size"],
        log_backlog=s["log_backlog"],
        work_dir_retention=retention_seconds(s["work_dir_retention"], HOUR),
        mounts=mounts,
        ca=s["ca"],
        share_token=_share_token() if share_token else None,
        run_as=tuple(u.strip() for u in s["run_as"].split(",") if u.strip()),
        env_cache_dir=s["env_cache_dir"],
        env_cache_size=s["env_cache_size"],
        env_find_links=tuple(f.strip() for f in s["env_find_links"].split(",") if f.strip()),
        env_index_url=s["env_index_url"] or None,
        env_build_timeout=s["env_build_timeout"],
        env_python_downloads=s["env_python_downloads"],
        env_torch_backend=s["env_torch_backend"],
        env_allow_builds=_builds(s["env_builds"]),
        owner_policy=_owner_policy(s["owner_policy"]),
    )


def _owner_policy(path: Path | None) -> Path | None:
    """``--owner-policy``, read once here: a bad file stops the worker before it starts."""
    from gpufleet.domain.owner import load_policy

    if path is not None:
        load_policy(path)
    return path


def _yield(work_dir: Path, flags: WorkerFlags) -> int:
    """``--yield``, ``--yield-for`` or ``--unyield``: tell the worker of ``work_dir``."""
    from gpufleet.worker.owner_yield import ask_unyield, ask_yield

    if flags.unyield:
        ask_unyield(work_dir)
        print("the worker takes jobs again (as its owner policy allows)")
        return 0
    vacated = ask_yield(work_dir, flags.yield_for)
    until = "--unyield" if flags.yield_for is None else f"{flags.yield_for:g}s have passed"
    print(f"vacated {vacated} job{'s' if vacated != 1 else ''}; no new jobs until {until}")
    return 0


def _builds(value: str) -> bool | None:
    """``--env-builds``: auto (None: only where the worker is not root), always, never."""
    choices = {"auto": None, "always": True, "never": False}
    if value not in choices:
        raise ConfigError(f"--env-builds {value!r}: expected auto, always or never")
    return choices[value]


def _worker_token(s: config.Resolved) -> str | None:
    """The configured token; else the worker token the local server saved for this
    machine's workers (pool default), never the admin's: a job must not act as the admin."""
    token = config.worker_token_for(s["server"], s)
    configured = bool(str(s["token"] or "").strip())
    if token and not configured and s["pool"] not in (None, "default"):
        raise ConfigError(
            f"--pool {s['pool']}: the worker token this machine's server saved is for pool "
            "'default'; make one for this pool (gpufleet tokens create --role worker --pool "
            f"{s['pool']} --name NAME) and give it as GPUFLEET_TOKEN"
        )
    if token is None and config.load_token(s["server"]):
        raise ConfigError(
            f"no worker token for {s['server']}: a worker does not run with the admin's "
            "token. Start the server on this machine again (it saves one for its local "
            "workers), or make one (gpufleet tokens create --role worker --name NAME) and "
            "give it as GPUFLEET_TOKEN"
        )
    return token


def _share_token() -> str:
    token = os.environ.get(SHARE_TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError(
            f"--share-token: set {SHARE_TOKEN_ENV} to a submitter token of this worker's pool "
            "(gpufleet tokens create --role submitter --pool POOL); tokens are never taken "
            "from the command line"
        )
    return tokens.clean(token, SHARE_TOKEN_ENV)


def capability(simulate_gpus: SimOpt = None) -> None:
    """Print what a worker on this machine would report, as JSON."""
    from gpufleet.worker.capability import capability_json

    cap = _detect(resolve(simulate_gpus=simulate_gpus)["simulate_gpus"])
    sys.stdout.write(json.dumps(capability_json(cap), indent=2) + "\n")


def _detect(simulate: str | None) -> Capability:
    """This machine as a worker sees it (or the GPUs ``--simulate-gpus`` names); what
    detection noticed on the way is said on stderr."""
    from gpufleet.worker.capability import detect

    notes: list[str] = []
    cap = detect(simulate=simulate, notes=notes)
    for note in notes:
        err.print(f"[yellow]note:[/yellow] {shown(note)}")
    return cap
