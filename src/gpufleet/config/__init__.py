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

The package by concern:

- :mod:`~gpufleet.config.settings`: the table of settings (name, variable, default, kind,
  bounds);
- :mod:`~gpufleet.config.values`: what a value of each kind may be, and how it is shown;
- :mod:`~gpufleet.config.files`: where the config files are, reading them, writing a
  private file atomically;
- :mod:`~gpufleet.config.layers`: which layer's value wins (:func:`resolve`);
- :mod:`~gpufleet.config.credentials`: saved tokens, and which token a client or a worker
  uses.
"""

from __future__ import annotations

from gpufleet.config.credentials import (
    CLIENTS,
    WORKERS,
    credentials_path,
    load_token,
    load_worker_token,
    save_token,
    save_worker_token,
    token_for,
    worker_token_for,
)
from gpufleet.config.files import config_dir, config_files, write_file
from gpufleet.config.layers import Resolved, resolve
from gpufleet.config.settings import (
    APP,
    CREDENTIALS_NAME,
    ENV_CONFIG_DIR,
    ENV_ENVIRONMENT,
    ENV_PREFIX,
    ENVIRONMENTS_KEY,
    FILE_NAME,
    SETTINGS,
    Kind,
    Setting,
)
from gpufleet.config.values import normalize_url, parse_size, server_urls

__all__ = [
    "APP",
    "CLIENTS",
    "CREDENTIALS_NAME",
    "ENVIRONMENTS_KEY",
    "ENV_CONFIG_DIR",
    "ENV_ENVIRONMENT",
    "ENV_PREFIX",
    "FILE_NAME",
    "SETTINGS",
    "WORKERS",
    "Kind",
    "Resolved",
    "Setting",
    "config_dir",
    "config_files",
    "credentials_path",
    "load_token",
    "load_worker_token",
    "normalize_url",
    "parse_size",
    "resolve",
    "save_token",
    "save_worker_token",
    "server_urls",
    "token_for",
    "worker_token_for",
    "write_file",
]
