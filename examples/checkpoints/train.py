"""A small training job that resumes from its checkpoint (standard library only).

It "trains" for ``--epochs`` epochs of ``--epoch-seconds`` each. After every epoch it
writes ``state.json`` in its checkpoint folder, ``$GPUFLEET_CHECKPOINT_DIR`` under
gpufleet (``./checkpoints`` outside it), the safe way: to ``state.json.tmp`` first,
flushed to disk, then renamed over ``state.json``. The worker skips ``*.tmp`` names, so
the fleet only ever keeps a whole checkpoint. Its progress line after each save says
``"checkpoint": true``: the worker keeps the folder at once, without waiting for it to
settle.

How it resumes: when it starts and finds ``state.json``, it continues with the epoch
after the one saved there, and prints ``resumed from epoch X``. gpufleet restores the
latest snapshot into the folder before a later attempt starts, on any worker, so the
script needs no other logic. ``trained`` in the state lists each (epoch, attempt) pair,
so a test can check that no epoch was trained twice.

On SIGTERM or SIGUSR1 (a grace signal) it writes the checkpoint of its last completed
epoch again, prints ``grace signal: checkpoint saved at epoch X`` and exits 128 + the
signal's number (143 for SIGTERM). At the end it writes ``outputs/final.json``.

Faults for tests: ``--fail-at-epoch K`` exits 1 when epoch K starts, on an attempt that
did not resume; ``--oom-at-epoch K`` does the same with PyTorch's CUDA out-of-memory
message, when ``CUDA_VISIBLE_DEVICES`` names a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. "
    "GPU 0 has a total capacity of 24.00 GiB of which 1.50 GiB is free."
)
signalled: list[int] = []


def on_signal(signum: int, _frame: object) -> None:
    signalled.append(signum)


def write_state(folder: Path, state: dict[str, Any]) -> None:
    """Write state.json whole or not at all: a temp name, fsync, then a rename."""
    tmp = folder / "state.json.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / "state.json")


def train_one_epoch(seconds: float) -> bool:
    """Sleep in small steps; False when a signal came meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if signalled:
            return False
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
    return not signalled


def grace_exit(folder: Path, state: dict[str, Any] | None) -> NoReturn:
    if state is not None:
        write_state(folder, state)
    epoch = state["epoch"] if state else 0
    print(f"grace signal: checkpoint saved at epoch {epoch}", flush=True)
    sys.exit(128 + signalled[0])


def main() -> None:
    parser = argparse.ArgumentParser(description="A small training job that resumes.")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epoch-seconds", type=float, default=1.0)
    parser.add_argument("--fail-at-epoch", type=int, default=None)
    parser.add_argument("--oom-at-epoch", type=int, default=None)
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, on_signal)

    folder = Path(os.environ.get("GPUFLEET_CHECKPOINT_DIR") or "checkpoints")
    folder.mkdir(parents=True, exist_ok=True)
    resumed = bool(os.environ.get("GPUFLEET_RESUMED"))
    has_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "-1")
    attempt = int(os.environ.get("GPUFLEET_ATTEMPT") or 1)

    state: dict[str, Any] | None = None
    if (folder / "state.json").exists():
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        print(f"resumed from epoch {state['epoch']}", flush=True)
    start = int(state["epoch"]) + 1 if state else 1
    trained: list[list[int]] = list(state["trained"]) if state else []

    for epoch in range(start, args.epochs + 1):
        if epoch == args.fail_at_epoch and not resumed:
            print(f"failing at the start of epoch {epoch}", file=sys.stderr, flush=True)
            sys.exit(1)
        if epoch == args.oom_at_epoch and has_gpu and not resumed:
            print(OOM_MESSAGE, file=sys.stderr, flush=True)
            sys.exit(1)
        if not train_one_epoch(args.epoch_seconds):
            grace_exit(folder, state)
        loss = round(2.0 * 0.8**epoch, 6)
        trained.append([epoch, attempt])
        state = {"epoch": epoch, "epochs": args.epochs, "loss": loss, "trained": trained}
        write_state(folder, state)
        said = {"epoch": epoch, "epochs": args.epochs, "loss": loss, "checkpoint": True}
        print("::gpufleet:: " + json.dumps(said))
        sys.stdout.flush()
        if signalled:
            grace_exit(folder, state)

    outputs = Path("outputs")
    outputs.mkdir(exist_ok=True)
    (outputs / "final.json").write_text(json.dumps(state), encoding="utf-8")


if __name__ == "__main__":
    main()
