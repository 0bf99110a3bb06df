"""Running the server process: open the store, make the first admin token, bind, serve."""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import ssl
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from gpufleet.config.credentials import load_token, load_worker_token, save_token, save_worker_token
from gpufleet.errors import ConfigError
from gpufleet.server.app import create_app
from gpufleet.server.auth import LOCAL_WORKER, Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.connections import guarded_protocol
from gpufleet.server.limits import Limits
from gpufleet.server.settings import QueueSettings
from gpufleet.store import open_store
from gpufleet.store.blobbytes import BlobBytes
from gpufleet.store.blobfiles import BlobFiles
from gpufleet.store.s3blobs import S3Blobs
from gpufleet.tokens import redact


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    data_dir: Path
    db: str | None
    queue: QueueSettings
    max_blob_size: int = 64 << 30
    limits: Limits = field(default_factory=Limits)
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, serve HTTPS
    tls_key: Path | None = None
    access_log: bool = False  # a line per request (else only 5xx and warnings are logged)
    blob_store: str | None = None  # s3://bucket/prefix; None: the data dir
    s3_endpoint: str | None = None  # an S3-compatible server's URL; None: AWS
    metrics_public: bool = False  # /metrics answers without a token
    api_docs: bool = False  # the API browser at /docs and /redoc (scripts from a CDN)


def database_url(data_dir: Path, db: str | None) -> str:
    """``db`` as given, else a SQLite file in the data dir."""
    if db:
        return db
    return f"sqlite:///{(data_dir / 'gpufleet.db').resolve()}"


def open_blob_bytes(spec: str | None, data_dir: Path, endpoint: str | None = None) -> BlobBytes:
    """The store ``--blob-store`` names: None for the data dir, ``s3://bucket/prefix`` for
    an S3-compatible object store (``endpoint``, e.g. a MinIO URL; credentials from the
    usual AWS sources: environment, ~/.aws, an instance role)."""
    if not spec:
        return BlobFiles(data_dir / "blobs")
    if spec.startswith("s3://"):
        s3 = S3Blobs.from_url(spec, endpoint)
        s3.check()
        return s3
    raise ConfigError(
        f"--blob-store {spec!r}: say s3://BUCKET[/PREFIX], or leave it out to keep blobs "
        "in the data dir"
    )


class _Encrypted(Exception):
    """Raised instead of letting OpenSSL prompt for a passphrase on the terminal."""


def _no_passphrase() -> str:
    raise _Encrypted


def _readable(path: Path, what: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from exc


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The server's TLS context from a PEM certificate (chain) and its private key, or
    None for plain http. Each problem names the file it is about."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise ConfigError(
            f"{given} needs {missing} too: HTTPS takes a certificate and its private key "
            "(or give neither to serve plain http)"
        )
    _readable(cert, "--tls-cert")
    _readable(key, "--tls-key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key, _no_passphrase)
    except _Encrypted:
        raise ConfigError(
            f"--tls-key {key}: the key is encrypted with a passphrase; give it unencrypted "
            "(readable only by the server's user)"
        ) from None
    except ssl.SSLError as exc:
        raise _cert_or_key(cert, key, exc) from exc
    return ctx


def _cert_or_key(cert: Path, key: Path, exc: ssl.SSLError) -> ConfigError:
    """Which of the two files ``load_cert_chain`` choked on."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except ssl.SSLError:
        return ConfigError(f"--tls-cert {cert}: no PEM certificate in it")
    if exc.reason == "KEY_VALUES_MISMATCH":
        return ConfigError(f"--tls-key {key}: not the private key of --tls-cert {cert}")
    return ConfigError(f"--tls-key {key}: no PEM private key in it ({exc.reason or exc})")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Redacting(logging.Formatter):
    """Another formatter's output, with anything token-shaped cut to its hint (tracebacks
    included: an exception's message may quote a request)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def redact_logs() -> None:
    """Every handler the server's logs go through redacts tokens (run after uvicorn set
    its logging up)."""
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "gpufleet"):
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler.formatter, _Redacting):
                handler.setFormatter(_Redacting(handler.formatter))


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the open claim polls first when a signal asks it to
    stop (they answer at once, so none is cut off), and exits 0 after a clean stop rather
    than dying of the signal it handled."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.on_stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled: a clean stop is exit code 0


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _warn_if_open(host: str, tls: ssl.SSLContext | None) -> None:
    """Tokens travel in every request: beyond loopback, plain http shows them to the
    network."""
    if tls is None and host not in LOOPBACK and not host.startswith("127."):
        print(
            f"warning: listening on {host} without TLS: every request's token crosses the "
            "network in clear text. Serve HTTPS with --tls-cert FILE --tls-key FILE (see "
            "docs/operate.md, TLS), or keep --host 127.0.0.1 behind a TLS proxy",
            file=sys.stderr,
            flush=True,
        )


def _local_worker_token(auth: Auth, urls: list[str]) -> None:
    """Make and save (0600, beside the admin's) the worker token this machine's workers
    run with, when none that works is saved and this machine holds this server's admin
    token: a job on the server's own machine then runs under a worker's rights, not the
    admin's. The secret is never printed."""
    secret = auth.local_worker(load_worker_token(urls[0]), load_token(urls[0]))
    if secret is None:
        return
    where = save_worker_token(urls[0], secret)
    for also in urls[1:]:
        save_worker_token(also, secret)
    print(
        f"Worker token {LOCAL_WORKER!r} (pool default) created for this machine's workers "
        f"(gpufleet worker takes it), saved to {where} (mode 0600)",
        file=sys.stderr,
        flush=True,
    )


def _urls(host: str, port: int, tls: ssl.SSLContext | None) -> list[str]:
    """The server's URL first, then the same server as the CLI may be told to call it."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    scheme = "https" if tls else "http"
    url = f"{scheme}://{shown}:{port}"
    return [url, f"{scheme}://localhost:{port}"] if shown == "127.0.0.1" else [url]


def _admin_token(auth: Auth, urls: list[str]) -> None:
    """Make and save (0600) the first admin token, when there is none yet."""
    secret = auth.ensure_admin()
    if secret is not None:
        where = save_token(urls[0], secret)
        for also in urls[1:]:
            save_token(also, secret)
        # Shown on a terminal only: a redirected stderr is a log, and secrets stay out of logs.
        note = f":\n  {secret}" if sys.stderr.isatty() else " (not shown: stderr is not a terminal)"
        print(
            f"Admin token created, saved to {where} (mode 0600){note}", file=sys.stderr, flush=True
        )


def _uvicorn_config(
    app: FastAPI, opts: ServerOptions, tls: ssl.SSLContext | None
) -> uvicorn.Config:
    """How uvicorn serves the app: the guarded protocol, the limits, the TLS context."""
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        # httptools, with caps on headers, their time and a body's stalls, and on
        # connections per address (server/connections.py); uvicorn's own settings bound
        # connections in all and idle kept-alive ones.
        http=guarded_protocol(opts.limits),
        limit_concurrency=opts.limits.max_connections or None,
        # X-Forwarded-For is believed from the proxies the operator names, and no other
        # (uvicorn's default believes any process on the server's own host)
        proxy_headers=bool(opts.limits.trusted_proxies),
        forwarded_allow_ips=list(opts.limits.trusted_proxies) or None,
        timeout_keep_alive=opts.limits.keep_alive,
        # Polls answer at once when told to stop; this bounds the other requests in flight
        # (an upload cut here keeps what arrived, and resumes).
        timeout_graceful_shutdown=10,
        # The context checked above is the one served (uvicorn would load the files again,
        # and prompt on the terminal for a key's passphrase).
        ssl_context_factory=None if tls is None else lambda _config, _default: tls,
    )


def serve(opts: ServerOptions) -> None:
    """Serve until SIGINT/SIGTERM. Prints the URL (and a fresh admin token, once)."""
    tls = tls_context(opts.tls_cert, opts.tls_key)  # a bad file stops us before anything
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    storage = open_blob_bytes(opts.blob_store, opts.data_dir, opts.s3_endpoint)
    store = open_store(database_url(opts.data_dir, opts.db))
    store.migrate()
    sock = _bind(opts.host, opts.port)
    urls = _urls(opts.host, sock.getsockname()[1], tls)
    auth = Auth(store)
    _admin_token(auth, urls)
    _local_worker_token(auth, urls)
    print(
        f"gpufleet server listening on {urls[0]} (database: {store.dialect}, "
        f"blobs: {storage.where})",
        flush=True,
    )
    _warn_if_open(opts.host, tls)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    blobs = BlobService(store, storage, BlobSettings(max_size=opts.max_blob_size))
    if opts.access_log:
        logging.getLogger("gpufleet.access").setLevel(logging.INFO)
    # Webhooks never reach the server's own port (gpufleet.domain.destinations).
    queue = replace(opts.queue, host=opts.host, own_ports=(sock.getsockname()[1],))
    app = create_app(
        store,
        queue,
        blobs,
        opts.limits,
        access_log=opts.access_log,
        metrics_public=opts.metrics_public,
        api_docs=opts.api_docs,
    )
    config = _uvicorn_config(app, opts, tls)
    redact_logs()
    # What the server built to start (modules, the app, its routes and models) lives as
    # long as the process: out of the collector's sight, a full collection walks only what
    # requests made. Walking it all took 70-130 ms, a pause every few seconds under load.
    gc.collect()
    gc.freeze()
    try:
        _Server(config, app.state.gpufleet.polls.request_stop).run(sockets=[sock])
    finally:
        store.close()
