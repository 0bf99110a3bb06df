"""``server/sharing.py``'s SharingRules: the sharing file read at start (a mistake stops
the server, naming the file and the key), read again when it changes (a mistake keeps the
rules before it), and a file removed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpufleet.domain.sharing import Sharing
from gpufleet.errors import ConfigError
from gpufleet.server.sharing import LOOK_EVERY, SharingRules


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _write(path: Path, text: str, tick: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(tick * 10**9, tick * 10**9))  # a new mtime, whatever the clock


def test_a_mistake_at_start_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "sharing.toml"
    _write(path, "[users.alice]\nmax_gpu = 2\n", 1)
    with pytest.raises(ConfigError, match=r"sharing.toml: users.alice: unknown key 'max_gpu'"):
        SharingRules(path)


def test_an_edit_takes_effect_and_a_bad_one_keeps_the_rules_before_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock = tmp_path / "sharing.toml", Clock()
    _write(path, "[users.alice]\nmax_gpus = 2\n", 1)
    rules = SharingRules(path, clock=clock)
    assert rules.current().user("alice").max_gpus == 2
    _write(path, "[users.alice]\nmax_gpus = 3\n", 2)
    assert rules.current().user("alice").max_gpus == 2, "looked at once a second at most"
    clock.now += LOOK_EVERY
    assert rules.current().user("alice").max_gpus == 3
    _write(path, "[users.alice]\nmax_gpus = -1\n", 3)
    clock.now += LOOK_EVERY
    with caplog.at_level(logging.ERROR, "gpufleet.server"):
        assert rules.current().user("alice").max_gpus == 3
    assert "users.alice.max_gpus" in caplog.text


def test_a_file_removed_says_so_and_leaves_no_rules(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock = tmp_path / "sharing.toml", Clock()
    _write(path, "[users.alice]\nmax_gpus = 2\n", 1)
    rules = SharingRules(path, clock=clock)
    caplog.clear()
    path.unlink()
    clock.now += LOOK_EVERY
    with caplog.at_level(logging.WARNING, "gpufleet.server"):
        assert rules.current() == Sharing()
    assert "is gone" in caplog.text and "read from" not in caplog.text
