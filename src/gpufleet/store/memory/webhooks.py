"""The in-memory store's webhooks and deliveries, as :mod:`gpufleet.store.sql.webhooks`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpufleet.store.memory.tables import MemoryTables
from gpufleet.store.rows_read import DeliveryRow, WebhookRow


class MemoryWebhooks(MemoryTables):
    def _init_webhooks(self) -> None:
        self.webhook_rows: dict[str, WebhookRow] = {}
        self.delivery_rows: dict[int, DeliveryRow] = {}
        self.delivery_keys: set[str] = set()
        self.cursor: int | None = None
        self.delivery_seq = 0

    def add_webhook(self, values: Mapping[str, object]) -> None:
        row: dict[str, Any] = dict(values)
        row["events"] = tuple(row["events"])
        with self._lock:
            self.webhook_rows[str(row["id"])] = WebhookRow(**row)

    def webhooks(self) -> list[WebhookRow]:
        with self._lock:
            return sorted(self.webhook_rows.values(), key=lambda w: (w.created_at, w.id))

    def remove_webhook(self, webhook_id: str) -> bool:
        with self._lock:
            return self.webhook_rows.pop(webhook_id, None) is not None

    def webhook_cursor(self) -> int | None:
        return self.cursor

    def move_webhook_cursor(self, old: int | None, new: int) -> bool:
        with self._lock:
            if self.cursor != old:
                return False
            self.cursor = new
            return True

    def add_deliveries(self, rows: Sequence[Mapping[str, object]]) -> int:
        added = 0
        with self._lock:
            for values in rows:
                row: dict[str, Any] = {"error": None, **values}
                if row["key"] in self.delivery_keys:
                    continue
                self.delivery_keys.add(row["key"])
                self.delivery_seq += 1
                row["id"] = self.delivery_seq
                self.delivery_rows[row["id"]] = DeliveryRow(**row)
                added += 1
        return added

    def take_deliveries(self, now: float, limit: int, hold: float) -> list[DeliveryRow]:
        with self._lock:
            due = sorted(
                (
                    d
                    for d in self.delivery_rows.values()
                    if d.state == "pending" and d.next_at <= now
                ),
                key=lambda d: (d.next_at, d.id),
            )[:limit]
            for d in due:
                self.delivery_rows[d.id] = replace(d, next_at=now + hold, tries=d.tries + 1)
            return [self.delivery_rows[d.id] for d in due]

    def end_delivery(self, delivery_id: int, state: str, next_at: float, error: str | None) -> None:
        with self._lock:
            d = self.delivery_rows[delivery_id]
            self.delivery_rows[delivery_id] = replace(
                d, state=state, next_at=next_at, error=error[:300] if error else None
            )

    def pending_deliveries(self) -> int:
        with self._lock:
            return sum(1 for d in self.delivery_rows.values() if d.state == "pending")

    def prune_deliveries(self, before: float) -> int:
        with self._lock:
            old = [
                d.id
                for d in self.delivery_rows.values()
                if d.state != "pending" and d.created_at < before
            ]
            for i in old:
                self.delivery_keys.discard(self.delivery_rows.pop(i).key)
            return len(old)
