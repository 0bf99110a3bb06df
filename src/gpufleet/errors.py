"""The one exception tree of gpufleet.

::

    GpufleetError
    ├── ConfigError            bad configuration value, with its source
    ├── ManifestError          a manifest is wrong: names the file, the job and the field
    ├── PackageError           a SLEAP package gpufleet cannot run: names the file and line
    ├── InvalidTransition      a job state change the lifecycle table does not allow
    ├── NotFound               an unknown job, worker or token          (HTTP 404)
    ├── Conflict               a stale lease or a state that forbids the call (HTTP 409)
    ├── Unauthorized           a missing or wrong token                 (HTTP 401)
    ├── Forbidden              a token whose role may not make the call (HTTP 403)
    ├── ValidationFailed       a request the server cannot accept       (HTTP 422)
    │   ├── HashMismatch       uploaded bytes do not hash to the blob id
    │   └── UnsafeArchive      an archive entry that would escape, a device, a bomb
    ├── TooLarge               a body or blob over the server's size limit (HTTP 413)
    ├── RequestTimeout         a request body stopped arriving          (HTTP 408)
    ├── InsufficientStorage    the disk filled up; nothing was kept       (HTTP 507)
    ├── StorageUnusable        the server's data dir lacks what it needs (HTTP 503)
    ├── ServerUnavailable      the server cannot be reached (client side only)
    │   └── RateLimited        too many calls at once, or too many bad tokens (HTTP 429)
    └── UntrustedCertificate   the server's TLS certificate fails verification (client side)

Every error carries a short machine ``code`` and a message that says what was wrong,
where, and what to do.
"""

from __future__ import annotations

from typing import Any


class GpufleetError(Exception):
    """Root of every error gpufleet raises on purpose."""

    code = "error"
    status = 400

    def __init__(self, message: str, *, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class ConfigError(GpufleetError):
    code = "config_error"


class ManifestError(GpufleetError):
    """A manifest is malformed; the message names the file, the job and the field."""

    code = "manifest_error"
    status = 422


class PackageError(GpufleetError, ValueError):
    """A SLEAP training package (or its script or configs) that gpufleet cannot run; the
    message names the file, the line or config, and what is wrong."""

    code = "package_error"
    status = 422


class InvalidTransition(GpufleetError):
    code = "invalid_transition"
    status = 409


class NotFound(GpufleetError):
    code = "not_found"
    status = 404


class Conflict(GpufleetError):
    code = "conflict"
    status = 409


class Unauthorized(GpufleetError):
    code = "unauthorized"
    status = 401


class Forbidden(GpufleetError):
    code = "forbidden"
    status = 403


class ValidationFailed(GpufleetError):
    code = "validation_error"
    status = 422


class HashMismatch(ValidationFailed):
    code = "hash_mismatch"


class UnsafeArchive(ValidationFailed):
    """An archive that would write outside its target, create a device, or expand past a
    limit. Nothing is left behind when this is raised."""

    code = "unsafe_archive"


class TooLarge(GpufleetError):
    code = "too_large"
    status = 413


class RequestTimeout(GpufleetError):
    code = "request_timeout"
    status = 408


class InsufficientStorage(GpufleetError):
    code = "insufficient_storage"
    status = 507


class StorageUnusable(GpufleetError):
    """The server's data dir cannot do what the server needs (file locks, say): a problem
    for its operator, not the client."""

    code = "storage_unusable"
    status = 503


class ServerUnavailable(GpufleetError):
    code = "server_unavailable"
    status = 503


class RateLimited(ServerUnavailable):
    """The server's abuse limits turned the call away for now: too many calls in flight
    for one token or worker, or too many wrong tokens from one address. A
    :class:`ServerUnavailable`, so clients wait and try again."""

    code = "rate_limited"
    status = 429


class UntrustedCertificate(GpufleetError):
    """The server's TLS certificate could not be verified. Not a :class:`ServerUnavailable`:
    retrying does not help until the client trusts the right CA or uses the right name."""

    code = "untrusted_certificate"
    status = 503


BY_CODE: dict[str, type[GpufleetError]] = {
    cls.code: cls
    for cls in (
        ConfigError,
        ManifestError,
        InvalidTransition,
        NotFound,
        Conflict,
        Unauthorized,
        Forbidden,
        ValidationFailed,
        HashMismatch,
        UnsafeArchive,
        TooLarge,
        RequestTimeout,
        InsufficientStorage,
        StorageUnusable,
        ServerUnavailable,
        RateLimited,
        UntrustedCertificate,
    )
}
