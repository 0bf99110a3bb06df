"""examples/checkpoints/train.py resumes from its checkpoint and saves on a grace signal.

The script runs as its own process, with no gpufleet server: the test plays the worker's
part (the checkpoint folder, GPUFLEET_RESUMED, a SIGTERM).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "checkpoints" / "train.py"
FAST = ["--epochs", "3", "--epoch-seconds", "0.05"]


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A job directory (the cwd) and an environment naming a checkpoint folder in it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["GPUFLEET_CHECKPOINT_DIR"] = str(tmp_path / "checkpoints")
    env["GPUFLEET_ATTEMPT"] = "1"
    return tmp_path, env


def run(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def state(cwd: Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((cwd / "checkpoints" / "state.json").read_text())
    return loaded


def progress_epochs(stdout: str) -> list[int]:
    prefix = "::gpufleet:: "
    lines = [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]
    return [json.loads(line)["epoch"] for line in lines]


def test_a_failed_first_attempt_is_resumed_at_the_next_epoch(
    job: tuple[Path, dict[str, str]],
) -> None:
    cwd, env = job
    first = run(cwd, env, *FAST, "--fail-at-epoch", "3")
    assert first.returncode == 1, first.stderr
    assert progress_epochs(first.stdout) == [1, 2]
    assert state(cwd)["epoch"] == 2
    assert not (cwd / "outputs").exists()

    second = run(cwd, {**env, "GPUFLEET_RESUMED": "1", "GPUFLEET_ATTEMPT": "2"}, *FAST)
    assert second.returncode == 0, second.stderr
    assert "resumed from epoch 2" in second.stdout
    assert progress_epochs(second.stdout) == [3]
    final = json.loads((cwd / "outputs" / "final.json").read_text())
    assert final["epoch"] == 3
    assert final["trained"] == [[1, 1], [2, 1], [3, 2]]


def test_a_fault_is_not_repeated_on_a_resumed_attempt(job: tuple[Path, dict[str, str]]) -> None:
    cwd, env = job
    gpu = {**env, "CUDA_VISIBLE_DEVICES": "0"}
    oom = run(cwd, gpu, *FAST, "--oom-at-epoch", "2")
    assert oom.returncode == 1
    assert "torch.OutOfMemoryError: CUDA out of memory." in oom.stderr
    again = run(cwd, {**gpu, "GPUFLEET_RESUMED": "1"}, *FAST, "--oom-at-epoch", "2")
    assert again.returncode == 0, again.stderr
    assert progress_epochs(again.stdout) == [2, 3]


def read_until(proc: subprocess.Popen[bytes], wanted: bytes, timeout: float) -> bytes:
    """What proc printed on stdout up to a line that starts with wanted (bounded wait)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not any(line.startswith(wanted) for line in seen.splitlines(keepends=True)[:-1]):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                raise AssertionError(f"no line {wanted!r} within {timeout}s; saw {seen!r}")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"stdout closed before {wanted!r}; saw {seen!r}")
            seen += chunk
    return seen


def test_sigterm_saves_the_last_completed_epoch_and_exits_143(
    job: tuple[Path, dict[str, str]],
) -> None:
    cwd, env = job
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--epochs", "5", "--epoch-seconds", "0.5"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        before = read_until(proc, b'::gpufleet:: {"epoch": 1,', timeout=20)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    out = (before + rest).decode()
    assert proc.returncode == 143, err.decode()
    last_completed = progress_epochs(out)[-1]
    assert last_completed in (1, 2)  # 2 only if the signal came as epoch 2 ended
    assert state(cwd)["epoch"] == last_completed
    assert f"grace signal: checkpoint saved at epoch {last_completed}" in out
    assert not (cwd / "checkpoints" / "state.json.tmp").exists()
    assert not (cwd / "outputs").exists()
