"""Session strings: how a worker tells a user "send your job here".

A worker prints one at start. It carries the server URL, the pool and the worker id, and,
only when the operator starts the worker with ``--share-token``, a submit token scoped to
that pool. ``gpufleet submit --session STRING`` then reaches exactly that worker. The text
is ``gfs1_`` and base64url of a small JSON object: opaque enough to paste whole, easy to
inspect (it is not encrypted: a string with a token in it is a secret).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from gpufleet import tokens
from gpufleet.errors import ConfigError

PREFIX = "gfs1_"
_MAX = 4096


@dataclass(frozen=True)
class Session:
    server: str
    pool: str
    worker: str
    token: str | None = None

    def encode(self) -> str:
        data = {"s": self.server, "p": self.pool, "w": self.worker}
        if self.token:
            data["t"] = self.token
        raw = json.dumps(data, separators=(",", ":")).encode()
        return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Session:
        """The session in ``text``, or ConfigError saying what is wrong with it."""
        text = text.strip()
        if not text.startswith(PREFIX):
            raise ConfigError(
                f"--session: not a gpufleet session string (it should start with {PREFIX!r}; "
                "copy the whole line the worker printed)"
            )
        if len(text) > _MAX:
            raise ConfigError(f"--session: too long ({len(text)} characters) to be a session")
        body = text[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            data = json.loads(raw)
        except (binascii.Error, ValueError):
            raise ConfigError(
                "--session: the string is damaged (cut short or changed?); copy the whole "
                "line the worker printed"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError("--session: the string is damaged (no fields in it)")
        fields = {"s": "server", "p": "pool", "w": "worker"}
        missing = [name for key, name in fields.items() if not isinstance(data.get(key), str)]
        if missing:
            raise ConfigError(f"--session: the string has no {', '.join(missing)}")
        token = data.get("t")
        if token is not None and not isinstance(token, str):
            raise ConfigError("--session: the string's token is not text")
        if token:
            token = tokens.clean(token, "--session: the session string's token")
        return cls(data["s"], data["p"], data["w"], token or None)
