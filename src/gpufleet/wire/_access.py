"""Blobs, uploads, tokens, the audit log and health."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from gpufleet.wire._base import Label, LabelKey, Name, PoolName, Sha256, Size, Strict, Wire

# ---- blobs ------------------------------------------------------------------------------


class BlobOut(Wire):
    sha256: str
    size: int
    created_at: datetime


class UploadCreate(Strict):
    sha256: Sha256 | None = Field(
        default=None,
        description="the blob's SHA-256; leave it out to send while hashing: the server "
        "names the blob by the hash of what it received, and the last answer says it "
        "(422 where the server's blob store needs it up front)",
    )
    size: Size


class UploadOut(Wire):
    """A resumable upload: send the bytes from ``offset`` on with PATCH."""

    id: str | None = Field(description="None when the server already had the blob")
    sha256: str | None = Field(
        description="the blob's id; None until the last byte for a session opened without it"
    )
    size: int
    offset: int
    complete: bool
    receiving: bool = Field(
        default=False,
        description="a request is sending bytes to it now (perhaps one whose client is "
        "gone, until the server notices); wait before sending from offset",
    )


# ---- tokens -----------------------------------------------------------------------------


class TokenCreate(Strict):
    name: Name
    role: Literal["admin", "operator", "submitter", "worker"]
    pools: list[PoolName] = Field(
        default_factory=list,
        max_length=100,
        description="submitter: the pools it may use (default: ['default']); worker: its "
        "one pool; admin and operator tokens see every pool and take none",
    )
    expires_days: float | None = Field(None, gt=0, le=3650)
    labels: dict[LabelKey, Label] = Field(
        default_factory=dict,
        max_length=50,
        description="worker tokens: labels every worker enrolled with it carries, whatever "
        "the worker declares (a job asking for team=nlp can then trust it)",
    )

    @model_validator(mode="after")
    def _pools_fit(self) -> TokenCreate:
        if len(",".join(self.pools)) > 200:
            raise ValueError("pools: at most 200 characters in all, commas included")
        if self.labels and self.role != "worker":
            raise ValueError("labels: only a worker token fixes labels (its workers carry them)")
        if len(json.dumps(self.labels)) > 4000:
            raise ValueError("labels: at most 4000 characters in all")
        return self


class TokenOut(Wire):
    id: str
    name: str
    role: str
    pools: list[str] = Field(description="empty: every pool")
    hint: str = Field(description="the secret's first characters, to tell tokens apart")
    labels: dict[str, str] = Field(
        default_factory=dict, description="labels its workers carry (worker tokens)"
    )
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class WhoAmI(Wire):
    id: str
    name: str
    role: str
    pools: list[str] = Field(description="empty: every pool")


class SessionCreate(Strict):
    """A dashboard sign-in: the token, pasted once; the answer sets the session cookie."""

    token: str = Field(min_length=1, max_length=200)


class SessionOut(Wire):
    id: str = Field(description="the token's id: a submitter steers the jobs it submitted")
    name: str
    role: str
    pools: list[str] = Field(description="empty: every pool")
    csrf: str | None = Field(
        description="send as X-CSRF-Token with every change made through the session cookie"
    )
    expires_at: datetime | None = None


class AuditOut(Wire):
    """A call (method, path, status), or a lifecycle event the server decided itself
    (``event``: worker.registered, worker.offline, worker.removed, lease.lost)."""

    seq: int
    at: datetime
    token_id: str | None
    token_name: str | None
    role: str | None
    address: str
    method: str | None
    path: str | None
    status: int | None
    target: str | None
    event: str | None = None
    detail: str | None = None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret. Shown once; only its hash is stored.")


class Health(Wire):
    status: Literal["ok", "degraded"] = Field(
        description="ok, or degraded: the server answers, but some calls fail (see problems)"
    )
    version: str
    database: str
    problems: list[str] = Field(
        default_factory=list,
        description="why it is degraded: e.g. its writes fail because its disk is full "
        "(they are answered 507 until space is freed)",
    )
