"""One request/response layer shared by :class:`Client` and :class:`AsyncClient`.

Each operation is described once as a :class:`Call` (method, path, body, how to parse the
answer); the clients differ only in how they send it: :class:`AsyncClient` and a proxied
:class:`Client` through httpx, a :class:`Client` otherwise over ``http.client``
(:mod:`gpufleet.client._direct`), so that a CLI command that makes a call or two does not
import httpx. A parser reads a :class:`Reply`, which either kind of answer is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar
from urllib.parse import urlencode

from pydantic import BaseModel, TypeAdapter

from gpufleet import tokens
from gpufleet.client._tls import transport_error
from gpufleet.errors import BY_CODE, GpufleetError
from gpufleet.wire import ErrorBody, ErrorInfo

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")


class Headers(Protocol):
    """A response's headers, looked up case-insensitively."""

    def get(self, name: str, /) -> str | None: ...


class Reply(Protocol):
    """A whole answer, as a parser reads it (an ``httpx.Response`` is one)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Headers: ...

    @property
    def content(self) -> bytes: ...

    @property
    def text(self) -> str: ...


class CallFailed(Exception):
    """A call that got no answer; ``sent``: the request may have left (a broken
    connection, not a refused one), so it is not passed on to another server."""

    def __init__(self, cause: Exception, sent: bool) -> None:
        super().__init__(str(cause))
        self.cause, self.sent = cause, sent


JSON = {"Content-Type": "application/json"}  # the header of a call with a body


def _param(value: Any) -> str:
    """A query value: booleans as ``true``/``false``, None as empty."""
    if value is True or value is False:
        return "true" if value else "false"
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Reply], T]
    body: BaseModel | None = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None

    def request(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The HTTP request for this call, built by either kind of httpx client, with the
        same target and body as :mod:`gpufleet.client._direct` sends."""
        import httpx

        body = self.payload()
        extensions = (
            {} if self.timeout is None else {"timeout": httpx.Timeout(self.timeout).as_dict()}
        )
        return http.build_request(
            self.method,
            self.target(),
            content=body,
            headers=None if body is None else JSON,
            extensions=extensions,
        )

    def target(self) -> str:
        """The path with its query."""
        if not self.params:
            return self.path
        return f"{self.path}?{urlencode({k: _param(v) for k, v in self.params.items()})}"

    def payload(self) -> bytes | None:
        """The JSON body (compact, UTF-8, no NaN), or None."""
        if self.body is None:
            return None
        return json.dumps(
            self.body.model_dump(mode="json"),
            ensure_ascii=False,
            separators=(",", ":"),
            allow_nan=False,
        ).encode()


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    """One validator per answer type for the process. (The wire's models build theirs on
    first use, and so does an adapter of them: one made per call would build it again at
    every call, which once cost the worker a third of its CPU.)"""
    return TypeAdapter(tp)


def model(tp: Any) -> Callable[[Reply], Any]:
    """A parser that validates the JSON answer as ``tp``; 204 gives None."""

    def parse(resp: Reply) -> Any:
        return None if resp.status_code == 204 else _adapter(tp).validate_json(resp.content)

    return parse


def nothing(_: Reply) -> None:
    return None


def raise_for(resp: Reply) -> None:
    """Turn an error answer into the matching :class:`GpufleetError`."""
    if resp.status_code < 400:
        return
    try:
        info = ErrorBody.model_validate_json(resp.content).error
    except ValueError:
        message = f"HTTP {resp.status_code}: {resp.text[:200]}"
        info = ErrorInfo(code="http_error", message=message)
    raise error_of(resp.status_code, info)


def error_of(status: int, info: ErrorInfo) -> GpufleetError:
    """The :class:`GpufleetError` an error answer (``status``, its ``error``) stands for."""
    err = BY_CODE.get(info.code, GpufleetError)(info.message, detail=info.detail)
    err.status = status
    return err


def unreachable(base_url: str, exc: Exception) -> GpufleetError:
    """A failed connection as :class:`ServerUnavailable` (worth retrying), or as
    :class:`UntrustedCertificate` when the server's certificate failed verification."""
    return transport_error(base_url, exc)


def headers(token: str | None) -> dict[str, str]:
    """The Authorization header for ``token`` (surrounding whitespace dropped; whitespace
    or control characters inside are a ConfigError that never shows the token)."""
    return {"Authorization": f"Bearer {tokens.clean(token)}"} if token else {}
