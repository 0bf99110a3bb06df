"""How the worker runs uv for a job's environment: what uv is given, and how its failures
read (gpufleet.worker.envbuild). The builds themselves: tests/integration/test_env_cache.py."""

from __future__ import annotations

from pathlib import Path

from gpufleet.worker.envbuild import (
    failure,
    index_args,
    parse_freeze,
    telling_line,
    uv_environment,
)
from gpufleet.worker.environments import EnvSettings

NO_SOLUTION = [
    "Using CPython 3.11.7",
    "  \u00d7 No solution found when resolving dependencies:",  # uv draws a cross
    "  ╰─▶ Because nosuchpkg was not found in the provided package locations and you "
    "require nosuchpkg, we can conclude that your requirements are unsatisfiable.",
]
NO_SOLUTION_PLAIN = [
    "error: No solution found when resolving dependencies",
    "  cause: Because nosuchpkg was not found in the package registry and you require "
    "nosuchpkg, we can conclude that your requirements are unsatisfiable.",
]
NETWORK = [
    "error: Failed to fetch: `https://pypi.org/simple/numpy/`",
    "  Caused by: Request failed after 3 retries",
    "  Caused by: error sending request for url (https://pypi.org/simple/numpy/)",
    "  Caused by: dns error: failed to lookup address information",
]


def test_a_requirement_that_cannot_be_met_fails_finally_with_uvs_explanation() -> None:
    for lines in (NO_SOLUTION, NO_SOLUTION_PLAIN):
        err = failure("resolve", lines)
        assert err.final and err.where == "resolve" and err.lines == lines
        assert err.message.startswith("uv failed resolving the environment: Because nosuchpkg")
        assert "\n" not in err.message


def test_a_network_failure_is_not_final_so_another_try_may_succeed() -> None:
    err = failure("install", NETWORK)
    assert not err.final
    assert err.message.endswith("Failed to fetch: `https://pypi.org/simple/numpy/`")
    assert not failure("resolve", [*NO_SOLUTION, "error: No space left on device"]).final


def test_the_telling_line_falls_back_to_the_last_line_uv_printed() -> None:
    assert telling_line(["resolving", "", "killed  "]) == "killed"
    assert telling_line([]) == "(uv said nothing)"


def test_uv_gets_the_workers_uv_settings_but_never_its_secrets_or_its_venv() -> None:
    base = {
        "PATH": "/usr/bin",
        "GPUFLEET_TOKEN": "secret",
        "VIRTUAL_ENV": "/opt/worker-venv",
        "UV_INDEX_URL": "http://stale",
    }
    env = uv_environment(base, {"UV_CACHE_DIR": "/cache"}, python_downloads=False)
    assert env["PATH"] == "/usr/bin" and env["UV_CACHE_DIR"] == "/cache"
    assert "GPUFLEET_TOKEN" not in env and "VIRTUAL_ENV" not in env
    assert "UV_INDEX_URL" not in env  # only the UV_* variables the settings pass
    assert env["UV_PYTHON_DOWNLOADS"] == "never" and env["UV_LINK_MODE"] == "copy"
    chosen = uv_environment(base, {"UV_LINK_MODE": "hardlink"}, python_downloads=True)
    assert chosen["UV_LINK_MODE"] == "hardlink" and chosen["UV_PYTHON_DOWNLOADS"] == "automatic"


def test_a_folder_of_wheels_is_the_whole_index_unless_an_index_is_named() -> None:
    assert index_args(["/wheels"], None) == ["--find-links", "/wheels", "--no-index"]
    # the index goes in uv's environment, never its command line (it may hold a password)
    assert index_args([], "http://user:pw@idx/simple") == []
    env = uv_environment({}, {}, False, "http://user:pw@idx/simple")
    assert env["UV_INDEX_URL"] == "http://user:pw@idx/simple"
    both = index_args(["/w"], "http://idx/simple")
    assert "--no-index" not in both and "/w" in both
    assert index_args([], None) == []


def test_source_builds_are_off_unless_allowed() -> None:
    assert uv_environment({}, {}, False, allow_builds=False)["UV_NO_BUILD"] == "1"
    assert "UV_NO_BUILD" not in uv_environment({}, {}, False, allow_builds=True)


def test_only_settings_that_change_what_uv_installs_enter_the_key() -> None:
    settings = EnvSettings(
        Path("/c"), 1, "uv", uv_env={"UV_CACHE_DIR": "/x", "UV_EXTRA_INDEX_URL": "http://e"}
    )
    assert settings.index_options()["env"] == {"UV_EXTRA_INDEX_URL": "http://e"}
    assert not settings.reads_public_index()
    assert EnvSettings(Path("/c"), 1, "uv", uv_env={"UV_CACHE_DIR": "/x"}).reads_public_index()


def test_freeze_lines_become_names_and_versions() -> None:
    text = "gfdemo==1.1\nlocal @ file:///wheels/local-1.0-py3-none-any.whl\n# note\n-e ./x\n"
    assert parse_freeze(text) == {
        "gfdemo": "1.1",
        "local": "file:///wheels/local-1.0-py3-none-any.whl",
    }
