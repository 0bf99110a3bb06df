"""The SLEAP adapters: sleap-nn's own progress and stop, relayed for the fleet.

``sleap-nn train`` publishes its progress over ZMQ and listens for a stop command when
given ``++trainer_config.zmq.publish_port=P ++trainer_config.zmq.controller_port=C``. It
*connects* to both ports on 127.0.0.1, so the worker binds them: a SUB socket for the
progress and a PUB socket for the commands, each on a free port picked per job, so several
SLEAP jobs share one host (one per GPU). ``epoch_end`` messages become progress records
(epoch, epochs, loss, val_loss and the rest of the logs as metrics), batch messages at most
one a second; ``gpufleet stop`` sends ``{"command": "stop"}``, after which sleap-nn ends
the epoch's current batch, keeps its model and exits 0.

A training whose run folder the fleet keeps (its ``checkpoint_dir``, as ``gpufleet sleap
train`` sets it) is run with ``++trainer_config.save_ckpt=true
++trainer_config.model_ckpt.save_last=true``: sleap-nn writes ``last.ckpt`` each epoch. On
an attempt that found the folder restored with a ``last.ckpt`` in it, the adapter adds
``++trainer_config.resume_ckpt_path=<that file>`` and sets the folder's ``best.ckpt`` and
``training_log.csv`` aside first: sleap-nn would start a new ``RUN-1`` folder beside one
holding a ``best.ckpt``, and begins its log afresh. Once the process has ended, the log is
one again (the earlier epochs' rows, then the resumed ones) and the earlier best model is
put back unless the resumed run wrote one.

``sleap-nn track --gui`` prints JSON progress lines on stdout; those become records too.
Only a worker needs pyzmq and PyYAML (``pip install 'gpufleet[sleap]'``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.domain import sleap
from gpufleet.worker.adapters import Adapter, AdapterError, Emit

LOOPBACK = "tcp://127.0.0.1"
ASK_EVERY = 1.0  # seconds between stop commands until the job has ended
DRAIN_MS = 100  # how long to wait for one more queued message when the process has ended
#: In a kept run folder, while a resumed attempt runs: the earlier attempts' log and best
#: model (in the folder, so a snapshot taken meanwhile keeps them too).
EARLIER_LOG = ".gpufleet-earlier-" + sleap.TRAINING_LOG
EARLIER_BEST = ".gpufleet-earlier-" + sleap.BEST_CKPT


def epochs_of(argv: list[str], workdir: Path) -> int | None:
    """How many epochs a train command runs: its ``trainer_config.max_epochs`` override,
    else its config's; None when neither says (or the config cannot be read)."""
    args = argv[2:] if argv[1:2] == ["train"] else argv[1:]
    said = sleap.override_value(args, sleap.MAX_EPOCHS)
    if said is not None:
        return int(said) if said.isdigit() else None
    try:
        import yaml
    except ImportError:
        return None
    try:
        path = workdir / sleap.config_of(args, "the command")
        facts = sleap.config_facts(yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
    except (OSError, ValueError, yaml.YAMLError):  # the job itself will say what is wrong
        return None
    return facts.max_epochs


def run_folder(argv: list[str], workdir: Path, kept: Path) -> Path | None:
    """A train command's run folder (``ckpt_dir/run_name`` of its overrides, in
    ``workdir``) when it lies in the kept folder ``kept``; else None."""
    args = argv[2:] if argv[1:2] == ["train"] else argv[1:]
    name = sleap.override_value(args, sleap.RUN_NAME)
    if not name:
        return None
    run = Path(
        os.path.normpath(workdir / (sleap.override_value(args, sleap.CKPT_DIR) or ".") / name)
    )
    inside = Path(os.path.normpath(kept))
    return run if run == inside or inside in run.parents else None


def set_aside(run: Path) -> Path | None:
    """Before a resumed attempt: the folder's log and best model set aside, and the
    restored ``last.ckpt`` to go on from (None: there is none; training starts over, and
    its log replaces the earlier one)."""
    settle(run)  # an earlier resumed attempt ended before it could
    for name, aside in ((sleap.TRAINING_LOG, EARLIER_LOG), (sleap.BEST_CKPT, EARLIER_BEST)):
        if (run / name).is_file():
            os.replace(run / name, run / aside)
    last = run / sleap.LAST_CKPT
    return last if last.is_file() else None


def settle(run: Path) -> None:
    """After a resumed attempt (and again harmlessly): its log joined to the earlier
    one, and the earlier best model back when the attempt wrote none."""
    earlier, log = run / EARLIER_LOG, run / sleap.TRAINING_LOG
    if earlier.is_file():
        later = log.read_text(encoding="utf-8") if log.is_file() else ""
        joined = sleap.merged_log(earlier.read_text(encoding="utf-8"), later)
        partial = run / f".tmp-{sleap.TRAINING_LOG}"  # a sync passes .tmp names over
        partial.write_text(joined, encoding="utf-8")
        os.replace(partial, log)
        earlier.unlink()
    best = run / EARLIER_BEST
    if best.is_file():
        if (run / sleap.BEST_CKPT).is_file():
            best.unlink()  # the resumed run's best is newer (see docs/sleap.md)
        else:
            os.replace(best, run / sleap.BEST_CKPT)


class TrainAdapter(Adapter):
    """``sleap-nn train``: progress from its PUB socket, stop through its controller;
    with ``run`` (its run folder, kept by the fleet) its last checkpoint saved each
    epoch, and on a ``resumed`` attempt training continued from it."""

    def __init__(
        self,
        emit: Emit,
        epochs: int | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        run: Path | None = None,
        resumed: bool = False,
    ) -> None:
        self.emit = emit
        self.progress = sleap.TrainProgress(epochs)
        self.clock = clock
        self.run = run
        self.resumed = resumed
        self.resume_from: Path | None = None  # the restored last.ckpt it goes on from
        self.aside = False  # the run folder's log and best model are set aside
        self.ports: tuple[int, int] | None = None
        self.bad = 0
        self._ctx: Any = None
        self._sub: Any = None
        self._pub: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        if self.run is not None and self.resumed:
            try:
                self.resume_from = await asyncio.to_thread(set_aside, self.run)
            except OSError as exc:
                raise AdapterError(f"the restored run folder cannot be resumed: {exc}") from exc
            self.aside = True
        try:
            import zmq
            import zmq.asyncio
        except ImportError:
            raise AdapterError(
                "this worker cannot relay sleap-nn's progress: pyzmq is not installed "
                "(pip install 'gpufleet[sleap]')"
            ) from None
        self._ctx = zmq.asyncio.Context()
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            publish = self._sub.bind_to_random_port(LOOPBACK)
            control = self._pub.bind_to_random_port(LOOPBACK)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise AdapterError(f"no free loopback port for sleap-nn's progress: {exc}") from exc
        self.ports = (publish, control)
        self._tasks.append(asyncio.create_task(self._relay()))

    def argv(self, argv: list[str]) -> list[str]:
        assert self.ports is not None, "open() first"
        publish, control = self.ports
        out = sleap.with_override(argv, sleap.PUBLISH_PORT, str(publish))
        out = sleap.with_override(out, sleap.CONTROLLER_PORT, str(control))
        if self.run is None:
            return out
        resume = None if self.resume_from is None else str(self.resume_from)
        return sleap.kept_args(out, resume)

    async def _relay(self) -> None:
        while True:
            self._take(await self._sub.recv())

    def _take(self, raw: bytes) -> None:
        """One message: a record when it makes one; one it cannot read is counted, and
        never ends the relay."""
        msg = sleap.message(raw)
        try:
            record = None if msg is None else self.progress.record(msg, self.clock())
        except (ValueError, TypeError, OverflowError):
            msg = None
        if msg is None:
            self.bad += 1
        elif record is not None:
            if msg.get("event") == "epoch_end" and self.run is not None:
                record = {**record, "checkpoint": True}  # its run folder kept at each epoch
            self.emit(record)

    def stop(self) -> bool:
        if self._pub is None:
            return False
        if not any(t.get_name() == "ask" for t in self._tasks):
            self._tasks.append(asyncio.create_task(self._ask(), name="ask"))
        return True

    async def _ask(self) -> None:
        """Send the stop command now and again every second: a PUB socket drops what it
        sends before sleap-nn's controller has connected (it connects when training is
        set up), and the job may be asked to stop before that."""
        command = json.dumps(sleap.STOP)
        while True:
            await self._pub.send_string(command)
            await asyncio.sleep(ASK_EVERY)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        # a relay that failed has said so in the worker's log; closing goes on regardless
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.aside and self.run is not None:  # the process has ended: one run again
            await asyncio.to_thread(settle, self.run)
        if self._ctx is None:
            return
        try:
            # sleap-nn flushes its last messages (train_end) before it exits: take them
            while await self._sub.poll(DRAIN_MS):
                self._take(await self._sub.recv())
        finally:
            self._ctx.destroy(linger=0)
            self._ctx = self._sub = self._pub = None


class TrackAdapter(Adapter):
    """``sleap-nn track --gui``: its JSON progress lines on stdout become records."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit

    def line(self, stream: str, line: str) -> bool:
        if stream != "stdout":
            return False
        record = sleap.track_record(line)
        if record is None:
            return False
        self.emit(record)
        return True
