"""Running the server process: open the store, make the first admin token, bind, serve."""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from gpufleet.config import save_token
from gpufleet.server.app import create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.queue import QueueSettings
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    data_dir: Path
    db: str | None
    queue: QueueSettings
    max_blob_size: int = 64 << 30


def database_url(data_dir: Path, db: str | None) -> str:
    """``db`` as given, else a SQLite file in the data dir."""
    if db:
        return db
    return f"sqlite:///{(data_dir / 'gpufleet.db').resolve()}"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(opts: ServerOptions) -> None:
    """Serve until SIGINT/SIGTERM. Prints the URL (and a fresh admin token, once)."""
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    store = SqlStore(database_url(opts.data_dir, opts.db))
    store.migrate()
    sock = _bind(opts.host, opts.port)
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if opts.host in ("0.0.0.0", "::", "") else opts.host
    url = f"http://{shown}:{port}"
    secret = Auth(store).ensure_admin()
    if secret is not None:
        where = save_token(url, secret)
        if shown == "127.0.0.1":  # the same server, as the CLI may be told to call it
            save_token(f"http://localhost:{port}", secret)
        # Shown on a terminal only: a redirected stderr is a log, and secrets stay out of logs.
        note = f":\n  {secret}" if sys.stderr.isatty() else " (not shown: stderr is not a terminal)"
        print(
            f"Admin token created, saved to {where} (mode 0600){note}", file=sys.stderr, flush=True
        )
    print(f"gpufleet server listening on {url} (database: {store.dialect})", flush=True)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    blobs = BlobService(
        store, BlobFiles(opts.data_dir / "blobs"), BlobSettings(max_size=opts.max_blob_size)
    )
    config = uvicorn.Config(
        create_app(store, opts.queue, blobs),
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=3,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        store.close()
