"""When a transfer gives up: only after failures in a row that also outlast its patience,
counted from its last progress, so a long transfer may break many times and still finish."""

from __future__ import annotations

import pytest

from gpufleet.client import _transfer
from gpufleet.client._transfer import PATIENCE, RETRIES, _Retry
from gpufleet.errors import ServerUnavailable


class Clock:
    """Stands in for the time module: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(_transfer, "time", fake)
    return fake


def test_breaks_with_progress_in_between_never_exhaust_the_budget(clock: Clock) -> None:
    retry = _Retry()
    for position in range(1, 50):  # fifty cuts, each after some bytes moved
        retry.failed(ServerUnavailable("cut"))
        retry.progress(position * 1000)


def test_without_progress_it_waits_out_its_patience_then_gives_up(clock: Clock) -> None:
    retry = _Retry()
    retry.progress(0)
    gone = ServerUnavailable("server down")
    tries = 0
    with pytest.raises(ServerUnavailable, match="server down"):
        while True:
            retry.failed(gone)
            tries += 1
    assert tries >= RETRIES
    assert clock.now > PATIENCE  # a server restart or a stale session's timeout fits


def test_the_same_position_again_is_not_progress(clock: Clock) -> None:
    retry = _Retry()
    retry.progress(500)
    for _ in range(RETRIES):
        retry.failed(ServerUnavailable("cut"))
        retry.progress(500)
    clock.now += PATIENCE + 1
    with pytest.raises(ServerUnavailable):
        retry.failed(ServerUnavailable("cut"))


def test_a_long_stretch_of_progress_is_credited_before_the_next_cut(clock: Clock) -> None:
    retry = _Retry()
    retry.progress(0)
    for _ in range(RETRIES + 4):  # a busy session waited out: many failures in a row
        retry.failed(ServerUnavailable("busy"))
    clock.now += 7200  # then two hours of bytes moving, and one cut
    retry.progress(40 << 30)
    retry.failed(ServerUnavailable("cut"))  # a fresh budget: no giving up here


def test_a_rate_limited_answer_is_one_to_wait_out() -> None:
    import httpx

    from gpufleet.client._api import raise_for
    from gpufleet.errors import RateLimited, ServerUnavailable

    body = {"error": {"code": "rate_limited", "message": "slow down", "detail": None}}
    with pytest.raises(RateLimited) as caught:
        raise_for(httpx.Response(429, json=body))
    assert isinstance(caught.value, ServerUnavailable)  # retried like an unreachable server
    assert caught.value.status == 429 and caught.value.message == "slow down"
