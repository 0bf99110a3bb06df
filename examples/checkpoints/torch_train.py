"""The checkpoint pattern in plain PyTorch: save each epoch, resume when a checkpoint is there.

Submit it with a checkpoint folder, and any later attempt continues where this one was:

    gpufleet submit --checkpoint-dir checkpoints --require-cuda -- python torch_train.py

- ``last.pt`` in ``$GPUFLEET_CHECKPOINT_DIR`` holds the model, the optimizer, the epoch
  and the random generators' state, so a resumed run draws the batches it would have.
- It is written to ``last.pt.tmp`` and renamed: the worker skips ``*.tmp`` names, so the
  fleet never keeps half a file.
- ``gpufleet.report`` gives the fleet the epoch and the loss, and ``gpufleet.checkpoint``
  asks it to keep the new file now.
- On SIGTERM (gpufleet's grace signal by default) it ends the current batch and exits.
  The checkpoint of the last whole epoch is already written, and the worker keeps it
  when the process ends; the next attempt redoes the epoch that was cut short.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn

import gpufleet

stop = False


def on_sigterm(_signum: int, _frame: object) -> None:
    global stop
    stop = True


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, epoch: int) -> None:
    state = {
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: the old file or the new one, never half of each
    gpufleet.checkpoint()


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The last completed epoch (0 when there is no checkpoint)."""
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    print(f"resumed from epoch {state['epoch']}", flush=True)
    return int(state["epoch"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = Path(os.environ.get("GPUFLEET_CHECKPOINT_DIR", "checkpoints"))
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    y = x @ torch.randn(32, 1) + 0.1 * torch.randn(4096, 1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = load(folder / "last.pt", model, opt) + 1  # the optimizer's state follows the model

    for epoch in range(start, args.epochs + 1):
        total = 0.0
        for batch in torch.randperm(len(x)).split(256):
            xb, yb = x[batch].to(device), y[batch].to(device)
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
            if stop:
                break
        if stop:  # last.pt holds the last whole epoch; the next attempt redoes this one
            raise SystemExit(143)
        save(folder / "last.pt", model, opt, epoch)
        gpufleet.report(epoch=epoch, epochs=args.epochs, loss=total / len(x))

    Path("outputs").mkdir(exist_ok=True)
    torch.save(model.state_dict(), "outputs/model.pt")


if __name__ == "__main__":
    main()
