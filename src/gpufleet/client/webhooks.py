"""Checking a webhook delivery on the receiving end.

A gpufleet server signs each delivery with the webhook's secret: HMAC-SHA256 over
``"{t}.{body}"`` (``t``: the Unix time it was sent), in the header
``X-Gpufleet-Signature: t=<t>,v1=<hex>``. A receiver checks it with
:func:`verify_webhook` before it trusts the body::

    from gpufleet.client import verify_webhook

    if not verify_webhook(secret, request.headers, request.body):
        return 401
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from gpufleet.domain.webhooks import SIGNATURE_HEADER, TOLERANCE, header_value, verify


def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    tolerance: float = TOLERANCE,
    now: float | None = None,
) -> bool:
    """Whether ``body`` came, as it is, from a server holding ``secret``, signed within
    ``tolerance`` seconds of ``now`` (a replay of an old delivery is refused). The
    comparison takes constant time."""
    header = header_value(headers, SIGNATURE_HEADER)
    return verify(secret, header, body, time.time() if now is None else now, tolerance)
