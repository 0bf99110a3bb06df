"""The session string a worker prints when it first registers: what sends a user's jobs
to it (``gpufleet submit --session STRING``)."""

from __future__ import annotations

import os
import sys

from gpufleet.client import AsyncClient
from gpufleet.client.session import Session
from gpufleet.errors import ConfigError
from gpufleet.wire import WhoAmI
from gpufleet.worker.calls import Retrying
from gpufleet.worker.log import say
from gpufleet.worker.options import WorkerOptions


async def announce(opts: WorkerOptions, retrying: Retrying, worker_id: str, pool: str) -> None:
    """Print the session string that sends a user's jobs to this worker. One with a
    token in it is a secret: it goes to a file only the worker's user can read, and,
    on a terminal, to the terminal (never to a log)."""
    token = None
    if opts.share_token:
        token = opts.share_token
        me = await retrying("check the share token", lambda: _share_check(opts))
        if me.role != "submitter" or me.pools != [pool]:
            scope = ", ".join(me.pools) or "every pool"
            raise ConfigError(
                f"--share-token: GPUFLEET_SHARE_TOKEN must be a submitter token of pool "
                f"{pool!r} only; it is a {me.role} token of {scope}"
            )
    text = Session(opts.server, pool, worker_id, token).encode()
    if token is None:
        say(f"session: {text}")
        say(f"send a job here: gpufleet submit --session {text} -- COMMAND")
        return
    path = opts.work_dir / "session"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)
    if sys.stdout.isatty():
        # Deliberately past say()'s redaction: the operator asked for this secret, and
        # a terminal is not a log. Passed on, it is taken from a file or the environment.
        print(f"session (holds a token; keep it secret): {text}", flush=True)
        say(f"it is also in {path}: gpufleet submit --session @FILE -- COMMAND")
        return
    say(f"session string (it holds a token, so it is not printed here): {path}")


async def _share_check(opts: WorkerOptions) -> WhoAmI:
    async with AsyncClient(opts.server, opts.share_token, ca=opts.ca) as c:
        return await c.whoami()
