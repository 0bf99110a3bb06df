"""Layered configuration: cli > env > ./gpufleet.toml > user gpufleet.toml > default."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

import gpufleet.config
from gpufleet.config import SETTINGS, config_dir, config_files, resolve
from gpufleet.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture
def project(user_dir: Path) -> Path:
    return Path.cwd()


def write(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gpufleet.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- layers


def test_defaults_when_nothing_is_configured(project: Path) -> None:
    r = resolve()
    assert set(r.values) == set(SETTINGS)
    assert set(r.sources.values()) == {"default"}
    assert r["server"] == "http://127.0.0.1:8000"
    assert r["port"] == 8000
    assert r["lease_timeout"] == 120.0
    assert r["ephemeral"] is False
    assert r["token"] is None
    assert isinstance(r["data_dir"], Path)
    assert r["work_dir"].name == "work"


def test_each_layer_beats_the_one_below(
    user_dir: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = write(user_dir, 'port = 1001\nlease_timeout = 1\nheartbeat = 2.0\nlabels = "u=1"\n')
    cwd = write(project, "port = 1002\nlease_timeout = 3\nheartbeat = 4.0\n")
    monkeypatch.setenv("GPUFLEET_PORT", "1003")
    monkeypatch.setenv("GPUFLEET_LEASE_TIMEOUT", "5")

    r = resolve({"port": 1004, "heartbeat": None})  # None means "flag not given"

    assert (r["port"], r.sources["port"]) == (1004, "cli")
    assert (r["lease_timeout"], r.sources["lease_timeout"]) == (5.0, "env GPUFLEET_LEASE_TIMEOUT")
    assert (r["heartbeat"], r.sources["heartbeat"]) == (4.0, f"file {cwd}")
    assert (r["labels"], r.sources["labels"]) == ("u=1", f"file {user}")
    assert (r["pool"], r.sources["pool"]) == (None, "default")  # None: the token's pool


def test_config_files_lowest_first_and_deduplicated(user_dir: Path, project: Path) -> None:
    assert config_files() == []
    user = write(user_dir, "")
    cwd = write(project, "")
    assert config_dir() == user_dir
    assert config_files() == [user, cwd]
    assert config_files(cwd=user_dir) == [user]  # cwd is the config dir: read once


def test_explicit_env_mapping_is_used_instead_of_os_environ(tmp_path: Path, project: Path) -> None:
    other = tmp_path / "other"
    write(other, 'pool = "other"\n')
    r = resolve(env={"GPUFLEET_CONFIG_DIR": str(other), "GPUFLEET_SLOTS": "3"}, cwd=project)
    assert (r["pool"], r["slots"], r.sources["slots"]) == ("other", 3, "env GPUFLEET_SLOTS")


def test_empty_env_variable_counts_as_unset(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_PORT", "")
    assert resolve().sources["port"] == "default"


def test_only_resolves_and_computes_just_those(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom() -> str:
        raise AssertionError("default computed")

    monkeypatch.setattr(socket, "gethostname", boom)
    r = resolve(only=["port", "server"])
    assert list(r.values) == ["server", "port"]
    with pytest.raises(KeyError):
        r["name"]
    with pytest.raises(ConfigError, match='unknown setting "prot"'):
        resolve(only=["prot"])


def test_relative_path_in_file_resolves_against_the_file(project: Path) -> None:
    write(project, 'data_dir = "state"\nwork_dir = "/abs/work"\n')
    r = resolve()
    assert r["data_dir"] == project / "state"
    assert r["work_dir"] == Path("/abs/work")


# --------------------------------------------------------------------------- environments


def test_environment_table_overrides_its_file(
    user_dir: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = write(
        user_dir,
        'pool = "u"\ndrain_grace = 1\n[environments.gpu]\npool = "u-gpu"\ndrain_grace = 2\n',
    )
    cwd = write(
        project, 'pool = "c"\n[environments.gpu]\nslots = 4\n[environments.cpu]\nslots = 8\n'
    )

    r = resolve()
    assert (r["pool"], r["drain_grace"], r["slots"]) == ("c", 1.0, None)

    monkeypatch.setenv("GPUFLEET_ENV", "gpu")
    r = resolve()
    assert (r["drain_grace"], r.sources["drain_grace"]) == (2.0, f"file {user} [environments.gpu]")
    assert (r["slots"], r.sources["slots"]) == (4, f"file {cwd} [environments.gpu]")
    # each file's environment overrides that file only: the cwd top level still wins
    assert (r["pool"], r.sources["pool"]) == ("c", f"file {cwd}")


def test_unknown_environment_is_an_error(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(project, "[environments.gpu]\nslots = 4\n")
    monkeypatch.setenv("GPUFLEET_ENV", "staging")
    with pytest.raises(ConfigError, match=r'GPUFLEET_ENV="staging".*\[environments\.staging\]'):
        resolve()


# --------------------------------------------------------------------------- bad values


def test_unknown_key_in_file_suggests_the_setting(project: Path) -> None:
    path = write(project, "lease_timout = 5\n")
    with pytest.raises(ConfigError) as info:
        resolve()
    assert (
        str(info.value) == f'{path}: unknown setting "lease_timout" (did you mean "lease_timeout"?)'
    )


def test_unknown_key_in_environment_table(project: Path) -> None:
    path = write(project, "[environments.gpu]\nslotz = 4\n")
    with pytest.raises(ConfigError) as info:
        resolve()
    assert str(info.value).startswith(f'{path} [environments.gpu]: unknown setting "slotz"')


def test_invalid_toml_names_the_file(project: Path) -> None:
    path = write(project, "port = = 3\n")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}: invalid TOML")):
        resolve()


def test_bad_int_from_env_names_the_variable(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_PORT", "abc")
    with pytest.raises(ConfigError) as info:
        resolve()
    assert str(info.value) == 'GPUFLEET_PORT="abc" (env GPUFLEET_PORT): port must be an integer'


def test_bad_value_in_file_names_the_file(project: Path) -> None:
    path = write(project, 'slots = "many"\n')
    with pytest.raises(ConfigError) as info:
        resolve()
    assert str(info.value) == f'slots="many" (file {path}): slots must be an integer'


@pytest.mark.parametrize(
    ("env", "cli", "toml", "expected"),
    [
        (
            {"GPUFLEET_LEASE_TIMEOUT": "0.01"},
            {},
            "",
            "(env GPUFLEET_LEASE_TIMEOUT): lease_timeout must be at least 0.1",
        ),
        ({}, {"heartbeat": 0.01}, "", "(cli): heartbeat must be at least 0.05"),
        ({}, {}, "slots = -1\n", "slots must be at least 0"),
        ({"GPUFLEET_PORT": "70000"}, {}, "", "port must be at most 65535"),
    ],
)
def test_value_out_of_bounds(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    cli: dict[str, object],
    toml: str,
    expected: str,
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    write(project, toml)
    with pytest.raises(ConfigError) as info:
        resolve(cli)
    assert str(info.value).endswith(expected)


def test_zero_port_is_allowed(project: Path) -> None:
    assert resolve({"port": 0})["port"] == 0


@pytest.mark.parametrize("value", [True, 80.5, [1]])
def test_cli_values_are_type_checked(project: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"\(cli\): port must be an integer"):
        resolve({"port": value})


def test_cli_strings_are_parsed_like_env(project: Path) -> None:
    r = resolve({"port": "8080", "ephemeral": "yes", "data_dir": "d"})
    assert (r["port"], r["ephemeral"], r["data_dir"]) == (8080, True, project / "d")


def test_unknown_cli_key(project: Path) -> None:
    with pytest.raises(ConfigError, match='did you mean "lease_timeout"'):
        resolve({"lease_timeot": 3})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF", False),
    ],
)
def test_bool_parsing(
    project: Path, monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool
) -> None:
    monkeypatch.setenv("GPUFLEET_EPHEMERAL", raw)
    assert resolve()["ephemeral"] is expected


def test_bool_rejects_other_words(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_EPHEMERAL", "maybe")
    with pytest.raises(ConfigError, match=r"GPUFLEET_EPHEMERAL.*ephemeral must be a boolean"):
        resolve()


def test_bool_from_toml(project: Path) -> None:
    write(project, "ephemeral = true\n")
    assert resolve()["ephemeral"] is True


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("http://gpu-box:8000/", "http://gpu-box:8000"),
        ("https://fleet.example.com//", "https://fleet.example.com"),
        ("https://fleet.example.com/api/", "https://fleet.example.com/api"),
    ],
)
def test_url_trailing_slash_is_stripped(
    project: Path, monkeypatch: pytest.MonkeyPatch, raw: str, expected: str
) -> None:
    monkeypatch.setenv("GPUFLEET_SERVER", raw)
    assert resolve()["server"] == expected


@pytest.mark.parametrize("raw", ["gpu-box:8000", "ftp://gpu-box", "http://", "127.0.0.1"])
def test_url_must_be_http(project: Path, monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("GPUFLEET_SERVER", raw)
    with pytest.raises(ConfigError, match="server must be a URL starting with http:// or https://"):
        resolve()


# --------------------------------------------------------------------------- rows


def test_rows_mask_secrets(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = {name: (shown, source) for name, shown, source in resolve().rows()}
    assert rows["token"] == ("(unset)", "default")
    assert rows["port"] == ("8000", "default")
    assert rows["ephemeral"] == ("false", "default")

    monkeypatch.setenv("GPUFLEET_TOKEN", "s3cret")
    rows = {name: (shown, source) for name, shown, source in resolve().rows()}
    assert rows["token"] == ("****", "env GPUFLEET_TOKEN")
    assert all("s3cret" not in shown for shown, _ in rows.values())


def test_rows_follow_settings_order(project: Path) -> None:
    assert [name for name, _, _ in resolve().rows()] == list(SETTINGS)


# --------------------------------------------------------------------------- package

#: What callers imported from gpufleet/config.py before it became a package.
PUBLIC = {
    "APP", "CLIENTS", "CREDENTIALS_NAME", "ENVIRONMENTS_KEY", "ENV_CONFIG_DIR",
    "ENV_ENVIRONMENT", "ENV_PREFIX", "FILE_NAME", "SETTINGS", "WORKERS", "Kind", "Resolved",
    "Setting", "config_dir", "config_files", "credentials_path", "load_token",
    "load_worker_token", "normalize_url", "parse_size", "resolve", "save_token",
    "save_worker_token", "server_urls", "token_for", "worker_token_for", "write_file",
}  # fmt: skip


def test_the_package_exports_each_concerns_public_names() -> None:
    """``gpufleet.config`` stays the front door: every name callers imported from the old
    module is there, and is the same object as in the module of its concern."""
    from gpufleet.config import credentials, files, layers, settings, values

    assert set(gpufleet.config.__all__) == PUBLIC
    modules = (credentials, files, layers, settings, values)
    for name in PUBLIC:
        exported = getattr(gpufleet.config, name)
        assert any(getattr(m, name, None) is exported for m in modules), name
