"""A throwaway certificate authority for the TLS tests, made with the ``openssl`` command.

EC P-256 keys: a whole PKI takes a few tens of milliseconds.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def new_key(cwd: Path, name: str) -> Path:
    openssl(cwd, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name)
    return cwd / name


def encrypted(key: Path, dest: Path) -> Path:
    """``key`` encrypted with a passphrase, as many tools write keys by default."""
    openssl(
        dest.parent, "pkey", "-in", str(key), "-aes256", "-passout", "pass:x", "-out", str(dest)
    )
    return dest


def issue(cwd: Path, name: str, alt_names: str, serial: int) -> tuple[Path, Path]:
    """A server certificate and its key, signed by ``cwd/ca.pem``, for ``alt_names``."""
    key = new_key(cwd, f"{name}.key")
    openssl(cwd, "req", "-new", "-key", key.name, "-subj", f"/CN={name}", "-out", f"{name}.csr")
    (cwd / f"{name}.ext").write_text(
        f"subjectAltName={alt_names}\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    openssl(
        cwd,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key"),
        *("-set_serial", str(serial), "-days", "2", "-extfile", f"{name}.ext"),
        *("-out", f"{name}.pem"),
    )
    return cwd / f"{name}.pem", key


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate clients are told to trust
    cert: Path  # for IP 127.0.0.1, where the tests' servers listen
    key: Path
    other_cert: Path  # for the name other.example only
    other_key: Path


def make_pki(root: Path) -> Pki:
    new_key(root, "ca.key")
    openssl(
        root,
        *("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=gpufleet test CA"),
        *("-days", "2", "-out", "ca.pem"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    cert, key = issue(root, "loopback", "IP:127.0.0.1", 1)
    other_cert, other_key = issue(root, "other", "DNS:other.example", 2)
    return Pki(root / "ca.pem", cert, key, other_cert, other_key)
