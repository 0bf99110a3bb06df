"""Revoking or rotating a token ends what it holds open: its job and fleet event streams
and its dashboard session's streams end within 2 s, on the server it was revoked through
and on another server of the same PostgreSQL database; the client sees each stream end,
and its reconnect is refused (401)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from gpufleet.client import Client
from gpufleet.config import load_token
from gpufleet.wire import JobSpecModel, TokenCreate
from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e

WITHIN = 2.0  # seconds from the revoke to each stream's end
READ_TIMEOUT = 8.0  # a stream left open this long after its last byte counts as not ended


class Watch:
    """An event stream read in a thread: whether it opened, and when it ended (cleanly:
    the response's end, not an error)."""

    def __init__(self, url: str, path: str, **auth: dict[str, str]) -> None:
        self.url, self.path, self.auth = url, path, auth
        self.opened = threading.Event()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        timeout = httpx.Timeout(5.0, read=READ_TIMEOUT)
        try:
            with (
                httpx.Client(base_url=self.url, timeout=timeout, **self.auth) as http,  # type: ignore[arg-type]
                http.stream("GET", self.path) as resp,
            ):
                assert resp.status_code == 200, resp.read()
                for _ in resp.iter_bytes():
                    self.opened.set()
            self.ended_at = time.monotonic()
        except BaseException as exc:  # seen by the test
            self.error = exc
        finally:
            self.opened.set()

    def wait_open(self) -> None:
        assert self.opened.wait(10), f"{self.path} did not open"
        assert self.error is None, self.error

    def ended_within(self, since: float) -> float:
        """Seconds from ``since`` to the stream's clean end."""
        self.thread.join(READ_TIMEOUT + 2)
        assert self.error is None, f"{self.path}: {self.error!r}"
        assert self.ended_at is not None, f"{self.path} still open"
        return self.ended_at - since


def _submitter(admin: Client, name: str) -> tuple[str, str]:
    made = admin.create_token(TokenCreate(name=name, role="submitter"))
    return made.id, made.token


def _session(url: str, token: str) -> dict[str, str]:
    resp = httpx.post(f"{url}/v1/session", json={"token": token}, timeout=10)
    assert resp.status_code == 200, resp.text
    return {"gpufleet_session": resp.cookies["gpufleet_session"]}


def _watch_all(url: str, token: str, job_id: str) -> list[Watch]:
    """A job stream and the fleet stream by bearer token, and a job stream through a
    dashboard session signed in with the same token, all open on ``url``."""
    bearer = {"headers": {"Authorization": f"Bearer {token}"}}
    events = f"/v1/jobs/{job_id}/events"
    watches = [
        Watch(url, events, **bearer),
        Watch(url, "/v1/events", **bearer),
        Watch(url, events, cookies=_session(url, token)),
    ]
    for w in watches:
        w.wait_open()
    return watches


def _ends_them(
    admin: Client, stream_url: str, job_id: str, name: str, change: Callable[[str], object]
) -> None:
    """Open the streams of a fresh submitter token on ``stream_url``, ``change`` the token
    through ``admin``'s server: every stream ends within ``WITHIN``, and a reconnect gets
    401."""
    token_id, token = _submitter(admin, name)
    watches = _watch_all(stream_url, token, job_id)
    time.sleep(0.3)  # the streams are idle: nothing but the change can end them
    assert all(w.ended_at is None and w.error is None for w in watches)
    changed_at = time.monotonic()
    change(token_id)
    took = [w.ended_within(changed_at) for w in watches]
    print(f"{name}: streams ended {', '.join(f'{t:.2f}' for t in took)} s after")
    assert max(took) < WITHIN, took
    again = httpx.get(
        f"{stream_url}/v1/jobs/{job_id}/events",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert again.status_code == 401, again.text


def _pending_job(admin: Client) -> str:
    """A job no worker takes: its event stream stays open until something ends it."""
    spec = JobSpecModel(name="waits", command=["true"])
    return admin.submit(spec).job.id


def test_revoke_and_rotate_end_the_tokens_streams_within_two_seconds(fleet: Fleet) -> None:
    fleet.start_server()
    with fleet.client() as admin:
        job = _pending_job(admin)
        _ends_them(admin, fleet.url, job, "revoked", admin.revoke_token)
        _ends_them(admin, fleet.url, job, "rotated", admin.rotate_token)
    assert "Traceback" not in fleet.procs[0].text()


def test_a_revoke_through_one_server_ends_streams_open_on_another(
    pg_url: str, fleet: Fleet
) -> None:
    url_a = fleet.start_server(db=pg_url)
    url_b = fleet.start_server(db=pg_url)
    with Client(url_a, load_token(url_a)) as admin:
        job = _pending_job(admin)
        _ends_them(admin, url_b, job, "revoked", admin.revoke_token)
        _ends_them(admin, url_b, job, "rotated", admin.rotate_token)
    for proc in fleet.procs:
        assert "Traceback" not in proc.text()
