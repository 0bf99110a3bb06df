"""Layered configuration for the server, the worker and the client.

Precedence, highest first::

    CLI flag > environment (GPUFLEET_*) > ./gpufleet.toml > <user config dir>/gpufleet.toml
             > default

Both config files are read when present; the one in the current directory wins per key.
In a file, top-level keys are settings and ``[environments.NAME]`` tables override that
file's top level when ``GPUFLEET_ENV=NAME``. ``GPUFLEET_CONFIG_DIR`` replaces the user
config dir, which also holds ``credentials.json`` (bearer tokens per server URL: the
CLI's, and the worker token the local server made for this machine's workers).

Every bad value raises :class:`~gpufleet.errors.ConfigError` naming the setting and where
the value came from.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import socket
import tempfile
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple
from urllib.parse import urlsplit

import platformdirs

from gpufleet import tokens
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


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
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
            "the package index uv builds jobs' environments from (a lab's own mirror) "
            "instead of PyPI",
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
            "run_as",
            "",
            "str",
            "Unix users a worker runs jobs as, USER,USER,... (one per running job, so give "
            "one per CPU slot and GPU); the worker must run as root. Recommended for a worker "
            "that runs other people's jobs",
        ),
        _setting("token", None, "str", "bearer token", secret=True),
    )
}


# --------------------------------------------------------------------------- files


def _config_dir(env: Mapping[str, str]) -> Path:
    override = env.get(ENV_CONFIG_DIR, "")
    return Path(override).expanduser() if override else Path(platformdirs.user_config_dir(APP))


def config_dir() -> Path:
    """``$GPUFLEET_CONFIG_DIR`` if set, else the platform's user config dir for gpufleet."""
    return _config_dir(os.environ)


def config_files(cwd: Path | None = None, *, env: Mapping[str, str] | None = None) -> list[Path]:
    """The config files that exist, lowest precedence first (user dir, then ``cwd``)."""
    env = os.environ if env is None else env
    candidates = [_config_dir(env) / FILE_NAME, (cwd or Path.cwd()) / FILE_NAME]
    found: list[Path] = []
    for path in candidates:
        path = path.absolute()
        if path.is_file() and not any(path.samefile(seen) for seen in found):
            found.append(path)
    return found


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc


def _unknown(where: str, key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(SETTINGS), n=1)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    return ConfigError(f'{where}: unknown setting "{key}"{hint}')


# --------------------------------------------------------------------------- layers


class _Raw(NamedTuple):
    label: str  # how the user wrote it: GPUFLEET_PORT, port, --port
    value: Any


class _Layer(NamedTuple):
    source: str  # "default" | "file /p" | "file /p [environments.N]" | "env X" | "cli"
    raw: dict[str, _Raw]
    base: Path  # relative paths are resolved against this directory


def _table_layer(source: str, where: str, table: Mapping[str, Any], base: Path) -> _Layer:
    raw: dict[str, _Raw] = {}
    for key, value in table.items():
        if key not in SETTINGS:
            raise _unknown(where, key)
        raw[key] = _Raw(key, value)
    return _Layer(source, raw, base)


def _environments(path: Path, data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    envs = data.get(ENVIRONMENTS_KEY, {})
    if not isinstance(envs, dict):
        raise ConfigError(f"{path}: [{ENVIRONMENTS_KEY}] must be a table of tables")
    for name, table in envs.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{ENVIRONMENTS_KEY}.{name}] must be a table")
    return envs


def _file_layers(path: Path, environment: str) -> tuple[list[_Layer], bool]:
    """The file's top level and, if it defines it, its ``[environments.<environment>]``."""
    data = _read_toml(path)
    envs = _environments(path, data)
    top = {k: v for k, v in data.items() if k != ENVIRONMENTS_KEY}
    layers = [_table_layer(f"file {path}", str(path), top, path.parent)]
    for name, table in envs.items():  # validate every environment's keys, use one
        where = f"{path} [{ENVIRONMENTS_KEY}.{name}]"
        layer = _table_layer(f"file {where}", where, table, path.parent)
        if name == environment:
            layers.append(layer)
    return layers, environment in envs


def _files_layers(files: list[Path], environment: str) -> list[_Layer]:
    layers: list[_Layer] = []
    defined = False
    for path in files:
        file_layers, has_env = _file_layers(path, environment)
        layers.extend(file_layers)
        defined = defined or has_env
    if environment and not defined:
        read = ", ".join(str(p) for p in files) or "none found"
        raise ConfigError(
            f'{ENV_ENVIRONMENT}="{environment}": no config file defines '
            f"[{ENVIRONMENTS_KEY}.{environment}] (files read: {read})"
        )
    return layers


def _env_layers(env: Mapping[str, str], names: Iterable[str], cwd: Path) -> list[_Layer]:
    """One layer per variable, so each value reports its own variable as source."""
    layers = []
    for name in names:
        var = SETTINGS[name].env
        value = env.get(var, "")
        if value != "":  # an empty variable counts as unset
            layers.append(_Layer(f"env {var}", {name: _Raw(var, value)}, cwd))
    return layers


def _cli_layer(cli: Mapping[str, Any], cwd: Path) -> _Layer:
    raw: dict[str, _Raw] = {}
    for name, value in cli.items():
        if name not in SETTINGS:
            raise _unknown("command line", name)
        if value is not None:
            raw[name] = _Raw("--" + name.replace("_", "-"), value)
    return _Layer("cli", raw, cwd)


# --------------------------------------------------------------------------- parsing


class _Invalid(ValueError):
    """A value that does not fit its kind; the message ends 'must be ...'."""


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_str(value: Any, base: Path) -> str:
    if not isinstance(value, str):
        raise _Invalid("must be a string")
    return value


def _parse_int(value: Any, base: Path) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _Invalid("must be an integer")


def _parse_float(value: Any, base: Path) -> float:
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise _Invalid("must be a number")
    return number


def _parse_bool(value: Any, base: Path) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    raise _Invalid("must be a boolean (1/0, true/false, yes/no, on/off)")


def _parse_path(value: Any, base: Path) -> Path:
    if not isinstance(value, str | os.PathLike) or str(value) == "":
        raise _Invalid("must be a path")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def normalize_url(value: str) -> str:
    """Strip surrounding whitespace and trailing slashes (the key of a server URL)."""
    return value.strip().rstrip("/")


def server_urls(value: str) -> list[str]:
    """The URLs of ``URL1,URL2`` (servers sharing one database), each normalized; empty
    parts and repeats dropped."""
    return list(dict.fromkeys(u for u in map(normalize_url, value.split(",")) if u))


def _parse_url(value: Any, base: Path) -> str:
    """A URL, or several comma-separated (servers sharing one database)."""
    if isinstance(value, str):
        urls = [normalize_url(u) for u in value.split(",")]
        if all(u.lower().startswith(("http://", "https://")) and urlsplit(u).netloc for u in urls):
            return ",".join(urls)
    raise _Invalid("must be a URL starting with http:// or https:// (or several, URL1,URL2)")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """Bytes from ``1024``, ``512M``, ``20G``, ``1.5TiB`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        number = text[: len(text) - len(unit)].strip()
        try:
            size = float(number) * _UNITS[unit]
        except ValueError:
            size = math.nan
        if math.isfinite(size) and size >= 0:
            return int(size)
    raise _Invalid("must be a size such as 1024, 512M, 20G or 1T")


def _parse_size(value: Any, base: Path) -> int:
    return parse_size(value)


_PARSERS: dict[str, Callable[[Any, Path], Any]] = {
    "str": _parse_str,
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "path": _parse_path,
    "url": _parse_url,
    "size": _parse_size,
}


def _check_bounds(setting: Setting, value: float) -> None:
    if setting.minimum is not None and value < setting.minimum:
        raise _Invalid(f"must be at least {setting.minimum:g}")
    if setting.maximum is not None and value > setting.maximum:
        raise _Invalid(f"must be at most {setting.maximum:g}")


def _shown(setting: Setting, value: Any) -> str:
    if setting.secret:
        return '"****"'
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _parse(setting: Setting, raw: _Raw, source: str, base: Path) -> Any:
    try:
        value = _PARSERS[setting.kind](raw.value, base)
        if setting.kind in ("int", "float", "size"):
            _check_bounds(setting, value)
    except _Invalid as exc:
        shown = _shown(setting, raw.value)
        raise ConfigError(
            f"{raw.label}={shown} ({source}): {setting.name} {exc}",
            detail={"setting": setting.name, "source": source},
        ) from None
    return value


# --------------------------------------------------------------------------- resolve


@dataclass(frozen=True)
class Resolved:
    """The resolved values of some settings, and where each one came from."""

    values: dict[str, Any]
    sources: dict[str, str]

    def __getitem__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"setting {name!r} was not resolved") from None

    def rows(self) -> list[tuple[str, str, str]]:
        """``(name, shown value, source)`` per setting, secrets masked, for ``config show``."""
        return [
            (name, _display(SETTINGS[name], v), self.sources[name])
            for name, v in self.values.items()
        ]


def _display(setting: Setting, value: Any) -> str:
    if value is None:
        return "(unset)"
    if setting.secret:
        return "****"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def _selected(only: Iterable[str] | None) -> list[str]:
    if only is None:
        return list(SETTINGS)
    wanted = set(only)
    for name in wanted:
        if name not in SETTINGS:
            raise _unknown("resolve(only=...)", name)
    return [name for name in SETTINGS if name in wanted]


def resolve(
    cli: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    only: Iterable[str] | None = None,
) -> Resolved:
    """Resolve settings: cli (``None`` = not given) > env > cwd file > user file > default.

    Every value given in any layer is parsed and checked, even if a higher layer wins.
    Relative paths resolve against the config file's directory, or ``cwd`` for env and cli.
    """
    env = os.environ if env is None else env
    cwd = (cwd or Path.cwd()).absolute()
    names = _selected(only)
    environment = env.get(ENV_ENVIRONMENT, "")
    layers = _files_layers(config_files(cwd, env=env), environment)
    layers += _env_layers(env, names, cwd)
    layers.append(_cli_layer(cli or {}, cwd))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        values[name], sources[name] = SETTINGS[name].default_value(), "default"
        for layer in layers:  # lowest precedence first: the last one given wins
            if name in layer.raw:
                values[name] = _parse(SETTINGS[name], layer.raw[name], layer.source, layer.base)
                sources[name] = layer.source
    return Resolved(values, sources)


# --------------------------------------------------------------------------- tokens


def credentials_path() -> Path:
    return config_dir() / CREDENTIALS_NAME


#: credentials.json's tables: the admin's (or a logged-in user's) token per server URL,
#: and the worker token the local server made for this machine's workers.
CLIENTS, WORKERS = "servers", "workers"


def _read_credentials(path: Path, table: str = CLIENTS) -> dict[str, str]:
    """One table of the file (``servers``: the CLI's tokens; ``workers``: the local
    workers'); raises OSError or ValueError when the file is missing or malformed."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get(CLIENTS), dict):
        raise ValueError("no servers table")
    found = data.get(table, {})
    if not isinstance(found, dict):
        raise ValueError(f"no {table} table")
    return {normalize_url(k): v for k, v in found.items() if isinstance(v, str)}


def write_file(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same dir (0600 from its
    creation, so a secret is never readable by others), given ``mode``, then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if hasattr(os, "fchmod"):  # Windows has ACLs instead
                os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_token(server: str, token: str) -> Path:
    """Store ``token`` for ``server`` in ``credentials.json``, keeping other servers' tokens."""
    return _save(server, token, CLIENTS)


def save_worker_token(server: str, token: str) -> Path:
    """Store the worker token the server at ``server`` made for this machine's workers
    (``gpufleet worker`` takes it when no token is configured), beside the CLI's tokens."""
    return _save(server, token, WORKERS)


def _save(server: str, token: str, table: str) -> Path:
    try:
        key = _parse_url(server, Path())
    except _Invalid as exc:
        raise ConfigError(f"save_token: server {json.dumps(server)} {exc}") from None
    if not token:
        raise ConfigError(f"save_token: empty token for {key}")
    path = credentials_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tables: dict[str, dict[str, str]] = {CLIENTS: {}}
    if path.exists():
        try:
            tables = {name: _read_credentials(path, name) for name in (CLIENTS, WORKERS)}
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{path}: cannot read credentials ({exc}); fix or delete it and log in again"
            ) from exc
    tables.setdefault(table, {})[key] = token
    kept = {name: found for name, found in tables.items() if found or name == CLIENTS}
    write_file(path, json.dumps(kept, indent=2, sort_keys=True) + "\n")
    return path


def load_token(server: str) -> str | None:
    """The token saved for ``server`` (trailing slashes ignored), or ``None``. For
    several servers (``URL1,URL2``), the first saved for any of them."""
    return _load(server, CLIENTS)


def load_worker_token(server: str) -> str | None:
    """The worker token the local server saved for ``server``'s workers, or ``None``."""
    return _load(server, WORKERS)


def _load(server: str, table: str) -> str | None:
    path = credentials_path()
    try:
        found = _read_credentials(path, table)
    except (OSError, ValueError):
        return None
    for url in server_urls(server):
        token = found.get(url)
        if token:
            return tokens.clean(token, f"{path} (for {url})")
    return None


def token_for(server: str, resolved: Resolved) -> str | None:
    """The configured token (env or file) if set, else the one saved for ``server``;
    surrounding whitespace dropped, whitespace inside refused (naming where it came from)."""
    token = resolved.values.get("token")
    if isinstance(token, str) and token.strip():
        where = resolved.sources.get("token", "the token").removeprefix("env ")
        return tokens.clean(token, where)
    return load_token(server)


def worker_token_for(server: str, resolved: Resolved) -> str | None:
    """A worker's token: the configured one (env or file) if set, else the worker token
    the local server saved for ``server``. Never the admin's saved token: a job on this
    machine must not be able to act as the admin through its worker."""
    token = resolved.values.get("token")
    if isinstance(token, str) and token.strip():
        where = resolved.sources.get("token", "the token").removeprefix("env ")
        return tokens.clean(token, where)
    return load_worker_token(server)
