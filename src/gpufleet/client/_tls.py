"""TLS on the client side: which certificates to trust, and what a failed handshake means.

One :class:`ssl.SSLContext` per client serves both HTTP paths (httpx, and blob downloads
over ``http.client``), so both verify the server alike.
"""

from __future__ import annotations

import http.client
import os
import ssl
import sys

from gpufleet.errors import ConfigError, GpufleetError, ServerUnavailable, UntrustedCertificate
from gpufleet.tokens import redact

CaPath = str | os.PathLike[str]

# OpenSSL's verify codes for "the certificate is fine, but not for this name".
_NAME_MISMATCH = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH


def context(server: str, ca: CaPath | None = None) -> ssl.SSLContext | None:
    """The context to verify ``server`` with; None for a plain-http server.

    With ``ca``, only the CA certificates in that PEM file are trusted; without it, the
    system's trust store and httpx's default (``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set,
    else certifi's public CAs), so a lab CA installed system-wide is trusted too."""
    if not server.lower().startswith("https:"):
        return None  # loading a CA bundle costs 0.1 s of every start; plain http never uses it
    if ca is None:
        # The public CAs as httpx finds them (without importing httpx for it: a CLI call
        # does not need it), then the operating system's store beside them.
        if os.environ.get("SSL_CERT_FILE"):
            ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
        elif os.environ.get("SSL_CERT_DIR"):
            ctx = ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
        else:
            import certifi

            ctx = ssl.create_default_context(cafile=certifi.where())
        ctx.load_default_certs()
        return ctx
    try:
        return ssl.create_default_context(cafile=os.fspath(ca))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if isinstance(exc, ssl.SSLError):
            reason = f"no PEM CA certificate in it ({exc.reason or exc})"
        raise ConfigError(
            f"CA file {os.fspath(ca)} (--ca / GPUFLEET_CA): cannot load it: {reason}; "
            "give a readable PEM file holding the CA certificate that signed the server's one",
            detail={"setting": "ca"},
        ) from exc


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of ``kind`` in ``exc``'s chain (httpx wraps ssl errors twice)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _plain(text: object) -> str:
    return str(text).strip().rstrip(".")


def transport_error(server: str, exc: BaseException) -> GpufleetError:
    """What a failed connection to ``server`` means, as one error a user can act on
    (anything token-shaped in it, such as a rejected header, cut to its hint)."""
    error = _transport_error(server, exc)
    error.message = redact(error.message)
    return error


def _transport_error(server: str, exc: BaseException) -> GpufleetError:
    bad = _cause(exc, ssl.SSLCertVerificationError)
    if isinstance(bad, ssl.SSLCertVerificationError):
        head = (
            f"the TLS certificate of the gpufleet server at {server} could not be verified "
            f"({_plain(bad.verify_message or bad.reason or bad)})"
        )
        if bad.verify_code in _NAME_MISMATCH:
            return UntrustedCertificate(
                f"{head}: call the server by a name or address its certificate holds "
                "(--server / GPUFLEET_SERVER), or have the certificate issued for this one"
            )
        return UntrustedCertificate(
            f"{head}; if it uses a private CA, trust that CA with --ca FILE or GPUFLEET_CA "
            "(ca= in the SDK)"
        )
    base = f"cannot reach the gpufleet server at {server} ({type(exc).__name__}: {exc})"
    tls = _cause(exc, ssl.SSLError)
    if tls is not None:
        return ServerUnavailable(
            f"{base}: the TLS handshake failed; a server started without --tls-cert serves "
            "plain http://, so check the URL's scheme"
        )
    scheme, _, rest = server.partition("://")
    if scheme.lower() == "http" and _hung_up(exc):
        return ServerUnavailable(
            f"{base}; a server that serves HTTPS (--tls-cert) hangs up on plain http: "
            f"if this one does, use https://{rest}"
        )
    return ServerUnavailable(
        f"{base}; is `gpufleet server` running? "
        "Point clients at it with --server or GPUFLEET_SERVER"
    )


def _hung_up(exc: BaseException) -> bool:
    """Whether the server hung up before answering (what a TLS server does to plain http)."""
    httpx = sys.modules.get("httpx")  # only a call through httpx raises its errors
    if httpx is not None and isinstance(exc, httpx.RemoteProtocolError):
        return "without sending a response" in str(exc)
    return _cause(exc, http.client.RemoteDisconnected) is not None
