"""The event ids a caller sees: the fleet's sequence, or opaque to a pool-scoped caller.

A job's event log and the fleet's stream number their records with one sequence for the
whole fleet (``job_logs.seq``), so the gap between two records of one pool would count
what every other pool did meanwhile. A caller that sees every pool (an admin, an
operator of every pool) gets those numbers (:data:`PLAIN`). Any other gets each one
through :class:`Opaque`: a keyed permutation of the numbers below 2^52 (a four-round
Feistel network over keyed BLAKE2b), which looks random, keeps no order and no distance,
and which the server reverses when the id comes back (``Last-Event-ID``, ``after``,
``before``). Its key is the fleet's, kept in the database (``server_keys``), so an id
one server gave resumes on any other. Ids are whole numbers either way (an opaque one
from 1 to 2^52), and 0 still means "from the start", so clients handle both alike, but
may not compare two ids for order.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Protocol

# Ids stay below 2^53, which a browser's JavaScript number holds exactly.
HALF = 26  # bits of each half of a number the permutation works on
MASK = (1 << HALF) - 1
SPACE = 1 << (2 * HALF)  # numbers it permutes: 0 to 2^52 - 1 (shown as 1 to 2^52)
MAX_SEQ = 2**63 - 1  # the largest id a client may send (a signed 64-bit integer)
ROUNDS = 4
KEY_NAME = "event-ids"


class EventIds(Protocol):
    def hide(self, seq: int) -> int:
        """The id a caller sees for record ``seq`` (0: none yet, stays 0)."""
        ...

    def show(self, shown: int) -> int:
        """The record an id the caller sent stands for (0: none, the start)."""
        ...


class Plain:
    """The fleet's own numbers, for a caller that sees every pool."""

    def hide(self, seq: int) -> int:
        return seq

    def show(self, shown: int) -> int:
        return shown


PLAIN = Plain()


class Opaque:
    """Ids that tell a pool-scoped caller nothing of other pools (see the module). The
    key is loaded once the store is reachable (:meth:`load`, at the server's start)."""

    def __init__(self) -> None:
        self._key: bytes | None = None

    @staticmethod
    def fresh_key() -> str:
        return secrets.token_hex(32)

    def load(self, key: str) -> None:
        self._key = bytes.fromhex(key)

    def hide(self, seq: int) -> int:
        if seq <= 0:
            return 0
        if seq == MAX_SEQ:  # what show() made of an id past every id: the same again
            return SPACE + 1
        if seq >= SPACE:
            raise RuntimeError(f"event {seq} is past what opaque ids can number")
        left, right = seq >> HALF, seq & MASK
        for n in range(ROUNDS):
            left, right = right, left ^ self._round(n, right)
        return (left << HALF | right) + 1

    def show(self, shown: int) -> int:
        if shown <= 0:
            return 0
        if shown > SPACE:  # past every id: past every record (``before`` a huge number)
            return MAX_SEQ
        code = shown - 1
        left, right = code >> HALF, code & MASK
        for n in reversed(range(ROUNDS)):
            left, right = right ^ self._round(n, left), left
        return left << HALF | right

    def _round(self, n: int, half: int) -> int:
        if self._key is None:
            raise RuntimeError("event ids are used before the server loaded their key")
        data = bytes([n]) + half.to_bytes(4, "big")
        digest = hashlib.blake2b(data, key=self._key, digest_size=4).digest()
        return int.from_bytes(digest, "big") & MASK
