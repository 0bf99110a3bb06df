"""``submit --notify -``: the URL (a secret, for Slack) read from stdin, never argv."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gpufleet.cli.webhooks import notify_of
from gpufleet.errors import ConfigError
from gpufleet.wire import WebhookCreate

URL = "https://hooks.slack.com/services/T000/B000/XXXXSECRET"


class _Client:
    def __init__(self) -> None:
        self.made: list[WebhookCreate] = []

    def create_webhook(self, body: WebhookCreate) -> Any:
        self.made.append(body)
        return type("Made", (), {"secret": None, "id": "h-1"})()


def test_notify_dash_reads_the_url_from_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(URL + "\n"))
    c = _Client()
    notify_of(c, "j-1", "-", None, "2h")  # type: ignore[arg-type]
    assert [(m.url, m.job, m.running_past) for m in c.made] == [(URL, "j-1", 7200.0)]


def test_notify_dash_with_an_empty_stdin_or_a_secret_from_stdin_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    with pytest.raises(ConfigError, match="no URL on stdin"):
        notify_of(_Client(), "j-1", "-", None, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="only one may read stdin"):
        notify_of(_Client(), "j-1", "-", Path("-"), None)  # type: ignore[arg-type]
