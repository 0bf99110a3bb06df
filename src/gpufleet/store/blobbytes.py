"""Where blob bytes live: the data dir (:mod:`gpufleet.store.blobfiles`, the default) or an
S3-compatible object store (:mod:`gpufleet.store.s3blobs`, ``--blob-store s3://...``); the
server picks one as it starts (:func:`gpufleet.server.serve.open_blob_bytes`).

Both keep blobs content-addressed and immutable, and hold the bytes of resumable upload
sessions until they are verified. The server's policy (sizes, hashes, rows, who may read)
lives in :mod:`gpufleet.server.blobs` and :mod:`gpufleet.server.uploads`; it sees only
these interfaces. A blob becomes visible only when its row is recorded, after its bytes
are verified and stored here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, Protocol


class Busy(Exception):
    """Another request is writing (or finishing) this upload session right now."""


class ObjectWriter(Protocol):
    """The bytes of one single-request upload, not yet a blob."""

    @property
    def size(self) -> int: ...

    def write(self, data: bytes | memoryview) -> None: ...

    def commit(self, sha256: str) -> None:
        """Store what was written, already verified, as blob ``sha256`` (durably)."""

    def close(self) -> None:
        """Release the writer; bytes not committed are dropped."""


class Appender(Protocol):
    """One request's hold on a resumable session's bytes (see :class:`SessionBytes`)."""

    @property
    def size(self) -> int:
        """Bytes the session holds, this request's included."""

    @property
    def touched(self) -> float:
        """When the session's bytes were last written (its expiry counts from then)."""

    #: Whether what the session holds is what this server stored in the proof it was
    #: handed (so this server's hash of those bytes holds).
    trusted: bool

    @property
    def proof(self) -> object | None:
        """What this server stored: hand it back to :meth:`SessionBytes.appender` next
        time, with the hash of the bytes."""

    def write(self, data: bytes | memoryview) -> None: ...

    def sync(self) -> None:
        """Make what was written durable: the offset a resume starts from."""

    def revert(self, size: int) -> None:
        """A failed request: forget what it wrote past ``size`` where that can be done."""

    def rehash(self) -> hashlib._Hash | None:
        """A SHA-256 fed with the session's bytes so far, or None when they cannot be read
        back before :meth:`seal` (an object store's unfinished multipart upload)."""

    def seal(self, hasher: hashlib._Hash | None) -> str:
        """All bytes are in: the whole session's SHA-256 (``hasher``'s, else read back).
        Raises HashMismatch when the bytes kept differ from those received."""

    def promote(self, sha256: str) -> None:
        """Store the sealed, verified bytes as blob ``sha256``."""

    def discard(self) -> None:
        """End the session: drop its bytes (a promoted blob stays)."""

    def close(self) -> None: ...


class SessionBytes(Protocol):
    """The bytes of resumable upload sessions, which several servers may share. A
    session's ``sha256`` is None when the client did not give it: the blob is named by
    the hash of what arrives (only where :attr:`names_at_end`)."""

    # Whether a session may start without the blob's hash (its bytes do not live where
    # the blob will).
    names_at_end: bool

    def start(self, upload_id: str, sha256: str | None, size: int) -> None: ...

    def kept(self, upload_id: str, sha256: str | None, size: int) -> tuple[int, float]:
        """(bytes kept, when last written). FileNotFoundError when the session's bytes are
        gone (finished or aborted)."""

    def receiving(self, upload_id: str, sha256: str | None) -> bool:
        """Whether a request is writing or finishing the session right now."""

    def appender(
        self, upload_id: str, sha256: str | None, size: int, proof: object | None = None
    ) -> Appender:
        """Hold the session for one request (``proof``: the last one's, by this server).
        Busy while another request holds it, FileNotFoundError when it is gone."""

    def drop(self, upload_id: str, sha256: str | None) -> None:
        """Remove a session's bytes (abort or expiry), held by nobody."""


class BlobBytes(SessionBytes, Protocol):
    """Complete blobs, plus the bytes of upload sessions."""

    where: str  # said in logs and errors: a directory or an s3:// URL

    def exists(self, sha256: str) -> bool: ...

    def writer(self, sha256: str) -> ObjectWriter: ...

    def reader(self, sha256: str) -> AbstractContextManager[BinaryIO]:
        """The whole blob, read from its start."""

    def local_path(self, sha256: str) -> Path | None:
        """The blob's file when it is on the server's disk (served with sendfile)."""

    def chunks(self, sha256: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` (inclusive) of the blob: opened now (a failure raises
        here), read as the iterator is."""

    def clean(self, live_sessions: set[str], now: float) -> int:
        """At start: create what is needed, remove what a crash left (how many)."""
