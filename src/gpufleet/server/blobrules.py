"""What every way a blob comes in follows, whole in one request
(:class:`gpufleet.server.blobs.BlobService`) or resumed across several
(:class:`gpufleet.server.uploads.UploadSessions`): the size limit, the hash check, and
the row that makes verified bytes a blob.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpufleet import archive
from gpufleet.errors import HashMismatch, TooLarge
from gpufleet.store import DataStore
from gpufleet.store.blobbytes import BlobBytes


@dataclass(frozen=True)
class BlobSettings:
    max_size: int = 64 << 30
    limits: archive.Limits = field(default_factory=archive.Limits)
    # A request body that sends nothing for this long is treated as gone.
    idle_timeout: float = 30.0


class BlobRules:
    """The blob files and their rows, with the checks bytes pass before they are kept."""

    def __init__(
        self,
        store: DataStore,
        storage: BlobBytes,
        settings: BlobSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.storage = storage
        self.settings = settings
        self.clock = clock

    def has(self, sha256: str) -> int | None:
        """The blob's size if the server holds it complete, else None."""
        row = self.store.get_blob(sha256)
        if row is None or not self.storage.exists(sha256):
            return None
        return row.size

    @staticmethod
    def check_length(declared: int | None, limit: int) -> None:
        """Refuse, before reading it, a body whose Content-Length is over ``limit``."""
        if declared is not None and declared > limit:
            raise TooLarge(
                f"the body ({declared} bytes) is over the limit of {limit} bytes",
                detail={"size": declared, "limit": limit},
            )

    def check_size(self, size: int) -> None:
        if size > self.settings.max_size:
            raise TooLarge(
                f"{size} bytes is over the server's blob size limit of "
                f"{self.settings.max_size} bytes (gpufleet server --max-blob-size)",
                detail={"size": size, "limit": self.settings.max_size},
            )

    @staticmethod
    def verify(sha256: str, got: str) -> None:
        """Refuse bytes that do not hash to the blob's id (422; the caller keeps nothing)."""
        if got != sha256:
            raise HashMismatch(
                f"the bytes sent hash to {got}, not {sha256}; nothing was kept",
                detail={"expected": sha256, "got": got},
            )

    def record(self, sha256: str, size: int) -> None:
        """Record the row of a blob whose verified bytes are stored: now it exists."""
        self.store.record_blob(sha256, size, self.clock())
