"""What a store one server has to itself offers: no other server to tell of a change or to
hear from (SQLite's file, the in-memory store). PostgreSQL, which replicas share, tells and
hears them through LISTEN/NOTIFY instead."""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpufleet.store.api import Offers


class OneServer:
    """The replica signals of a store no other server shares: each is nothing."""

    @property
    def offers(self) -> Offers:
        """One claim session at a time (one writer), and no other server to hear."""
        return Offers(claimers=1, listens=False)

    def publish_claimable(self) -> None:
        """A single server needs nothing beyond its in-process wake-up."""

    def publish_tokens_changed(self) -> None:
        """No other server caches this store's tokens."""

    def publish_superseded(self, worker_id: str, replica: str) -> None:
        """No other server holds this worker's polls."""

    def listen(
        self,
        on_notify: Callable[[], None],
        stop: threading.Event,
        on_tokens: Callable[[], None] | None = None,
        on_superseded: Callable[[str, str], None] | None = None,
    ) -> None:
        """No other server to hear."""
