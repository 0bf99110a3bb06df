"""One request/response layer shared by :class:`Client` and :class:`AsyncClient`.

Each operation is described once as a :class:`Call` (method, path, body, how to parse the
answer); the two clients differ only in how they send it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from gpufleet import tokens
from gpufleet.client._tls import transport_error
from gpufleet.errors import BY_CODE, GpufleetError
from gpufleet.wire import ErrorBody

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    body: BaseModel | None = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None

    def request(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The HTTP request for this call, built by either kind of httpx client."""
        body = None if self.body is None else self.body.model_dump(mode="json")
        extensions = (
            {} if self.timeout is None else {"timeout": httpx.Timeout(self.timeout).as_dict()}
        )
        return http.build_request(
            self.method, self.path, json=body, params=self.params or None, extensions=extensions
        )


def model(tp: Any) -> Callable[[httpx.Response], Any]:
    """A parser that validates the JSON answer as ``tp``; 204 gives None."""
    adapter: TypeAdapter[Any] = TypeAdapter(tp)

    def parse(resp: httpx.Response) -> Any:
        return None if resp.status_code == 204 else adapter.validate_json(resp.content)

    return parse


def nothing(_: httpx.Response) -> None:
    return None


def raise_for(resp: httpx.Response) -> None:
    """Turn an error answer into the matching :class:`GpufleetError`."""
    if resp.status_code < 400:
        return
    try:
        info = ErrorBody.model_validate_json(resp.content).error
        code, message, detail = info.code, info.message, info.detail
    except ValueError:
        code, message, detail = "http_error", f"HTTP {resp.status_code}: {resp.text[:200]}", None
    cls = BY_CODE.get(code, GpufleetError)
    err = cls(message, detail=detail)
    err.status = resp.status_code
    raise err


def unreachable(base_url: str, exc: Exception) -> GpufleetError:
    """A failed connection as :class:`ServerUnavailable` (worth retrying), or as
    :class:`UntrustedCertificate` when the server's certificate failed verification."""
    return transport_error(base_url, exc)


def headers(token: str | None) -> dict[str, str]:
    """The Authorization header for ``token`` (surrounding whitespace dropped; whitespace
    or control characters inside are a ConfigError that never shows the token)."""
    return {"Authorization": f"Bearer {tokens.clean(token)}"} if token else {}
