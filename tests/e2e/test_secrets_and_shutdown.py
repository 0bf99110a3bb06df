"""A token pasted with a stray newline, secrets in every error path, and a server stopped
under load: clear words, no secret anywhere, no 5xx and no traceback.

Real server and worker processes; every process is stopped by the fixture.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gpufleet.config import load_token
from tests.e2e.conftest import PYTHON, Fleet, Proc, free_port, wait_for

pytestmark = pytest.mark.e2e

QUICK = ["--", sys.executable, "-c", "print('hello')"]


def _fragments(secret: str) -> list[str]:
    """Pieces of a token that must never be shown: every 8 characters in a row past the
    7-character hint ``tokens ls`` shows (``gf_`` and four more)."""
    return [secret[i : i + 8] for i in range(7, len(secret) - 7)]


def _leaks(secret: str, *texts: str) -> list[str]:
    return [f for f in _fragments(secret) for t in texts if f in t]


def _bare_worker(fleet: Fleet, name: str, env: dict[str, str], *args: str) -> Proc:
    """A worker process that may never register (a bad token, no server)."""
    argv = [PYTHON, "-m", "gpufleet", "worker", "--name", name, "--heartbeat", "0.5"]
    argv += ["--work-dir", str(fleet.root / "work" / name), *args]
    proc = Proc(argv, {**fleet.env, **env}, fleet.root / f"worker-{name}.log")
    fleet.procs.append(proc)
    return proc


def test_a_token_with_stray_whitespace_works_or_fails_clearly(fleet: Fleet) -> None:
    fleet.start_server()
    token = load_token(fleet.url)
    assert token
    # Surrounding whitespace (a pasted line, `$(cat file)` of a file with CRLF) is dropped.
    listed = fleet.cli("jobs", "--json", env={"GPUFLEET_TOKEN": token + "\n"})
    assert listed.stdout.strip() == "[]"
    padded = fleet.start_worker("padded", env_extra={"GPUFLEET_TOKEN": f" {token}\r\n"})

    # Whitespace inside is refused by name and position, the token never echoed.
    broken = token[:10] + "\n" + token[10:]
    res = fleet.cli("jobs", env={"GPUFLEET_TOKEN": broken}, check=False)
    assert res.returncode != 0
    assert "the token contains a newline at position 11" in res.stderr, res.stderr
    assert "cannot reach" not in res.stderr, res.stderr
    assert not _leaks(token, res.stdout, res.stderr)

    # A worker given it stops at once with the same words, and does not retry forever.
    started = time.monotonic()
    bad = _bare_worker(fleet, "broken", {"GPUFLEET_TOKEN": token[:20] + " " + token[20:]})
    code = bad.popen.wait(15)
    took = time.monotonic() - started
    assert code != 0 and took < 5, (code, took)
    assert "the token contains a space at position 21" in bad.text(), bad.text()
    assert fleet.server is not None
    assert not _leaks(token, bad.text(), padded.text(), fleet.server.text())


def test_a_worker_that_cannot_reach_its_server_stops_promptly_on_sigterm(fleet: Fleet) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    proc = _bare_worker(fleet, "lost", {"GPUFLEET_TOKEN": "gf_" + "x" * 43}, "--server", nowhere)
    wait_for(lambda: "unreachable" in proc.text(), 20, "the worker to retry")
    started = time.monotonic()
    proc.signal(signal.SIGTERM)
    code = proc.popen.wait(20)
    took = time.monotonic() - started
    assert code == 0 and took < 3.0, (code, took, proc.text())


def test_secrets_stay_out_of_every_error_path(fleet: Fleet, tmp_path: Path) -> None:
    """A real token fed wherever a user might paste it by mistake: as a job, a worker, a
    name, a label, a session, a server, a manifest; with a space in it; one character
    short. Every output (CLI, API answers, server and worker logs) is searched for it."""
    fleet.start_server()
    worker = fleet.start_worker("w1")
    secret = fleet.cli("tokens", "create", "--name", "alice", "--role", "submitter").stdout
    secret = secret.strip()
    plan = tmp_path / "plan.toml"
    plan.write_text(
        f'schema_version = 1\nname = "{secret}"\n[[jobs]]\nname = "{secret}"\n'
        'command = "true"\nmin_vram_gib = -1\n'
    )
    calls: list[tuple[list[str], dict[str, str]]] = [
        (["show", secret], {}),
        (["logs", secret], {}),
        (["why", secret], {}),
        (["cancel", secret], {}),
        (["requeue", secret], {}),
        (["download", secret], {}),
        (["drain", secret], {}),
        (["workers", "rm", secret], {}),
        (["tokens", "revoke", secret], {}),
        (["submit", "--worker", secret, *QUICK], {}),
        (["submit", "--label", secret, *QUICK], {}),
        (["submit", "--session", secret, *QUICK], {}),
        (["submit", "--input", f"job:{secret}", *QUICK], {}),
        (["--server", f"http://{secret}.invalid:9", "jobs"], {}),
        (["jobs", "--server", f"http://{secret}.invalid:9"], {}),
        (["apply", str(plan)], {}),
        (["jobs"], {"GPUFLEET_TOKEN": secret[:30] + " " + secret[30:]}),
        (["jobs"], {"GPUFLEET_TOKEN": secret[:-1]}),
        (["jobs"], {"GPUFLEET_SERVER": secret}),
        (["jobs"], {"GPUFLEET_SESSION": secret}),
    ]
    with ThreadPoolExecutor(4) as pool:  # 20 CLI starts: four at a time
        results = list(pool.map(lambda call: fleet.cli(*call[0], env=call[1], check=False), calls))
    for (args, _), res in zip(calls, results, strict=True):
        assert res.returncode != 0, (args, res.stdout)
        assert res.stderr.strip(), args
        assert not _leaks(secret, res.stdout, res.stderr), (args, res.stdout, res.stderr)

    admin = {"Authorization": f"Bearer {load_token(fleet.url)}"}
    for method, path in (
        ("GET", f"/v1/jobs/{secret}"),
        ("GET", f"/v1/workers/{secret}"),
        ("POST", f"/v1/jobs/{secret}/cancel"),
        ("DELETE", f"/v1/tokens/{secret}"),
    ):
        answer = httpx.request(method, fleet.url + path, headers=admin, timeout=10)
        assert answer.status_code == 404 and not _leaks(secret, answer.text), answer.text
    wrong = httpx.get(
        fleet.url + "/v1/jobs", headers={"Authorization": f"Bearer {secret}x"}, timeout=10
    )
    assert wrong.status_code == 401 and not _leaks(secret, wrong.text)

    fleet.stop_all()
    assert fleet.server is not None
    for proc in (fleet.server, worker):
        assert not _leaks(secret, proc.text()), proc.log


#: What a 5xx answer leaves in a worker's log: the status, or our 500's own message.
FIVE_XX = re.compile(r"HTTP 5\d\d|internal server error", re.IGNORECASE)


def test_stopping_the_server_answers_open_polls_without_a_traceback(fleet: Fleet) -> None:
    port = free_port()
    fleet.start_server("--port", str(port))
    workers = [fleet.start_worker(f"w{n}") for n in range(3)]
    # A poll of the test's own, held open while the server stops: it is answered empty.
    secret = fleet.cli("tokens", "create", "--name", "probe", "--role", "worker").stdout
    probe = {"Authorization": f"Bearer {secret.strip()}"}
    body = {"name": "probe", "capability": {"hostname": "probe", "cores": 1, "ram_mib": 1024}}
    registered = httpx.post(fleet.url + "/v1/workers", json=body, headers=probe, timeout=10)
    assert registered.status_code == 201, registered.text
    claim = f"{fleet.url}/v1/workers/{registered.json()['id']}/claim"
    with ThreadPoolExecutor(1) as pool:
        poll = pool.submit(
            httpx.post, claim, json={"cpu_slots": 1, "wait": 30}, headers=probe, timeout=40
        )
        time.sleep(1.0)  # every worker is in a long poll now, and so is the probe
        assert fleet.server is not None
        started = time.monotonic()
        code = fleet.server.stop(timeout=20)
        took = time.monotonic() - started
        answer = poll.result(timeout=30)
    log = fleet.server.text()
    assert code == 0 and took < 5.0, (code, took, log)
    assert answer.status_code == 204, (answer.status_code, answer.text)
    for bad in ("Traceback", "CancelledError", "graceful shutdown exceeded", "internal error"):
        assert bad not in log, log
    for w in workers:
        assert not FIVE_XX.search(w.text()) and "claim refused" not in w.text(), w.text()
        assert w.popen.poll() is None  # waiting for the server to come back

    # The server comes back on the same port; the workers find it and run jobs again.
    fleet.restart_server()
    job = fleet.cli("submit", *QUICK).stdout.split()[-1]
    assert fleet.wait_status(job, "succeeded", timeout=40)["status"] == "succeeded"
    for w in workers:
        assert not FIVE_XX.search(w.text()), w.text()


def test_a_server_beyond_loopback_without_tls_warns(fleet: Fleet) -> None:
    argv = [PYTHON, "-m", "gpufleet", "server", "--host", "0.0.0.0", "--port", "0"]
    argv += ["--data-dir", str(fleet.root / "open")]
    proc = Proc(argv, fleet.env, fleet.root / "open-server.log")
    fleet.procs.append(proc)
    wait_for(lambda: "listening on" in proc.text(), 30, "the server to listen")
    wait_for(lambda: "without TLS" in proc.text(), 10, "the warning")
    text = " ".join(proc.text().split())
    assert "--tls-cert" in text, text
    # On loopback there is nothing to warn about (read once the server has stopped).
    fleet.start_server()
    assert fleet.server is not None
    fleet.server.stop()
    assert "TLS" not in fleet.server.text(), fleet.server.text()


def test_a_session_holding_a_token_is_shown_on_a_terminal_and_kept_in_a_file(
    fleet: Fleet,
) -> None:
    """Asked for on a terminal, the secret session string is printed whole there (a
    terminal is not a log) and written to a 0600 file; either one sends jobs."""
    fleet.start_server()
    share = fleet.cli("tokens", "create", "--name", "share", "--role", "submitter").stdout
    primary, secondary = pty.openpty()
    argv = [PYTHON, "-m", "gpufleet", "worker", "--name", "tty", "--share-token"]
    argv += ["--work-dir", str(fleet.root / "work" / "tty")]
    env = {**fleet.env, "GPUFLEET_SHARE_TOKEN": share.strip()}
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary
    )
    os.close(secondary)
    shown = bytearray()
    try:
        deadline = time.monotonic() + 30
        while b"also in" not in shown and time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):
                    shown.extend(os.read(primary, 65536))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        os.close(primary)
    text = shown.decode(errors="replace")
    found = re.search(r"keep it secret\): (gfs1_\S+)", text)
    assert found and "…" not in found.group(1), text
    session_file = fleet.root / "work" / "tty" / "session"
    assert session_file.read_text().strip() == found.group(1)
    assert session_file.stat().st_mode & 0o777 == 0o600
