"""Each attempt's own secret: what a worker's writes for that attempt must carry.

A worker's token says which worker is calling; it does not say which of that worker's jobs
a write is for. A job's code that got hold of the token (a worker misconfigured, or running
jobs as its own user) could otherwise write another job's output, artifact or finish on
the same worker. So a claim gives the worker, with each lease, a secret for that attempt
alone: an HMAC, under a key the fleet's servers share (``server_keys``), of the job, the
attempt and the claim's time. Nothing is stored per attempt; any server of the fleet
recomputes it. The worker keeps it in its memory, which job code cannot read (it is not
dumpable, and jobs run as other users), and never hands it to a job.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading

from gpufleet.store import AccessStore

PREFIX = "gl_"  # cut from logs and answers like a token (gpufleet.tokens.redact)
KEY = "lease"


class LeaseSecrets:
    def __init__(self, store: AccessStore) -> None:
        self.store = store
        self._key: bytes | None = None
        self._lock = threading.Lock()

    def ready(self) -> None:
        """Read the fleet's lease key now (making it if no server has): later checks
        only compute."""
        self._keyed()

    def _keyed(self) -> bytes:
        if self._key is None:
            with self._lock:
                if self._key is None:
                    self._key = bytes.fromhex(self.store.server_key(KEY, secrets.token_hex(32)))
        return self._key

    def make(self, job_id: str, attempt: int, claimed_at: float) -> str:
        message = f"{job_id}\n{attempt}\n{claimed_at!r}".encode()
        mac = hmac.new(self._keyed(), message, hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def holds(self, secret: str | None, job_id: str, attempt: int, claimed_at: float) -> bool:
        """Whether ``secret`` is that attempt's (compared in constant time)."""
        if not secret:
            return False
        return hmac.compare_digest(secret, self.make(job_id, attempt, claimed_at))
