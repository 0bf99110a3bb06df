"""The SLEAP training adapter over real ZMQ sockets on loopback, with this test playing
sleap-nn's part (it connects, as sleap-nn does)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import yaml
import zmq
import zmq.asyncio

from gpufleet.worker.jobs import adapter_for
from gpufleet.worker.sleap import TrackAdapter, TrainAdapter, epochs_of
from tests.sleap_pkg import config


async def _relay_and_stop() -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    got: list[dict[str, Any]] = []
    now = [0.0]
    adapter = TrainAdapter(got.append, epochs=2, clock=lambda: now[0])
    await adapter.open()
    argv = adapter.argv(
        ["sleap-nn", "train", "-c", "b.yaml", "++trainer_config.zmq.publish_port=1"]
    )
    assert adapter.ports is not None
    publish, control = adapter.ports
    ctx = zmq.asyncio.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.connect(f"tcp://127.0.0.1:{publish}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{control}")
    for _ in range(400):  # PUB drops what it sends before the connection is up: probe
        await pub.send_string("not json")
        await asyncio.sleep(0.025)
        if adapter.bad:
            break
    messages = [
        {"what": "", "event": "train_begin", "logs": None, "wandb_url": None},
        {"what": "", "event": "batch_end", "epoch": 0, "batch": 0, "logs": {"loss": 1.0}},
        {"what": "", "event": "batch_end", "epoch": 0, "batch": 1, "logs": {"loss": 0.9}},
        {"what": "", "event": "epoch_end", "epoch": 0, "logs": {"loss": 0.8, "val/loss": 0.9}},
    ]
    for msg in messages:
        await pub.send_string(json.dumps(msg))
    for _ in range(100):
        if len(got) == 3:
            break
        await asyncio.sleep(0.02)
    assert adapter.stop()
    command = json.loads(await asyncio.wait_for(sub.recv_string(), 5))
    await pub.send_string(json.dumps({"event": "train_end"}))
    await asyncio.sleep(0.1)
    await adapter.close()  # takes what is still queued
    pub.close(0)
    sub.close(0)
    ctx.term()
    return got, argv, command


def test_the_train_adapter_relays_progress_and_sends_stop() -> None:
    got, argv, command = asyncio.run(_relay_and_stop())
    assert got == [
        {"message": "training started", "epochs": 2},
        {"epoch": 0, "epochs": 2, "step": 1, "message": "epoch 1/2, batch 1"},  # 2nd: sampled
        {"epoch": 1, "epochs": 2, "loss": 0.8, "val_loss": 0.9},
        {"message": "training ended", "epoch": 1},
    ]
    ports = [a for a in argv if "zmq" in a]
    assert len(ports) == 2 and "++trainer_config.zmq.publish_port=1" not in ports
    assert command == {"command": "stop"}


def test_epochs_come_from_the_override_else_the_config(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(config("bottomup", epochs=42)))
    base = ["sleap-nn", "train", "--config-name", "b.yaml", "--config-dir", "."]
    assert epochs_of(base, tmp_path) == 42
    assert epochs_of([*base, "trainer_config.max_epochs=7"], tmp_path) == 7
    assert epochs_of(["sleap-nn", "train", "-c", "gone.yaml"], tmp_path) is None
    (tmp_path / "bad.yaml").write_text("a: [")
    assert epochs_of(["sleap-nn", "train", "-c", "bad.yaml"], tmp_path) is None


def test_the_track_adapter_takes_its_progress_lines_and_leaves_the_rest() -> None:
    got: list[dict[str, Any]] = []
    adapter = adapter_for("sleap-track", ["sleap-nn", "track"], Path("."), got.append)
    assert isinstance(adapter, TrackAdapter)
    assert adapter.line("stdout", '{"n_processed": 4, "n_total": 8, "rate": 2.0, "eta": 2.0}')
    assert not adapter.line("stderr", '{"n_processed": 4, "n_total": 8}')
    assert not adapter.line("stdout", "Loading model")
    assert got == [{"step": 4, "steps": 8, "progress": 0.5, "eta_s": 2.0, "frames_per_s": 2.0}]
    plain = adapter_for(None, ["true"], Path("."), got.append)
    assert not plain.stop() and plain.argv(["true"]) == ["true"]
