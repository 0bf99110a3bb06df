"""``server/sharing.py``'s SharingRules: the sharing file read at start (a mistake stops
the server, naming the file and the key), read again when it changes (a mistake keeps the
rules before it), and a file removed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpufleet.domain import caps
from gpufleet.domain.limits import MAX_TIMEOUT
from gpufleet.domain.sharing import Sharing, parse
from gpufleet.errors import ConfigError
from gpufleet.server.sharing import LOOK_EVERY, SharingRules
from gpufleet.wire import JobSpecModel


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


# Hostile values: refused with the key named, never kept to break claims or webhooks.


@pytest.mark.parametrize("max_run", [0, "0s", MAX_TIMEOUT + 1, "200d"])
def test_a_pools_max_run_of_zero_or_past_a_timeouts_limit_is_refused(max_run: object) -> None:
    # It becomes a job's timeout in its lease: 0 or past the limit is a lease every
    # worker refuses to read (its claim loop ends), so the file is refused instead.
    with pytest.raises(ConfigError, match=r"pools\.gpu\.max_run: must be between 1 second"):
        parse({"pools": {"gpu": {"max_run": max_run}}}, "sharing.toml")


def test_the_longest_max_run_allowed_makes_a_timeout_a_worker_reads() -> None:
    rules = parse({"pools": {"gpu": {"max_run": MAX_TIMEOUT}}}, "sharing.toml")
    timeout, by_pool = caps.run_limit(rules, "gpu", None)
    assert by_pool
    JobSpecModel.model_validate({"name": "j", "command": ["true"], "timeout": timeout})


@pytest.mark.parametrize("entry", ["not a host!", "10.0.0.0/33", "a..b"])
def test_a_webhook_allow_entry_that_is_no_host_or_network_is_refused(entry: str) -> None:
    # Kept, it made every webhook's creation (and delivery) fail with a 500 later.
    with pytest.raises(ConfigError, match=r"webhooks\.allow: .* is not a host name"):
        parse({"webhooks": {"allow": [entry]}}, "sharing.toml")
