"""How deeply a JSON body nests, found by a bracket scan before anything parses it (the
abuse limits refuse a body nested deeper than ``max_json_depth``)."""

from __future__ import annotations

import json
import re

# A JSON string, escapes included ("unrolled": linear, no backtracking blow-up).
# An unterminated string runs to the end: else each quote after it would be tried as a
# string's start, every try scanning to the end (quadratic: 64 KiB took 11 s).
_STRING = re.compile(rb'"[^"\\]*(?:\\(?:.|\Z)[^"\\]*)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _utf8(body: bytes) -> bytes:
    """``body`` as UTF-8: JSON may come as UTF-16 or -32, whose quotes hide from a byte scan."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    return body.decode(encoding, errors="replace").encode()


def nesting_depth(body: bytes, stop_above: int | None = None) -> int:
    """How deeply arrays and objects nest in the JSON text ``body`` (a scalar is 0, ``[]``
    1, ``[{}]`` 2). Brackets inside strings do not count. With ``stop_above``, the scan
    stops as soon as the depth passes it. Malformed JSON gets some number, never an error:
    the parser rejects it later."""
    brackets = _STRING.sub(b"", _utf8(body)).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        if byte in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and depth > stop_above:
                    break
        else:
            depth -= 1
    return deepest


def too_deep(body: bytes, limit: int) -> bool:
    """Whether ``body`` nests deeper than ``limit``; free for the usual small body, which
    has too few opening brackets to be that deep."""
    if body.count(b"[") + body.count(b"{") <= limit and b"\x00" not in body[:4]:
        return False
    return nesting_depth(body, stop_above=limit) > limit
