"""Bearer tokens kept on this machine, and which token a client or a worker uses.

``credentials.json`` in the config dir (``GPUFLEET_CONFIG_DIR`` or the user config dir)
holds two tables of tokens by server URL: ``servers``, the CLI's (the admin's or a
logged-in user's), and ``workers``, the worker token the local server made for this
machine's workers. The file is written atomically and is 0600 from its creation; its
directory is made 0700.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpufleet import tokens
from gpufleet.config.files import config_dir, write_file
from gpufleet.config.layers import Resolved
from gpufleet.config.settings import CREDENTIALS_NAME
from gpufleet.config.values import Invalid, normalize_url, parse_url, server_urls
from gpufleet.errors import ConfigError

#: credentials.json's tables: the admin's (or a logged-in user's) token per server URL,
#: and the worker token the local server made for this machine's workers.
CLIENTS, WORKERS = "servers", "workers"


def credentials_path() -> Path:
    """Where the saved tokens are: ``credentials.json`` in the config dir."""
    return config_dir() / CREDENTIALS_NAME


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


def save_token(server: str, token: str) -> Path:
    """Store ``token`` for ``server`` in ``credentials.json``, keeping other servers' tokens."""
    return _save(server, token, CLIENTS)


def save_worker_token(server: str, token: str) -> Path:
    """Store the worker token the server at ``server`` made for this machine's workers
    (``gpufleet worker`` takes it when no token is configured), beside the CLI's tokens."""
    return _save(server, token, WORKERS)


def _saved_tables(path: Path) -> dict[str, dict[str, str]]:
    """Both tables of the file at ``path``, or just an empty ``servers`` if there is none;
    a ConfigError saying what to do if it cannot be read."""
    if not path.exists():
        return {CLIENTS: {}}
    try:
        return {name: _read_credentials(path, name) for name in (CLIENTS, WORKERS)}
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{path}: cannot read credentials ({exc}); fix or delete it and log in again"
        ) from exc


def _save(server: str, token: str, table: str) -> Path:
    try:
        key = parse_url(server, Path())
    except Invalid as exc:
        raise ConfigError(f"save_token: server {json.dumps(server)} {exc}") from None
    if not token:
        raise ConfigError(f"save_token: empty token for {key}")
    path = credentials_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tables = _saved_tables(path)
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


def _configured(resolved: Resolved) -> str | None:
    """The token set in the environment or a config file, cleaned (naming where it came
    from), or ``None`` when none is set."""
    token = resolved.values.get("token")
    if isinstance(token, str) and token.strip():
        where = resolved.sources.get("token", "the token").removeprefix("env ")
        return tokens.clean(token, where)
    return None


def token_for(server: str, resolved: Resolved) -> str | None:
    """The configured token (env or file) if set, else the one saved for ``server``;
    surrounding whitespace dropped, whitespace inside refused (naming where it came from)."""
    configured = _configured(resolved)
    return configured if configured is not None else load_token(server)


def worker_token_for(server: str, resolved: Resolved) -> str | None:
    """A worker's token: the configured one (env or file) if set, else the worker token
    the local server saved for ``server``. Never the admin's saved token: a job on this
    machine must not be able to act as the admin through its worker."""
    configured = _configured(resolved)
    return configured if configured is not None else load_worker_token(server)
