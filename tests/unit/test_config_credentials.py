"""Saved tokens (credentials.json: its tables, its file modes) and which token a client
or a worker uses: the configured one, else the one saved for the server."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from gpufleet.config import load_token, resolve, save_token, token_for
from gpufleet.errors import ConfigError

pytestmark = pytest.mark.unit


def test_save_and_load_token_roundtrip(user_dir: Path) -> None:
    path = save_token("http://a:8000/", "tok-a")
    save_token("https://b.example.com", "tok-b")

    assert path == user_dir / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(user_dir.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {
        "servers": {"http://a:8000": "tok-a", "https://b.example.com": "tok-b"}
    }
    assert load_token("http://a:8000") == "tok-a"
    assert load_token("https://b.example.com/") == "tok-b"
    assert load_token("http://c:8000") is None
    assert [p.name for p in user_dir.iterdir()] == ["credentials.json"]  # no temp file left


def test_save_token_replaces_a_servers_token(user_dir: Path) -> None:
    save_token("http://a:8000", "old")
    path = save_token("http://a:8000", "new")
    assert load_token("http://a:8000/") == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_token_missing_or_unreadable(user_dir: Path) -> None:
    assert load_token("http://a:8000") is None
    user_dir.mkdir()
    (user_dir / "credentials.json").write_text("{not json")
    assert load_token("http://a:8000") is None
    with pytest.raises(ConfigError, match=r"credentials\.json"):
        save_token("http://a:8000", "tok")  # never silently drops other servers' tokens


def test_save_token_rejects_a_bad_server(user_dir: Path) -> None:
    with pytest.raises(ConfigError, match="must be a URL"):
        save_token("gpu-box:8000", "tok")


def test_token_for_prefers_the_configured_token(
    user_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_token("http://a:8000", "saved")
    assert token_for("http://a:8000", resolve()) == "saved"
    monkeypatch.setenv("GPUFLEET_TOKEN", "from-env")
    assert token_for("http://a:8000", resolve()) == "from-env"
    assert token_for("http://a:8000", resolve(only=["server"])) == "saved"
