"""What a token looks like: cleaning one that was read from a file or the environment,
and keeping any out of text that is shown or logged.

A gpufleet token is ``gf_`` and 43 URL-safe characters. One pasted from a terminal or
saved by an editor often carries a newline or spaces around it: those are dropped
wherever a token is read. Whitespace or control characters *inside* it are an error that
says what and where, never echoing the token. Anything token-shaped that would reach a
terminal, a log or an error answer is cut to its first seven characters (the hint
``gpufleet tokens ls`` shows), so a token pasted into the wrong place is not shown back.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from gpufleet.errors import ConfigError

PREFIX = "gf_"
HINT = 7  # characters of a token that may be shown: the prefix and four more
SESSION_PREFIX = "gfs1_"

# tokens (gf_), attempts' lease secrets (gl_, server/lease_secrets.py) and webhook secrets
# the server made (gw_, server/hooks.py)
_TOKEN = re.compile(r"g[flw]_[A-Za-z0-9_\-]{8,}")
_SESSION = re.compile(r"gfs1_[A-Za-z0-9_\-]{8,}")
_NAMES = {
    "\n": "a newline",
    "\r": "a carriage return",
    "\t": "a tab",
    " ": "a space",
    "\u00a0": "a non-breaking space",
}


def clean(token: str, where: str = "the token") -> str:
    """``token`` without surrounding whitespace; ConfigError naming the character and its
    position (counting from 1) if whitespace or a control character is inside it."""
    stripped = token.strip()
    for position, char in enumerate(stripped, 1):
        if char.isspace() or not char.isprintable() or not char.isascii():
            what = _NAMES.get(char) or (
                f"a non-ASCII character (U+{ord(char):04X})"
                if char.isprintable()
                else f"a control character (U+{ord(char):04X})"
            )
            raise ConfigError(
                f"{where}: the token contains {what} at position {position}; a token is one "
                "word of letters, digits, '_' and '-' (check how it was pasted or saved; the "
                "token is not shown here)"
            )
    return stripped


def _session(match: re.Match[str]) -> str:
    """A session string is shown as it is, unless it holds a token."""
    text = match.group()
    body = text[len(SESSION_PREFIX) :]
    try:
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (binascii.Error, ValueError):
        return text
    if isinstance(data, dict) and data.get("t"):
        return SESSION_PREFIX + "…(holds a token; not shown)"
    return text


def redact(text: str) -> str:
    """``text`` with every token-shaped word cut to its hint."""
    if PREFIX not in text and SESSION_PREFIX not in text:
        return text
    text = _SESSION.sub(_session, text)
    return _TOKEN.sub(lambda m: m.group()[:HINT] + "…", text)


def redact_data(value: Any) -> Any:
    """:func:`redact` over every string in a JSON-like value."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_data(k): redact_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(v) for v in value]
    return value
