"""The webhook store (:class:`~gpufleet.store.api.WebhookStore`) on every backend:
webhooks kept and removed, the cursor moved only from where it was, a delivery written
once per key and taken once."""

from __future__ import annotations

from gpufleet.store import Store


def _hook(store: Store, hook_id: str, at: float) -> None:
    store.add_webhook(
        {
            "id": hook_id,
            "scope": "user",
            "target": "alice",
            "url": "https://hooks.example.org/T0/B0/secretpath",
            "secret": "s" * 32,
            "events": ["succeeded", "failed"],
            "running_past": None,
            "created_by": "t-1",
            "created_at": at,
        }
    )


def _delivery(key: str, at: float = 10.0) -> dict[str, object]:
    return {
        "key": key,
        "webhook_id": "h-1",
        "job_id": "j-1",
        "event": "failed",
        "body": '{"text": "x"}',
        "state": "pending",
        "tries": 0,
        "next_at": at,
        "created_at": at,
    }


def test_webhooks_are_kept_in_order_and_removed(store: Store) -> None:
    _hook(store, "h-2", 2.0)
    _hook(store, "h-1", 1.0)
    hooks = store.webhooks()
    assert [h.id for h in hooks] == ["h-1", "h-2"]
    assert hooks[0].events == ("succeeded", "failed")
    assert hooks[0].secret == "s" * 32
    assert store.remove_webhook("h-1") is True
    assert store.remove_webhook("h-1") is False
    assert [h.id for h in store.webhooks()] == ["h-2"]


def test_the_cursor_moves_only_from_where_it_was(store: Store) -> None:
    assert store.webhook_cursor() is None
    assert store.move_webhook_cursor(None, 5)
    assert not store.move_webhook_cursor(None, 9)
    assert not store.move_webhook_cursor(4, 9)
    assert store.move_webhook_cursor(5, 9)
    assert store.webhook_cursor() == 9


def test_a_delivery_is_written_once_and_taken_once(store: Store) -> None:
    assert store.add_deliveries([_delivery("k1"), _delivery("k2", 20.0)]) == 2
    assert store.add_deliveries([_delivery("k1")]) == 0
    assert store.pending_deliveries() == 2
    taken = store.take_deliveries(now=15.0, limit=10, hold=60.0)
    assert [d.key for d in taken] == ["k1"] and taken[0].tries == 1
    assert store.take_deliveries(now=15.0, limit=10, hold=60.0) == []
    store.end_delivery(taken[0].id, "pending", 16.0, "answered 500")
    again = store.take_deliveries(now=30.0, limit=10, hold=60.0)
    assert sorted(d.key for d in again) == ["k1", "k2"]
    assert {d.key: d.tries for d in again} == {"k1": 2, "k2": 1}
    for d in again:
        store.end_delivery(d.id, "sent", 30.0, None)
    assert store.pending_deliveries() == 0
    assert store.take_deliveries(now=1e12, limit=10, hold=60.0) == []
    assert store.prune_deliveries(before=15.0) == 1  # k1 (made at 10); k2 made at 20
    assert store.add_deliveries([_delivery("k1")]) == 1  # pruned: its key is free again
