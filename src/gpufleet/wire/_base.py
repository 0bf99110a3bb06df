"""Shared field types, the strict base model, and the one error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


def _relative(value: str) -> str:
    """A path inside the job directory: relative, no "..", no backslashes."""
    parts = value.replace("\\", "/").split("/")
    if value.startswith(("/", "\\")) or (len(value) > 1 and value[1] == ":"):
        raise ValueError("must be a path relative to the job directory")
    if ".." in parts or "\\" in value:
        raise ValueError('must stay inside the job directory (no ".." or backslashes)')
    return value


Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_no_nul)]
#: A pool: a named group of workers and the clients allowed to use them.
PoolName = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="letters, digits, '.', '_' and '-', at most 63",
    ),
]
#: A blob id: the SHA-256 of its bytes, 64 lowercase hex digits.
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256, 64 hex digits")]
RelPath = Annotated[
    str, Field(min_length=1, max_length=1000), AfterValidator(_no_nul), AfterValidator(_relative)
]
#: Sizes: up to 1 PiB.
Size = Annotated[int, Field(ge=0, le=2**50)]
Label = Annotated[str, Field(max_length=200), AfterValidator(_no_nul)]
LabelKey = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_no_nul)]
# Integers that reach the database fit a 32-bit column on every backend.
INT32 = 2**31 - 1
Attempt = Annotated[int, Field(ge=1, le=INT32)]
JobState = Literal["pending", "claimed", "running", "succeeded", "failed", "cancelled", "paused"]
#: An attempt's secret, as its lease gave it (required by the server on every write).
LeaseSecret = Annotated[
    str | None,
    Field(
        max_length=200,
        description="the attempt's secret, from its lease",
        exclude_if=lambda secret: secret is None,
    ),
]


class Wire(BaseModel):
    """Every wire model. Its validators are built when it is first used, not when it is
    imported: a CLI command pays only for the models it reads (building all of them cost
    about a third of the CLI's start)."""

    model_config = ConfigDict(defer_build=True)


def build_all() -> None:
    """Build every wire model's validators now (the server, at start: FastAPI reads their
    schemas, and its first requests should not pay for them)."""
    pending: list[type[BaseModel]] = [Wire]
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        # and no longer deferred: FastAPI's validators of them are built at once too
        model.model_config["defer_build"] = False
        if model is not Wire:
            model.model_rebuild(force=True)


class Strict(Wire):
    """Unknown fields are errors: a misspelt ``require_cuda`` must never pass silently."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ErrorInfo(Wire):
    code: str
    message: str
    detail: Any = None


class ErrorBody(Wire):
    """Every error the server answers has this shape."""

    error: ErrorInfo


#: The error answers every route may give, for the OpenAPI description.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (401, "missing, malformed, unknown or revoked token"),
        (403, "the token's role may not make this call"),
        (404, "unknown job, worker or token"),
        (409, "a stale lease, or a state that forbids the call"),
        (422, "a request the server cannot accept; detail lists each field"),
    )
}
