"""Webhooks, their deliveries and the scan's cursor (:class:`~gpufleet.store.api.
WebhookStore`).

A mixin of :class:`~gpufleet.store.sql.store.SqlStore`. Every write is safe to make from
two servers at once: a delivery is inserted once per key, taken by a conditional update of
its ``next_at`` and tries, and the cursor moves only from where it was read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import StatementError

from gpufleet.store import schema as t
from gpufleet.store.rows_read import DeliveryRow, WebhookRow
from gpufleet.store.sql.base import SqlParts

_W, _D, _C = t.webhooks.c, t.webhook_deliveries.c, t.webhook_cursor.c
CURSOR = "state"


class WebhookOps(SqlParts):
    """Webhooks and their deliveries."""

    def add_webhook(self, values: Mapping[str, object]) -> None:
        row = dict(values)
        row["events"] = json.dumps(list(row["events"]))  # type: ignore[call-overload]
        try:
            with self._write() as conn:
                conn.execute(insert(t.webhooks), row)
        except StatementError as exc:  # logged upstairs: never with the URL and secret
            exc.hide_parameters = True
            raise

    def webhooks(self) -> list[WebhookRow]:
        with self._read() as conn:
            rows = conn.execute(select(t.webhooks).order_by(_W.created_at, _W.id)).all()
        return [WebhookRow.from_mapping(dict(r._mapping)) for r in rows]

    def remove_webhook(self, webhook_id: str) -> bool:
        with self._write() as conn:
            return bool(conn.execute(delete(t.webhooks).where(_W.id == webhook_id)).rowcount)

    def webhook_cursor(self) -> int | None:
        with self._read() as conn:
            found = conn.execute(select(_C.seq).where(_C.name == CURSOR)).scalar()
        return None if found is None else int(found)

    def move_webhook_cursor(self, old: int | None, new: int) -> bool:
        with self._write() as conn:
            if old is None:
                stmt = self._insert(t.webhook_cursor).on_conflict_do_nothing().returning(_C.seq)
                return conn.execute(stmt, {"name": CURSOR, "seq": new}).first() is not None
            q = update(t.webhook_cursor).where((_C.name == CURSOR) & (_C.seq == old))
            return bool(conn.execute(q.values(seq=new)).rowcount)

    def add_deliveries(self, rows: Sequence[Mapping[str, object]]) -> int:
        if not rows:
            return 0
        stmt = self._insert(t.webhook_deliveries).on_conflict_do_nothing().returning(_D.id)
        added = 0
        with self._write() as conn:
            for row in rows:  # one by one: what a skipped row returns is nothing
                added += conn.execute(stmt, dict(row)).first() is not None
        return added

    def take_deliveries(self, now: float, limit: int, hold: float) -> list[DeliveryRow]:
        due = (
            select(t.webhook_deliveries)
            .where((_D.state == "pending") & (_D.next_at <= now))
            .order_by(_D.next_at, _D.id)
            .limit(limit)
        )
        taken = []
        with self._write() as conn:
            for r in conn.execute(due).all():
                row = DeliveryRow.from_row(r)
                q = update(t.webhook_deliveries).where(
                    (_D.id == row.id) & (_D.tries == row.tries) & (_D.state == "pending")
                )
                if conn.execute(q.values(next_at=now + hold, tries=row.tries + 1)).rowcount:
                    taken.append(replace(row, tries=row.tries + 1, next_at=now + hold))
        return taken

    def end_delivery(self, delivery_id: int, state: str, next_at: float, error: str | None) -> None:
        q = update(t.webhook_deliveries).where(_D.id == delivery_id)
        values = {"state": state, "next_at": next_at, "error": error[:300] if error else None}
        with self._write() as conn:
            conn.execute(q.values(values))

    def pending_deliveries(self) -> int:
        q = select(func.count()).select_from(t.webhook_deliveries).where(_D.state == "pending")
        with self._read() as conn:
            return int(conn.execute(q).scalar() or 0)

    def prune_deliveries(self, before: float) -> int:
        q = delete(t.webhook_deliveries).where((_D.state != "pending") & (_D.created_at < before))
        with self._write() as conn:
            return int(conn.execute(q).rowcount)
