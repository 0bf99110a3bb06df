"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated user config dir and an empty project dir as cwd; no GPUFLEET_* set."""
    for var in list(os.environ):
        if var.startswith("GPUFLEET_"):
            monkeypatch.delenv(var)
    user = tmp_path / "user"
    monkeypatch.setenv("GPUFLEET_CONFIG_DIR", str(user))
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    return user
