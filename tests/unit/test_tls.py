"""TLS without a network: the server's certificate checks, the client's trust settings, and
what each failed connection tells the user."""

from __future__ import annotations

import http.client
import ssl
from pathlib import Path

import certifi
import httpx
import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.client._tls import context, transport_error
from gpufleet.errors import ConfigError, ServerUnavailable, UntrustedCertificate
from gpufleet.server.serve import tls_context
from tests.pki import Pki, encrypted, make_pki

URL = "https://gpu.example:8443"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---- the server's certificate and key ------------------------------------------------------


def test_a_certificate_and_its_key_make_a_server_context(pki: Pki) -> None:
    ctx = tls_context(pki.cert, pki.key)
    assert isinstance(ctx, ssl.SSLContext) and ctx.protocol == ssl.PROTOCOL_TLS_SERVER
    assert tls_context(None, None) is None


def test_one_of_the_pair_alone_is_refused(pki: Pki) -> None:
    with pytest.raises(ConfigError, match="--tls-cert needs --tls-key too"):
        tls_context(pki.cert, None)
    with pytest.raises(ConfigError, match="--tls-key needs --tls-cert too"):
        tls_context(None, pki.key)


def test_each_bad_file_is_named(pki: Pki, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not PEM\n")
    missing = tmp_path / "missing.pem"
    cases = [
        (missing, pki.key, f"--tls-cert {missing}: cannot read it: No such file"),
        (pki.cert, tmp_path, f"--tls-key {tmp_path}: cannot read it: Is a directory"),
        (garbage, pki.key, f"--tls-cert {garbage}: no PEM certificate in it"),
        (pki.key, pki.key, f"--tls-cert {pki.key}: no PEM certificate in it"),
        (pki.cert, garbage, f"--tls-key {garbage}: no PEM private key in it"),
        (
            pki.cert,
            pki.other_key,
            f"--tls-key {pki.other_key}: not the private key of --tls-cert {pki.cert}",
        ),
    ]
    for cert, key, message in cases:
        with pytest.raises(ConfigError) as info:
            tls_context(cert, key)
        assert message in info.value.message


def test_an_encrypted_key_is_refused_without_asking_for_its_passphrase(
    pki: Pki, tmp_path: Path
) -> None:
    locked = encrypted(pki.key, tmp_path / "locked.key")
    with pytest.raises(ConfigError, match="the key is encrypted with a passphrase"):
        tls_context(pki.cert, locked)


# ---- what the client trusts ----------------------------------------------------------------


def test_plain_http_needs_no_context_and_https_verifies_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # httpx's store: certifi's CAs
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    assert context("http://127.0.0.1:8000", ca="/no/such/file") is None
    ctx = context(URL)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) > 10  # the default store: many public CAs


def test_ssl_cert_file_names_the_public_cas_as_for_httpx(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SSL_CERT_FILE replaces certifi's bundle (the system's store is still added)."""
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    ctx = context(URL)
    assert ctx is not None
    subjects = [dict(rdn[0] for rdn in c["subject"]).get("commonName") for c in ctx.get_ca_certs()]
    assert "gpufleet test CA" in subjects
    monkeypatch.delenv("SSL_CERT_FILE")
    ctx = context(URL)
    assert ctx is not None
    assert "gpufleet test CA" not in [
        dict(rdn[0] for rdn in c["subject"]).get("commonName") for c in ctx.get_ca_certs()
    ]


def test_a_ca_file_replaces_the_default_store(pki: Pki) -> None:
    ctx = context(URL, ca=pki.ca)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    subjects = [dict(rdn[0] for rdn in c["subject"]) for c in ctx.get_ca_certs()]
    assert subjects == [{"commonName": "gpufleet test CA"}]
    assert context(URL, ca=certifi.where()) is not None  # a bundle of many CAs works too


def test_a_ca_file_that_cannot_be_used_is_named(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"CA file {tmp_path / 'nope.pem'} .*No such file"):
        context(URL, ca=tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=f"CA file {pki.key} .*no PEM CA certificate"):
        context(URL, ca=pki.key)


def test_the_cli_names_a_bad_ca_file_before_any_request(pki: Pki) -> None:
    result = CliRunner().invoke(app, ["status", "--server", URL, "--ca", str(pki.key)])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError)
    assert f"CA file {pki.key}" in result.exception.message


def test_gpufleet_ca_reaches_every_command(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_CA", str(pki.key))  # a bad one, so the command shows it used it
    result = CliRunner().invoke(app, ["jobs", "--server", URL])
    assert isinstance(result.exception, ConfigError)
    assert f"CA file {pki.key}" in result.exception.message


# ---- what a failed connection means --------------------------------------------------------


def as_httpx_raises(inner: BaseException) -> httpx.ConnectError:
    """``inner`` wrapped the way httpx wraps it: ConnectError from httpcore's, from it."""
    import httpcore

    try:
        try:
            raise httpcore.ConnectError(str(inner)) from inner
        except httpcore.ConnectError as mid:
            raise httpx.ConnectError(str(mid)) from mid
    except httpx.ConnectError as outer:
        return outer


def verify_failed(code: int, message: str) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] ...")
    exc.verify_code, exc.verify_message = code, message
    return exc


def test_an_unknown_ca_is_an_untrusted_certificate_that_suggests_ca() -> None:
    err = transport_error(URL, as_httpx_raises(verify_failed(20, "unable to get local issuer")))
    assert isinstance(err, UntrustedCertificate) and not isinstance(err, ServerUnavailable)
    assert err.message.startswith(
        f"the TLS certificate of the gpufleet server at {URL} could not be verified "
        "(unable to get local issuer)"
    )
    assert "--ca FILE" in err.message and "GPUFLEET_CA" in err.message


def test_a_name_mismatch_suggests_the_right_name_not_a_ca() -> None:
    bad = verify_failed(64, "IP address mismatch, certificate is not valid for '10.0.0.1'.")
    err = transport_error(URL, bad)  # http.client raises it bare
    assert isinstance(err, UntrustedCertificate)
    assert "not valid for '10.0.0.1')" in err.message
    assert "a name or address its certificate holds" in err.message and "--ca" not in err.message


def test_tls_to_a_plain_http_server_says_to_check_the_scheme() -> None:
    bad = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    err = transport_error(URL, as_httpx_raises(bad))
    assert isinstance(err, ServerUnavailable)
    assert "the TLS handshake failed" in err.message and "plain http://" in err.message


@pytest.mark.parametrize(
    "hangup",
    [
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        http.client.RemoteDisconnected("Remote end closed connection without response"),
    ],
)
def test_plain_http_to_a_tls_server_suggests_https(hangup: Exception) -> None:
    err = transport_error("http://10.0.0.1:8443", hangup)
    assert isinstance(err, ServerUnavailable)
    assert "if this one does, use https://10.0.0.1:8443" in err.message


def test_a_refused_connection_keeps_the_usual_message() -> None:
    err = transport_error(URL, as_httpx_raises(ConnectionRefusedError(111, "refused")))
    assert isinstance(err, ServerUnavailable)
    assert f"cannot reach the gpufleet server at {URL}" in err.message
    assert "is `gpufleet server` running?" in err.message and "TLS" not in err.message
