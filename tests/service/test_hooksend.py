"""The webhook sender (:mod:`gpufleet.server.hooksend`) over the memory store: it connects
to the address it checked yet verifies TLS against the URL's name, refuses a name that
resolves to a refused address at send time (DNS rebinding), and gives a delivery up after
its last try."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from gpufleet.domain import webhooks
from gpufleet.domain.destinations import Address, literal
from gpufleet.server import QueueSettings
from gpufleet.server.hooks import Webhooks
from gpufleet.server.hooksend import Sender
from gpufleet.server.sharing import SharingRules
from gpufleet.store.memory import MemoryStore
from tests.hook_receiver import receiver
from tests.pki import issue, make_pki

SECRET = "s" * 32


def _sender(store: MemoryStore, names: dict[str, str], allow: tuple[str, ...]) -> Sender:
    def resolve(host: str, port: int) -> list[Address]:
        found = literal(names.get(host, host))
        return [] if found is None else [found]

    hooks = Webhooks(store, QueueSettings(webhook_allow=allow), SharingRules(), resolver=resolve)
    return Sender(store, hooks, base=0.01)


def _one(store: MemoryStore, url: str) -> None:
    store.add_webhook(
        {"id": "h-1", "scope": "user", "target": "alice", "url": url, "secret": SECRET,
         "events": ["failed"], "running_past": None, "created_by": None, "created_at": 1.0}
    )  # fmt: skip
    store.add_deliveries(
        [{"key": "k", "webhook_id": "h-1", "job_id": "j-1", "event": "failed",
          "body": '{"text": "x"}', "state": "pending", "tries": 0, "next_at": 0.0,
          "created_at": 0.0}]
    )  # fmt: skip


async def _send_once(sender: Sender, store: MemoryStore) -> str:
    (d,) = store.take_deliveries(1e12, 1, 60.0)
    async with sender.client() as client:
        await sender.send(client, d, store.webhooks()[0])
    return store.delivery_rows[d.id].state


def test_tls_is_checked_against_the_name_while_the_checked_address_is_dialled(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    cert, key = issue(tmp_path, "hooks", "DNS:hooks.test", 3)
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=str(pki.ca))
    names = {"hooks.test": "127.0.0.1", "other.test": "127.0.0.1"}
    with receiver(tls=served) as r:
        for host, state in (("hooks.test", "sent"), ("other.test", "pending")):
            store = MemoryStore()
            sender = _sender(store, names, ("hooks.test", "other.test"))
            sender.verify = trusted
            _one(store, f"https://{host}:{r.port}/hook")
            assert asyncio.run(_send_once(sender, store)) == state, host
        assert len(r.got) == 1  # the wrong name's handshake failed before any request
        assert r.got[0].headers["Host"] == f"hooks.test:{r.port}"


def test_a_name_that_now_resolves_inward_is_refused_at_send_time() -> None:
    with receiver() as r:
        store = MemoryStore()
        sender = _sender(store, {"hooks.example.org": "127.0.0.1"}, ())
        _one(store, f"http://hooks.example.org:{r.port}/hook")
        assert asyncio.run(_send_once(sender, store)) == "pending"
        assert r.got == []
        assert "loopback" in (store.delivery_rows[1].error or "")


def test_a_delivery_is_given_up_after_its_last_try() -> None:
    with receiver() as r:
        r.mode = "500"
        store = MemoryStore()
        sender = _sender(store, {}, ("127.0.0.1",))
        _one(store, f"http://127.0.0.1:{r.port}/hook")
        states = [asyncio.run(_send_once(sender, store)) for _ in range(webhooks.TRIES)]
    assert states == ["pending"] * (webhooks.TRIES - 1) + ["failed"]
    assert len(r.got) == webhooks.TRIES
    assert store.delivery_rows[1].error == "answered 500"


def test_a_jobs_own_webhook_is_forgotten_a_day_after_the_job_ended() -> None:
    store = MemoryStore()
    sender = _sender(store, {}, ())
    _one(store, "http://127.0.0.1:9/hook")  # a user's webhook: kept
    store.add_webhook(
        {"id": "h-2", "scope": "job", "target": "j-gone", "url": "http://127.0.0.1:9/",
         "secret": SECRET, "events": ["failed"], "running_past": None, "created_by": None,
         "created_at": 1.0}
    )  # fmt: skip
    sender.prune(store.webhooks())
    assert [h.id for h in store.webhooks()] == ["h-1"]
