"""The one error shape every answer of the server takes, from a route, an exception
handler or a middleware."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from gpufleet.errors import GpufleetError
from gpufleet.tokens import redact, redact_data
from gpufleet.wire import ErrorBody, ErrorInfo


def error_info(exc: GpufleetError) -> ErrorInfo:
    """The error part of an answer to ``exc``, as the server's handler writes it."""
    return _info(exc.code, exc.message, exc.detail)


def internal_error(request_id: str) -> ErrorInfo:
    """What a client is told of a failure of the server's own: where to look."""
    message = f"internal server error (request id {request_id}); see the server log"
    return _info("internal_error", message, {"request_id": request_id})


def _info(code: str, message: str, detail: Any) -> ErrorInfo:
    return ErrorInfo(code=code, message=redact(message), detail=redact_data(detail))


def error_response(
    status: int,
    code: str,
    message: str,
    detail: Any = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An error answer. Errors echo what the client sent (a job ref, a field); one shaped
    like a token is cut to its hint, so a token pasted in the wrong place is not sent
    back."""
    body = ErrorBody(error=_info(code, message, detail))
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)
