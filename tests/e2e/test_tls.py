"""Built-in TLS end to end: a server on HTTPS with a certificate from a CA the test makes,
clients and workers that trust that CA, and clear refusals for everyone else."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import PYTHON, Fleet
from tests.pki import Pki, encrypted, make_pki

TRAIN = """
import pathlib
data = pathlib.Path("data.txt").read_text()
out = pathlib.Path("outputs"); out.mkdir(exist_ok=True)
(out / "model.txt").write_text("model of " + data)
print("trained on", len(data), "bytes")
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls(cert: Path, key: Path) -> tuple[str, ...]:
    return ("--tls-cert", str(cert), "--tls-key", str(key))


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_clients_and_workers_that_trust_the_ca_run_a_job_over_https(
    fleet: Fleet, pki: Pki, tmp_path: Path
) -> None:
    url = fleet.start_server(*tls(pki.cert, pki.key))
    assert url.startswith("https://127.0.0.1:")
    fleet.ca = pki.ca
    fleet.start_worker("w1", "--ca", str(pki.ca))
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "data.txt").write_text("digits " * 1000)
    (proj / "train.py").write_text(TRAIN)
    # The package goes up over https, the worker fetches it and sends its results back over
    # https, and the CLI downloads them: both HTTP paths of the SDK, on both sides.
    res = fleet.cli(
        *("submit", "--ca", str(pki.ca), "--wait", "--results", str(tmp_path / "r")),
        *("--package", str(proj), "--", "python", "train.py"),
    )
    assert "trained on 7000 bytes" in res.stdout
    model = (tmp_path / "r" / "outputs" / "model.txt").read_text()
    assert model == "model of " + "digits " * 1000

    trusting = {"GPUFLEET_CA": str(pki.ca)}
    res = fleet.cli("submit", "--", "python", "-c", "print('hello over tls')", env=trusting)
    job_id = res.stdout.strip().splitlines()[-1]
    assert fleet.wait_status(job_id, "succeeded", "failed")["status"] == "succeeded"
    assert "hello over tls" in fleet.cli("logs", job_id, env=trusting).stdout
    assert "jobs: 2 succeeded" in fleet.cli("status", env=trusting).stdout
    # The public CAs as a system names them (SSL_CERT_FILE), no --ca: trusted too, and the
    # call goes without httpx (only its uploads and event streams load it).
    public = {"SSL_CERT_FILE": str(pki.ca), "PYTHONPROFILEIMPORTTIME": "1"}
    res = fleet.cli("jobs", env=public)
    assert job_id in res.stdout
    imported = {ln.rsplit("|", 1)[1].strip() for ln in res.stderr.splitlines() if "|" in ln}
    assert "gpufleet.client" in imported and "httpx" not in imported


def test_a_client_without_the_ca_is_refused_with_one_clear_line(
    fleet: Fleet, pki: Pki, tmp_path: Path
) -> None:
    url = fleet.start_server(*tls(pki.cert, pki.key))
    line = one_error_line(fleet.cli("status", check=False))
    assert f"the TLS certificate of the gpufleet server at {url} could not be verified" in line
    assert "--ca FILE" in line and "GPUFLEET_CA" in line

    # A worker stops at once with the same message rather than retrying for ever.
    worker = subprocess.run(
        [PYTHON, "-m", "gpufleet", "worker", "--name", "w0", "--work-dir", str(tmp_path / "w")],
        env=fleet.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode == 1
    assert f"error: the TLS certificate of the gpufleet server at {url}" in worker.stderr
    assert "could not be verified" in worker.stderr and "--ca FILE" in worker.stderr


def test_plain_http_to_the_tls_port_fails_clearly(fleet: Fleet, pki: Pki) -> None:
    url = fleet.start_server(*tls(pki.cert, pki.key))
    plain = url.replace("https://", "http://", 1)
    line = one_error_line(fleet.cli("status", "--server", plain, "--ca", str(pki.ca), check=False))
    assert f"cannot reach the gpufleet server at {plain}" in line
    assert f"use {url}" in line


def test_a_certificate_for_another_host_name_is_refused(fleet: Fleet, pki: Pki) -> None:
    url = fleet.start_server(*tls(pki.other_cert, pki.other_key))
    line = one_error_line(fleet.cli("status", "--ca", str(pki.ca), check=False))
    assert f"the TLS certificate of the gpufleet server at {url} could not be verified" in line
    assert "not valid for '127.0.0.1'" in line


@pytest.mark.parametrize("case", ["cert without key", "encrypted key"])
def test_the_server_refuses_bad_tls_settings_before_it_binds(
    fleet: Fleet, pki: Pki, tmp_path: Path, case: str
) -> None:
    # Every other way of getting the files wrong: tests/unit/test_tls.py.
    if case == "cert without key":
        flags, want = ["--tls-cert", str(pki.cert)], "--tls-cert needs --tls-key too"
    else:
        locked = encrypted(pki.key, tmp_path / "locked.key")
        flags, want = [*tls(pki.cert, locked)], f"--tls-key {locked}: the key is encrypted"
    data = tmp_path / "data"
    res = subprocess.run(
        [PYTHON, "-m", "gpufleet", "server", "--port", "0", "--data-dir", str(data), *flags],
        env=fleet.env,
        stdin=subprocess.DEVNULL,  # an encrypted key must never make it ask for a passphrase
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], res.stderr
    assert "listening" not in res.stdout and not data.exists()
