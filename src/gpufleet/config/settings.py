"""Every setting gpufleet reads: its name, ``GPUFLEET_*`` variable, default, kind and
bounds, in the order ``config show`` and the CLI reference list them.

The table says what a setting is; :mod:`gpufleet.config.values` says what a value of each
kind may be, and :mod:`gpufleet.config.layers` where a value comes from.
"""

from __future__ import annotations

import difflib
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import platformdirs

from gpufleet.errors import ConfigError

Kind = Literal["str", "int", "float", "bool", "path", "url", "size"]

APP = "gpufleet"
FILE_NAME = "gpufleet.toml"
CREDENTIALS_NAME = "credentials.json"
ENV_PREFIX = "GPUFLEET_"
ENV_CONFIG_DIR = "GPUFLEET_CONFIG_DIR"
ENV_ENVIRONMENT = "GPUFLEET_ENV"
ENVIRONMENTS_KEY = "environments"


@dataclass(frozen=True)
class Setting:
    """One configuration setting: its name, env variable, default, kind and bounds."""

    name: str
    env: str
    default: Any  # a value, or a zero-argument callable computed lazily
    kind: Kind
    help: str
    secret: bool = False
    minimum: float | None = None
    maximum: float | None = None

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default


def _hostname() -> str:
    return socket.gethostname()


def _data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP))


def _work_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP)) / "work"


def _cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP)) / "blobs"


def _env_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP)) / "environments"


def _setting(
    name: str,
    default: Any,
    kind: Kind,
    help: str,
    *,
    secret: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Setting:
    env = ENV_PREFIX + name.upper()
    return Setting(name, env, default, kind, help, secret, minimum, maximum)


#: Where clients and workers find the server, and which CA they trust.
_CONNECTION: tuple[Setting, ...] = (
    _setting(
        "server",
        "http://127.0.0.1:8000",
        "url",
        "server clients and workers talk to; several of one database as URL1,URL2 (a "
        "call goes to the next when one cannot be reached)",
    ),
    _setting(
        "ca",
        None,
        "path",
        "PEM file of the CA certificates to trust for an https:// server, instead of "
        "the default public CAs",
    ),
)

#: What `gpufleet server` binds, stores and allows.
_SERVER: tuple[Setting, ...] = (
    _setting("host", "127.0.0.1", "str", "address `gpufleet server` binds"),
    _setting(
        "port",
        8000,
        "int",
        "port `gpufleet server` binds (0 = any free port)",
        minimum=0,
        maximum=65535,
    ),
    _setting("data_dir", _data_dir, "path", "where the server keeps its data"),
    _setting("db", None, "str", "database URL (default: SQLite in data_dir)"),
    _setting(
        "tls_cert",
        None,
        "path",
        "PEM certificate (chain) `gpufleet server` serves HTTPS with; needs tls_key",
    ),
    _setting("tls_key", None, "path", "PEM private key (unencrypted) of tls_cert"),
    _setting(
        "blob_store",
        None,
        "str",
        "where blobs live: s3://BUCKET/PREFIX for an S3-compatible object store shared "
        "by several servers (credentials from AWS_* or ~/.aws; needs gpufleet[s3]); "
        "default: data_dir/blobs",
    ),
    _setting(
        "s3_endpoint",
        None,
        "url",
        "URL of an S3-compatible server (MinIO, Ceph) for blob_store; default: AWS",
    ),
    _setting(
        "max_blob_size",
        64 << 30,
        "size",
        "largest blob (package or artifact) the server accepts, e.g. 64G",
        minimum=1,
    ),
    _setting(
        "metrics_public",
        False,
        "bool",
        "`gpufleet server` answers /metrics without a token (else an operator's or admin's)",
    ),
    _setting(
        "trusted_proxies",
        None,
        "str",
        "reverse proxies (addresses or networks, comma-separated, e.g. 127.0.0.1) whose "
        "X-Forwarded-For `gpufleet server` believes and whose connections it does not "
        "count per address; none by default",
    ),
    _setting(
        "webhook_allow",
        None,
        "str",
        "destinations webhooks may reach besides public addresses (host names, addresses "
        "or networks, comma-separated, e.g. 127.0.0.1 or 10.0.0.0/8); loopback, private "
        "networks, link-local and cloud metadata addresses are refused unless named here",
    ),
    _setting(
        "api_docs",
        False,
        "bool",
        "`gpufleet server` serves the API browser at /docs and /redoc (Swagger UI and "
        "ReDoc, whose pages load their scripts from a CDN); /openapi.json is always served",
    ),
    _setting(
        "access_log",
        False,
        "bool",
        "`gpufleet server` logs every request: client, method, path, status, latency "
        "and request id",
    ),
    _setting(
        "lease_timeout",
        120.0,
        "float",
        "seconds a worker's lease lives without a heartbeat",
        minimum=0.1,
    ),
    _setting(
        "prefer_cuda_grace",
        300.0,
        "float",
        "seconds a job preferring CUDA waits for a GPU before taking any slot",
        minimum=0,
    ),
    _setting(
        "retry_backoff",
        10.0,
        "float",
        "base seconds of the exponential backoff between attempts",
        minimum=0,
    ),
    _setting(
        "max_losses",
        10,
        "int",
        "attempts a job may lose to its machines (worker lost, drained) before it fails; "
        "they do not count against its max_attempts",
        minimum=1,
    ),
    _setting(
        "sharing",
        None,
        "path",
        "the sharing rules (fair share, caps, preemption, webhooks): a TOML file, read "
        "again when it changes (default: sharing.toml in data_dir, if there is one)",
    ),
    _setting(
        "checkpoint_keep",
        3,
        "int",
        "checkpoint snapshots kept of each job (its newest)",
        minimum=1,
    ),
    _setting(
        "ephemeral_ttl",
        3600.0,
        "float",
        "seconds an offline ephemeral worker is kept before the server forgets it",
        minimum=0,
    ),
    _setting(
        "log_retention",
        30.0,
        "float",
        "days a finished job's output lines are kept (0: forever); the job, its history "
        "and its artifact stay",
        minimum=0,
    ),
    _setting(
        "audit_retention",
        90.0,
        "float",
        "days an audit record is kept (0: forever)",
        minimum=0,
    ),
    _setting(
        "output_quota",
        1 << 30,
        "size",
        "most bytes of output (stdout and stderr) the server stores of one attempt of a "
        "job, e.g. 1G; past it the rest is dropped, with a marker in its log (each line "
        "counts its bytes, a newline and 64 for its row)",
        minimum=1024,
    ),
    _setting(
        "output_rate",
        1 << 20,
        "size",
        "bytes a second of an attempt's output the server stores, e.g. 1M, on average since it "
        "was claimed (output_burst ahead of it); past it output is dropped until half the "
        "burst is back",
        minimum=1,
    ),
    _setting(
        "output_burst",
        64 << 20,
        "size",
        "bytes of output an attempt may send ahead of output_rate",
        minimum=1024,
    ),
)

#: What `gpufleet worker` offers, where it keeps things and how it runs jobs.
_WORKER: tuple[Setting, ...] = (
    _setting("name", _hostname, "str", "worker name (default: hostname)"),
    _setting("labels", "", "str", "worker labels, k=v,k=v"),
    _setting("slots", None, "int", "worker CPU slots (default: 1)", minimum=0),
    _setting("heartbeat", 30.0, "float", "seconds between worker heartbeats", minimum=0.05),
    _setting("ephemeral", False, "bool", "worker exits after running one job"),
    _setting("simulate_gpus", None, "str", "pretend this worker has these GPUs"),
    _setting("work_dir", _work_dir, "path", "where jobs run"),
    _setting(
        "drain_grace",
        60.0,
        "float",
        "seconds a draining worker lets running jobs finish",
        minimum=0,
    ),
    _setting("pool", None, "str", "pool (default: the token's pool, else 'default')"),
    _setting("cache_dir", _cache_dir, "path", "where a worker caches packages by hash"),
    _setting(
        "cache_size",
        50 << 30,
        "size",
        "most bytes the worker's package cache keeps, e.g. 50G",
        minimum=0,
    ),
    _setting(
        "env_cache_dir",
        _env_cache_dir,
        "path",
        "where a worker keeps the Python environments it builds for jobs (uv)",
    ),
    _setting(
        "env_cache_size",
        20 << 30,
        "size",
        "most bytes of built environments a worker keeps; the least recently used one "
        "no job is using goes first",
        minimum=0,
    ),
    _setting(
        "env_find_links",
        "",
        "str",
        "folders (or URLs) of wheels uv installs jobs' environments from, comma-"
        "separated; with one set, no index is contacted",
    ),
    _setting(
        "env_index_url",
        None,
        "str",
        "the package index uv builds jobs' environments from (a lab's own mirror) instead of PyPI",
    ),
    _setting(
        "env_build_timeout",
        1800.0,
        "float",
        "seconds an environment's build may take (apart from the job's own timeout)",
        minimum=1,
    ),
    _setting(
        "env_python_downloads",
        False,
        "bool",
        "let uv download a Python a job asks for that this machine lacks",
    ),
    _setting(
        "env_builds",
        "auto",
        "str",
        "whether uv may build a source distribution for a job's environment (its own "
        "code runs, as the worker): auto (only where the worker is not root), always, "
        "never",
    ),
    _setting(
        "env_torch_backend",
        "auto",
        "str",
        "the torch build for environments that name torch: auto (the one this "
        "machine's CUDA driver runs, or cpu), none (uv's default), or cpu, cu126, ...",
    ),
    _setting(
        "log_backlog",
        256 << 20,
        "size",
        "most bytes of a job's output a worker keeps on disk while the server is away; "
        "past it the oldest lines are dropped, and the log says so",
        minimum=1 << 20,
    ),
    _setting(
        "work_dir_retention",
        24.0,
        "float",
        "hours a finished job's work dir stays on the worker (0: forever)",
        minimum=0,
    ),
    _setting(
        "mount",
        "",
        "str",
        "shared paths this worker can read, comma-separated; inputs under them are "
        "passed by reference",
    ),
    _setting(
        "owner_policy",
        None,
        "path",
        "the workstation owner's policy (a TOML file): GPUs the owner's processes use, "
        "idle time, hours and battery decide when this worker takes jobs and makes way "
        "(see docs/sharing.md)",
    ),
    _setting(
        "run_as",
        "",
        "str",
        "Unix users a worker runs jobs as, USER,USER,... (one per running job, so give "
        "one per CPU slot and GPU); the worker must run as root. Recommended for a worker "
        "that runs other people's jobs",
    ),
)

#: The bearer token of a client or a worker.
_CREDENTIAL: tuple[Setting, ...] = (_setting("token", None, "str", "bearer token", secret=True),)

#: Every setting by name, in the order `config show` and the CLI reference list them.
SETTINGS: dict[str, Setting] = {s.name: s for s in (*_CONNECTION, *_SERVER, *_WORKER, *_CREDENTIAL)}


def unknown(where: str, key: str) -> ConfigError:
    """The error for a key that names no setting, with the closest setting as a hint."""
    close = difflib.get_close_matches(key, list(SETTINGS), n=1)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    return ConfigError(f'{where}: unknown setting "{key}"{hint}')
