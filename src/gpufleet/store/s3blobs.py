"""Blob bytes in an S3-compatible object store (AWS S3, MinIO, Ceph RGW), so that several
servers share blobs without a shared filesystem. Needs the ``s3`` extra (boto3).

::

    PREFIX/objects/ab/abcdef...      complete, verified blobs (never modified)
    PREFIX/uploads/ID/mpu            a resumable session: the id of its multipart upload
    PREFIX/uploads/ID/tail-OFFSET    the bytes a session holds past its last whole part

A session's bytes go into a multipart upload of the blob's own key. Part ``k`` always holds
bytes ``[(k-1)*P, k*P)`` of the blob, P fixed by the blob's size (:func:`part_size`), so
any server can go on with a session and two requests that resend the same bytes write the
same parts. Bytes short of a whole part are kept in a small ``tail`` object when a request
ends, and a resumed request starts from the parts plus that tail. Nothing is visible under
``objects/`` until the multipart upload is completed, which happens only after the bytes
hash to the blob's id. The server that sent every part and the tail has their hash, and
keeps it while they still carry the ETags its writes got; it completes the upload with
exactly those ETags, which S3 refuses if a part was written over since. Any other server
(after a restart or a failover, or when the ETags differ) completes the upload, reads it
back to hash it, and deletes it again when it is wrong. A row in the database, written
after that, is what makes a blob exist for clients.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

from gpufleet.errors import ConfigError, Conflict, HashMismatch, StorageUnusable
from gpufleet.store.blobbytes import Busy

MIB = 1 << 20
MIN_PART = 8 * MIB  # S3 wants 5 MiB or more for every part but the last
MAX_PARTS = 10_000  # and at most this many
# A multipart upload nobody finished for this long (a session's life plus an hour) is a
# crash's leftover.
ORPHAN_AFTER = 25 * 3600.0
T = TypeVar("T")


def part_size(size: int) -> int:
    """The part size of a blob of ``size`` bytes: 8 MiB, or more (whole MiB) to stay within
    S3's 10,000 parts. Every server derives the same from the same size."""
    per_part = -(-size // MAX_PARTS)
    return max(MIN_PART, -(-per_part // MIB) * MIB)


class S3Blobs:
    """Implements :class:`gpufleet.store.blobbytes.BlobBytes` on one bucket and prefix."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.s3, self.bucket = client, bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.where = f"s3://{bucket}/{self.prefix}"
        self._known: set[str] = set()  # blobs seen to exist (blobs are never deleted)
        self._mpus: dict[str, str] = {}  # session id -> multipart upload id
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, endpoint: str | None = None) -> S3Blobs:
        parts = urlsplit(url)
        if not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"--blob-store {url!r}: say s3://BUCKET[/PREFIX]")
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError(
                "--blob-store s3:// needs boto3: pip install 'gpufleet[s3]'"
            ) from None
        config = Config(
            max_pool_connections=32,
            connect_timeout=10,
            read_timeout=120,
            retries={"max_attempts": 5, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint else None,
        )
        client = boto3.client("s3", endpoint_url=endpoint or None, config=config)
        return cls(client, parts.netloc, parts.path)

    # ---- calls, with errors a user can act on ------------------------------------------

    def _call(
        self, what: str, fn: Callable[..., T], passed: tuple[str, ...] = (), **kwargs: Any
    ) -> T:
        """``fn(Bucket=..., **kwargs)``. A missing key or upload (or an error code in
        ``passed``) raises botocore's ClientError, for the caller to say what it means;
        any other failure StorageUnusable, naming the store and what the server did."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NoSuchUpload", *passed):
                raise
            raise _unusable(self.where, what, str(exc)) from exc
        except BotoCoreError as exc:
            raise _unusable(self.where, what, str(exc)) from exc

    def _missing(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T | None:
        """``fn``'s answer, or None when the key or upload is not there."""
        from botocore.exceptions import ClientError

        try:
            return self._call(what, fn, **kwargs)
        except ClientError:
            return None

    def _listed(self, what: str, operation: str, field: str, **kwargs: Any) -> list[Any]:
        """Every item of a listing (all its pages), with :meth:`_call`'s errors."""

        def every_page(**kw: Any) -> list[Any]:
            pages = self.s3.get_paginator(operation).paginate(**kw)
            return [item for page in pages for item in page.get(field, [])]

        return self._call(what, every_page, **kwargs)

    def check(self) -> None:
        """Fail now, with a clear message, when the bucket cannot be used."""
        from botocore.exceptions import ClientError

        try:
            self._call("checking the bucket", self.s3.head_bucket)
        except ClientError as exc:  # 404: no such bucket
            raise _unusable(self.where, "checking the bucket", str(exc)) from exc

    def key(self, sha256: str) -> str:
        return f"{self.prefix}objects/{sha256[:2]}/{sha256}"

    def _session_key(self, upload_id: str, name: str = "") -> str:
        return f"{self.prefix}uploads/{upload_id}/{name}"

    def _put(self, key: str, body: bytes) -> str:
        """Store ``body`` at ``key``; its ETag."""
        return str(self._call("storing an upload", self.s3.put_object, Key=key, Body=body)["ETag"])

    def _delete(self, key: str) -> None:
        self._missing("removing an upload", self.s3.delete_object, Key=key)

    def _new_upload(self, key: str) -> str:
        made = self._call("starting an upload", self.s3.create_multipart_upload, Key=key)
        return str(made["UploadId"])

    def _upload_part(self, key: str, mpu: str, number: int, body: bytes) -> str:
        """Store part ``number`` of a multipart upload; its ETag."""
        done = self._call(
            "storing an upload",
            self.s3.upload_part,
            Key=key,
            UploadId=mpu,
            PartNumber=number,
            Body=body,
        )
        return str(done["ETag"])

    def _complete(self, key: str, mpu: str, etags: dict[int, str], what: str) -> None:
        """Complete a multipart upload from exactly these parts: S3 refuses (InvalidPart)
        when any of them has been written over since, by bytes this server did not see;
        that keeps nothing."""
        from botocore.exceptions import ClientError

        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        try:
            self._call(
                "completing an upload",
                self.s3.complete_multipart_upload,
                passed=("InvalidPart", "InvalidPartOrder"),
                Key=key,
                UploadId=mpu,
                MultipartUpload={"Parts": parts},
            )
        except ClientError as exc:  # or NoSuchUpload: aborted or finished meanwhile
            raise HashMismatch(
                f"{what}: the object store no longer holds the parts this server sent "
                "(another request wrote over them, or ended the upload); nothing was kept, "
                "start again",
                detail={"blob_store": self.where},
            ) from exc

    def _abort(self, key: str, mpu: str) -> None:
        self._missing("aborting an upload", self.s3.abort_multipart_upload, Key=key, UploadId=mpu)

    # ---- blobs ------------------------------------------------------------------------

    def exists(self, sha256: str) -> bool:
        if sha256 in self._known:
            return True
        found = self._missing("looking for a blob", self.s3.head_object, Key=self.key(sha256))
        if found is not None:
            self._known.add(sha256)
        return found is not None

    def local_path(self, sha256: str) -> Path | None:
        return None

    def _body(self, sha256: str, **kwargs: Any) -> Any:
        """The streaming body of blob ``sha256`` (the request made now, so a failure comes
        before anything is sent on)."""
        from botocore.exceptions import ClientError

        try:
            got = self._call("reading a blob", self.s3.get_object, Key=self.key(sha256), **kwargs)
        except ClientError as exc:  # its row says it exists: removed under the server
            self._known.discard(sha256)
            raise _unusable(self.where, f"reading blob {sha256}", "it is not there") from exc
        return got["Body"]

    @contextlib.contextmanager
    def reader(self, sha256: str) -> Iterator[BinaryIO]:
        body = self._body(sha256)
        try:
            yield body
        finally:
            body.close()

    def chunks(self, sha256: str, start: int, end: int) -> Iterator[bytes]:
        body = self._body(sha256, Range=f"bytes={start}-{end}")

        def stream() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(MIB)
            finally:
                body.close()

        return stream()

    def writer(self, sha256: str) -> _PutWriter:
        return _PutWriter(self, sha256)

    def clean(self, live_sessions: set[str], now: float) -> int:
        """Check the bucket; abort multipart uploads older than a session can live (a
        server's crash mid-upload) and remove the tails of sessions that ended."""
        self.check()
        removed = 0
        objects, uploads = f"{self.prefix}objects/", f"{self.prefix}uploads/"
        unfinished = self._listed(
            "listing unfinished uploads", "list_multipart_uploads", "Uploads", Prefix=objects
        )
        for upload in unfinished:
            if upload["Initiated"].timestamp() < now - ORPHAN_AFTER:
                self._abort(upload["Key"], upload["UploadId"])
                removed += 1
        for obj in self._listed("listing sessions", "list_objects_v2", "Contents", Prefix=uploads):
            upload_id = obj["Key"][len(uploads) :].split("/")[0]
            if upload_id not in live_sessions and obj["LastModified"].timestamp() < now - 3600:
                self._delete(obj["Key"])
                removed += 1
        return removed

    # ---- resumable sessions -----------------------------------------------------------

    # A session's parts are parts of the blob's own key, which must be known at the start.
    names_at_end = False

    def start(self, upload_id: str, sha256: str | None, size: int) -> None:
        mpu = self._new_upload(self.key(_named(sha256)))
        self._put(self._session_key(upload_id, "mpu"), mpu.encode())
        with self._lock:
            self._mpus[upload_id] = mpu

    def _mpu(self, upload_id: str) -> str:
        """The session's multipart upload id; FileNotFoundError when the session is gone."""
        with self._lock:
            known = self._mpus.get(upload_id)
        if known is not None:
            return known
        got = self._missing(
            "reading an upload", self.s3.get_object, Key=self._session_key(upload_id, "mpu")
        )
        if got is None:
            raise FileNotFoundError(upload_id)
        mpu = str(got["Body"].read().decode())
        with self._lock:
            self._mpus[upload_id] = mpu
        return mpu

    def _layout(self, upload_id: str, sha256: str, size: int, read_tail: bool) -> _Layout:
        """Where a session stands: its whole parts and the tail after them (its bytes too
        with ``read_tail``). Raises Busy when its multipart upload is being finished (or a
        crash left it half finished)."""
        from botocore.exceptions import ClientError

        mpu, key, step = self._mpu(upload_id), self.key(sha256), part_size(size)
        try:
            parts = self._listed("listing parts", "list_parts", "Parts", Key=key, UploadId=mpu)
        except ClientError:
            raise Busy(upload_id) from None
        etags: dict[int, str] = {}
        touched = 0.0
        for part in parts:  # whole parts in a row from 1; a shorter one is the last
            whole = len(etags)
            if part["PartNumber"] != whole + 1 or part["Size"] != min(step, size - whole * step):
                break
            etags[part["PartNumber"]] = part["ETag"]
            touched = max(touched, part["LastModified"].timestamp())
        tail_key = self._session_key(upload_id, f"tail-{len(etags) * step}")
        read = self.s3.get_object if read_tail else self.s3.head_object
        tail = self._missing("reading an upload", read, Key=tail_key)
        if tail is None:
            return _Layout(mpu, key, step, etags, tail_key, b"", None, 0, touched)
        data = tail["Body"].read() if read_tail else b""
        touched = max(touched, tail["LastModified"].timestamp())
        size_ = int(tail["ContentLength"])
        return _Layout(mpu, key, step, etags, tail_key, data, str(tail["ETag"]), size_, touched)

    def kept(self, upload_id: str, sha256: str | None, size: int) -> tuple[int, float]:
        try:
            layout = self._layout(upload_id, _named(sha256), size, read_tail=False)
        except Busy:
            return size, 0.0
        return min(size, len(layout.etags) * layout.step + layout.tail_size), layout.touched

    def receiving(self, upload_id: str, sha256: str | None) -> bool:
        """True while a session is being finished (its multipart upload is gone but its
        record is not). Requests that write a session do not lock it: they write the same
        bytes to the same places, and the hash at the end catches any that do not."""
        from botocore.exceptions import ClientError

        try:
            self._call(
                "reading an upload",
                self.s3.list_parts,
                Key=self.key(_named(sha256)),
                UploadId=self._mpu(upload_id),
                MaxParts=1,
            )
        except ClientError:
            return True
        return False

    def appender(
        self, upload_id: str, sha256: str | None, size: int, proof: object | None = None
    ) -> _SessionParts:
        sha256 = _named(sha256)
        layout = self._layout(upload_id, sha256, size, read_tail=True)
        # What this server stored last time, still there: every part and the tail carry
        # the ETag S3 gave it for its own writes. Then its hash of them holds.
        trusted = (
            isinstance(proof, _Proof)
            and proof.tail_etag == layout.tail_etag
            and {n: proof.etags.get(n) for n in layout.etags} == layout.etags
        )
        return _SessionParts(self, upload_id, sha256, layout, trusted)

    def drop(self, upload_id: str, sha256: str | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._abort(self.key(_named(sha256)), self._mpu(upload_id))
        self._forget(upload_id)

    def _forget(self, upload_id: str) -> None:
        """Remove a session's own objects (its tails, then its record of the upload)."""
        prefix = self._session_key(upload_id)
        keys = [
            o["Key"]
            for o in self._listed("ending an upload", "list_objects_v2", "Contents", Prefix=prefix)
        ]
        keys.sort(key=lambda k: k.endswith("/mpu"))  # the record last
        for key in keys:
            self._delete(key)
        with self._lock:
            self._mpus.pop(upload_id, None)


@dataclass(frozen=True)
class _Layout:
    mpu: str
    key: str
    step: int
    etags: dict[int, str]  # the whole parts, 1..n, and their ETags
    tail_key: str
    tail: bytes  # read only when asked for
    tail_etag: str | None
    tail_size: int
    touched: float


@dataclass(frozen=True)
class _Proof:
    """What a server stored of a session: the ETags of its parts and its tail."""

    etags: dict[int, str]
    tail_etag: str | None


class _SessionParts:
    """One request's view of a session: whole parts uploaded as they fill, the rest held
    here and stored as the tail by :meth:`sync`."""

    def __init__(
        self, s3: S3Blobs, upload_id: str, sha256: str, layout: _Layout, trusted: bool
    ) -> None:
        self.s3, self.upload_id, self.sha256 = s3, upload_id, sha256
        self.layout, self.trusted, self.touched = layout, trusted, layout.touched
        self.etags = dict(layout.etags)  # every part of the upload, by this request's view
        self.buffer = bytearray(layout.tail)
        self.size = len(self.etags) * layout.step + len(self.buffer)
        self._tail_key = layout.tail_key if layout.tail else None
        self._tail_etag = layout.tail_etag
        self._sealed = self._promoted = False

    @property
    def proof(self) -> _Proof:
        return _Proof(dict(self.etags), self._tail_etag)

    def write(self, data: bytes | memoryview) -> None:
        self.buffer += data
        self.size += len(data)
        step = self.layout.step
        while len(self.buffer) >= step:
            self._add_part(bytes(self.buffer[:step]))
            del self.buffer[:step]

    def _add_part(self, body: bytes) -> None:
        number = len(self.etags) + 1
        self.etags[number] = self.s3._upload_part(self.layout.key, self.layout.mpu, number, body)

    def sync(self) -> None:
        key = self.s3._session_key(self.upload_id, f"tail-{len(self.etags) * self.layout.step}")
        self._tail_etag = self.s3._put(key, bytes(self.buffer)) if self.buffer else None
        if self._tail_key is not None and self._tail_key != key:
            self.s3._delete(self._tail_key)
        self._tail_key = key if self.buffer else None

    def revert(self, size: int) -> None:
        self.buffer.clear()  # not stored: the session goes on from what was

    def rehash(self) -> hashlib._Hash | None:
        if self.etags:  # parts of an unfinished multipart upload cannot be read back
            return None
        return hashlib.sha256(self.buffer)

    def seal(self, hasher: hashlib._Hash | None) -> str:
        if self.buffer or not self.etags:
            self._add_part(bytes(self.buffer))
            self.buffer.clear()
        if hasher is not None:
            return hasher.hexdigest()
        # Taken over from another server: the bytes must be read back to be checked, and
        # that needs the upload completed. Never over a blob already stored: that one was
        # checked, these bytes were not.
        if self.s3.exists(self.sha256):
            self.discard()
            raise Conflict(
                f"upload {self.upload_id}: the blob was stored meanwhile; ask for it again",
                detail={"upload": self.upload_id},
            )
        self._complete()
        digest = hashlib.sha256()
        with self.s3.reader(self.sha256) as f:
            while chunk := f.read(MIB):
                digest.update(chunk)
        return digest.hexdigest()

    def _complete(self) -> None:
        what = f"upload {self.upload_id}"
        self.s3._complete(self.layout.key, self.layout.mpu, self.etags, what)
        self._sealed = True

    def promote(self, sha256: str) -> None:
        if not self._sealed:  # the parts this server sent and hashed, by their ETags
            self._complete()
        self._promoted = True
        self.s3._known.add(sha256)

    def discard(self) -> None:
        if not self._sealed:
            self.s3._abort(self.layout.key, self.layout.mpu)
        elif not self._promoted:  # completed to be checked, and wrong
            self.s3._delete(self.layout.key)
            self.s3._known.discard(self.sha256)
        self.s3._forget(self.upload_id)

    def close(self) -> None:
        self.buffer = bytearray()


class _PutWriter:
    """A single-request upload: parts of a multipart upload of the blob's key as they fill
    (or one PUT when it fits in a part), completed only by :meth:`commit`."""

    def __init__(self, s3: S3Blobs, sha256: str) -> None:
        self.s3, self.key = s3, s3.key(sha256)
        self.size = 0
        self.buffer = bytearray()
        self._mpu: str | None = None
        self._etags: dict[int, str] = {}

    def write(self, data: bytes | memoryview) -> None:
        self.buffer += data
        self.size += len(data)
        while len(self.buffer) >= MIN_PART:
            self._add_part(bytes(self.buffer[:MIN_PART]))
            del self.buffer[:MIN_PART]

    def _add_part(self, body: bytes) -> None:
        if self._mpu is None:
            self._mpu = self.s3._new_upload(self.key)
        number = len(self._etags) + 1
        self._etags[number] = self.s3._upload_part(self.key, self._mpu, number, body)

    def commit(self, sha256: str) -> None:
        if self._mpu is None:
            self.s3._put(self.key, bytes(self.buffer))
        else:
            if self.buffer:
                self._add_part(bytes(self.buffer))
            self.s3._complete(self.key, self._mpu, self._etags, f"blob {sha256}")
            self._mpu = None
        self.buffer.clear()
        self.s3._known.add(sha256)

    def close(self) -> None:
        if self._mpu is not None:
            self.s3._abort(self.key, self._mpu)
            self._mpu = None
        self.buffer = bytearray()


def _named(sha256: str | None) -> str:
    """A session's blob hash: an object store's sessions always have one (the server
    refuses to start one without, see ``names_at_end``)."""
    if sha256 is None:
        raise ValueError("an object store's upload session needs the blob's SHA-256")
    return sha256


def _code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _unusable(where: str, what: str, why: str) -> StorageUnusable:
    return StorageUnusable(
        f"the object store {where} failed while {what}: {why}", detail={"blob_store": where}
    )
