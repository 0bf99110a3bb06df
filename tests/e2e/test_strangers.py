"""Strangers cannot stall the server: bodies without a token, slowloris, huge headers.

A real ``gpufleet server`` runs a real worker's job while the test, from other loopback
addresses (127.0.0.2 and up, so the per-address limits fall on the attacker alone), sends
what an attacker would. Throughout, a prober on 127.0.0.1 times ``/v1/health`` and samples
the server's memory; after each attack the job still runs on its first attempt (no lease
was lost). Every socket is closed by the test, every wait bounded.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil
import pytest

from tests.e2e.conftest import Fleet

MIB = 1 << 20
HEADER_TIMEOUT = 10.0  # the server's default (server/limits.py)


@dataclass
class Probe:
    """Times ``/v1/health`` every 50 ms and samples the server's RSS, in a thread."""

    url: str
    pid: int
    latencies: list[float] = field(default_factory=list)
    peak_rss: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        parts = urlsplit(self.url)
        server = psutil.Process(self.pid)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                conn.request("GET", "/v1/health")
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    self.failures.append(f"health answered {response.status}")
            except OSError as exc:
                self.failures.append(f"health failed: {exc!r}")
                conn.close()
            self.latencies.append(time.monotonic() - began)
            self.peak_rss = max(self.peak_rss, server.memory_info().rss)
            self._stop.wait(0.05)
        conn.close()

    @contextlib.contextmanager
    def watching(self) -> Iterator[Probe]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(10)


def _address(fleet: Fleet) -> tuple[str, int]:
    parts = urlsplit(fleet.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _connect(target: tuple[str, int], source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(20)
    sock.connect(target)
    return sock


@pytest.fixture
def busy(fleet: Fleet) -> Iterator[tuple[Fleet, str]]:
    """A server whose worker runs a job that lasts the whole test (lease 3 s)."""
    fleet.start_server()
    fleet.start_worker("w1")
    job_id = fleet.cli("submit", "--", "sleep", "600").stdout.split()[-1]
    fleet.wait_status(job_id, "running")
    yield fleet, job_id
    fleet.cli("cancel", job_id, check=False)


def _attacked(fleet: Fleet, job_id: str, attack: Callable[[], None]) -> Probe:
    """Run ``attack`` under the probe; then the job must still run its first attempt."""
    assert fleet.server is not None
    server = psutil.Process(fleet.server.popen.pid)
    time.sleep(1)  # the server settles after the job's start
    probe = Probe(fleet.url, server.pid)
    before = server.memory_info().rss
    with probe.watching():
        attack()
        time.sleep(1)
    job = fleet.job(job_id)
    assert job["status"] == "running" and job["attempt"] == 1, job
    assert not probe.failures, probe.failures[:5]
    grew = (probe.peak_rss - before) / MIB
    slowest = max(probe.latencies)
    print(f"server memory +{grew:.1f} MiB, slowest health {slowest * 1000:.0f} ms")
    assert grew < 50, f"server memory grew by {grew:.1f} MiB"
    assert slowest < 0.2, f"health took {slowest * 1000:.0f} ms"
    return probe


def _send_body_without_token(target: tuple[str, int], source: str) -> bytes:
    """POST 16 MiB with no token; what the server answered."""
    sock = _connect(target, source)
    try:
        head = (
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (16 * MIB)
        )
        sock.sendall(head)
        chunk = b"[" * (64 << 10)
        with contextlib.suppress(OSError):  # the server hangs up on the unread body
            for _ in range(256):
                sock.sendall(chunk)
        with contextlib.suppress(OSError):
            return sock.recv(65536)
        return b""
    finally:
        sock.close()


@pytest.mark.slow
def test_thirty_16_mib_bodies_without_a_token_cost_the_server_nothing(
    busy: tuple[Fleet, str],
) -> None:
    fleet, job_id = busy
    target = _address(fleet)
    answers: list[bytes] = []

    def attack() -> None:
        with ThreadPoolExecutor(30) as pool:
            answers.extend(
                pool.map(lambda _: _send_body_without_token(target, "127.0.0.2"), range(30))
            )

    _attacked(fleet, job_id, attack)
    assert len(answers) == 30
    # each was answered 401 (or 429 once the address was refused), or cut off unread
    assert all(a.startswith((b"HTTP/1.1 401", b"HTTP/1.1 429")) or a == b"" for a in answers)
    assert any(a.startswith(b"HTTP/1.1 401") for a in answers)


@pytest.mark.slow
def test_700_slowloris_connections_are_cut_off_and_hold_nothing(
    busy: tuple[Fleet, str],
) -> None:
    """Each sends a request line and then a header line a second, never ending its
    headers: each is closed at the header deadline, and the server serves on meanwhile."""
    fleet, job_id = busy
    target = _address(fleet)
    socks: list[socket.socket] = []
    closed_after: list[float] = []

    def attack() -> None:
        began = time.monotonic()
        try:
            for i in range(700):
                sock = _connect(target, f"127.0.0.{3 + i // 350}")
                sock.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n")
                sock.setblocking(False)
                socks.append(sock)
            open_ones = list(socks)
            deadline = began + HEADER_TIMEOUT + 5
            while open_ones and time.monotonic() < deadline:
                time.sleep(1)
                for sock in list(open_ones):
                    try:
                        sock.sendall(b"X-Slow: 1\r\n")
                        data = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    # the server answered 408 and closed, or just closed
                    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:80]
                    closed_after.append(time.monotonic() - began)
                    open_ones.remove(sock)
            assert not open_ones, f"{len(open_ones)} slowloris connections still open"
        finally:
            for sock in socks:
                sock.close()

    _attacked(fleet, job_id, attack)
    assert len(closed_after) == 700
    assert max(closed_after) < HEADER_TIMEOUT + 5


def test_100_mib_of_headers_is_refused_431_early(busy: tuple[Fleet, str]) -> None:
    fleet, job_id = busy
    target = _address(fleet)
    sent: list[int] = []
    answers: list[bytes] = []

    def one() -> None:
        sock = _connect(target, "127.0.0.5")
        total = 0
        try:
            sock.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Pad: ")
            chunk = b"a" * (64 << 10)
            with contextlib.suppress(OSError):  # the server hangs up after its answer
                while total < 100 * MIB:
                    sock.sendall(chunk)
                    total += len(chunk)
            with contextlib.suppress(OSError):
                answers.append(sock.recv(65536))
        finally:
            sent.append(total)
            sock.close()

    def attack() -> None:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: one(), range(4)))

    _attacked(fleet, job_id, attack)
    assert all(n < 100 * MIB for n in sent), sent  # cut off long before the end
    assert answers and all(a.startswith(b"HTTP/1.1 431") or a == b"" for a in answers), answers


def test_a_body_sent_with_its_headers_in_one_write_is_not_taken_for_headers(
    fleet: Fleet,
) -> None:
    """The header cap counts the request line and headers only: a request whose headers
    and large body arrive in one read is served (a worker's log batch often is)."""
    fleet.start_server()
    token = fleet.client()._token
    target = _address(fleet)
    body = json.dumps({"name": "x" * 100_000, "command": ["true"]}).encode()
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = _connect(target, "127.0.0.1")
    try:
        for _ in range(3):  # on one kept-alive connection, one after another
            sock.sendall(head + body)
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            text = answer.read()
            assert answer.status == 422 and b"name" in text, (answer.status, text[:200])
    finally:
        sock.close()


def test_a_body_the_answer_did_not_wait_for_ends_its_connection(fleet: Fleet) -> None:
    """A request answered before its body ended (here a 405) must not keep its
    connection by sending body without end: past the answer, the connection closes."""
    fleet.start_server()
    sock = _connect(_address(fleet), "127.0.0.2")
    try:
        sock.sendall(b"POST /v1/health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.settimeout(0.5)
        began, closed = time.monotonic(), False
        while time.monotonic() - began < 15:
            try:
                sock.sendall(b"4\r\nabcd\r\n")
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "the connection was still open after 15 s of unwanted body"
    finally:
        sock.close()


def test_past_its_cap_an_address_gets_no_more_connections(fleet: Fleet) -> None:
    """1,024 open at once from one address (here 127.0.0.6); the next is answered 503
    and closed, and another address still gets in."""
    fleet.start_server()
    target = _address(fleet)
    held: list[socket.socket] = []
    try:
        for _ in range(1024):
            held.append(_connect(target, "127.0.0.6"))
        extra = _connect(target, "127.0.0.6")
        held.append(extra)
        answer = extra.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
        other = http.client.HTTPConnection(target[0], target[1], timeout=10)
        other.request("GET", "/v1/health")
        assert other.getresponse().status == 200
        other.close()
    finally:
        for sock in held:
            sock.close()


def test_x_forwarded_for_is_not_believed_unless_a_proxy_is_trusted(fleet: Fleet) -> None:
    """A process on the server's own host (a job, say) that claims another address in
    ``X-Forwarded-For`` cannot lock that address out: its wrong tokens count against its
    real address (uvicorn's default believes any process on the host)."""
    fleet.start_server()
    target = _address(fleet)

    def get(headers: dict[str, str]) -> int:
        conn = http.client.HTTPConnection(target[0], target[1], timeout=10)
        try:
            conn.request("GET", "/v1/jobs", headers=headers)
            return conn.getresponse().status
        finally:
            conn.close()

    forged = {"Authorization": "Bearer gf_wrong", "X-Forwarded-For": "192.0.2.7"}
    assert {get(forged) for _ in range(25)} == {401, 429}
    # the strikes fell on 127.0.0.1 itself, which is now refused
    assert get({"Authorization": "Bearer gf_wrong"}) == 429
