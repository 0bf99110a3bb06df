"""Choosing the machine: --auto-select, --session, --select, and a busy worker refusing.

Real server and worker processes. The GPUs come from a fake ``pynvml`` put first on each
worker's ``PYTHONPATH`` (tests/fake_nvml): the worker runs its real NVML code, and the
fake reports GPUs whose free memory differs from their size, as on a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, Proc, wait_for

pytestmark = pytest.mark.e2e

QUICK = ["--", sys.executable, "-c", "print('hello')"]
LONG = ["--", sys.executable, "-c", "import time; time.sleep(600)"]


def _session(proc: Proc) -> str:
    """The session string the worker printed at start."""
    found = wait_for(
        lambda: re.search(r"session: (gfs1_\S+)", proc.text()), 20, "the session string"
    )
    return str(found.group(1))


def _worker_of(fleet: Fleet, job_id: str) -> str:
    return str(fleet.wait_status(job_id, "succeeded")["worker"])


def _gpu_worker(fleet: Fleet, name: str, model: str, total_gib: int, free_gib: int) -> Proc:
    return fleet.start_gpu_worker(name, [(model, total_gib, free_gib)])


def _gpu_fleet(fleet: Fleet) -> dict[str, str]:
    """Four workers: an A100 80 GiB (78 free), an A100 40 GiB of which other processes use
    28 (12 free), an RTX 4090 24 GiB (22 free), a CPU box. Each worker's session string."""
    fleet.start_server()
    procs = {
        "a100-80": _gpu_worker(fleet, "a100-80", "NVIDIA A100-SXM4-80GB", 80, 78),
        "a100-40": _gpu_worker(fleet, "a100-40", "NVIDIA A100-PCIE-40GB", 40, 12),
        "rtx-24": _gpu_worker(fleet, "rtx-24", "NVIDIA GeForce RTX 4090", 24, 22),
        "cpu": fleet.start_worker("cpu"),
    }
    assert "(simulated)" not in fleet.cli("workers").stdout  # NVML's answer, not a flag
    return {name: _session(p) for name, p in procs.items()}


def test_auto_select_session_and_a_busy_worker(fleet: Fleet) -> None:
    sessions = _gpu_fleet(fleet)
    # The 80 GiB card is the biggest, but a job holds it: it is not free memory.
    busy = fleet.cli("submit", "--worker", "a100-80", "--require-cuda", *LONG).stdout.split()[-1]
    fleet.wait_status(busy, "running")

    listed = fleet.cli("workers").stdout
    assert re.search(r"a100-80 .*busy .*A100-SXM4-80GB 78\.0/80 GiB", listed), listed
    assert re.search(r"a100-40 .*available .*A100-PCIE-40GB 12\.0/40 GiB", listed), listed
    rows = {w["name"]: w for w in json.loads(fleet.cli("workers", "--json").stdout)}
    assert rows["a100-80"]["status"] == "busy" and rows["a100-80"]["running"] == [busy]
    assert rows["cpu"]["status"] == "available"

    # --auto-select: the available worker with the most *free* GPU memory: the 24 GiB card
    # (22 free), not the bigger A100 that others fill (12 free), nor the busy 80 GiB one.
    picked = fleet.cli("submit", "--auto-select", "--require-cuda", *QUICK)
    said = " ".join(picked.stderr.split())
    assert "worker rtx-24" in said and "chosen: GPU 0 (RTX 4090 24 GiB), 22.0 GiB free" in said
    assert _worker_of(fleet, picked.stdout.split()[-1]) == "rtx-24"
    # --min-gpu-memory (MiB, free) filters: 12000 leaves both; 23000 nobody free now.
    picked = fleet.cli("submit", "--auto-select", "--min-gpu-memory", "12000", *QUICK)
    assert _worker_of(fleet, picked.stdout.split()[-1]) == "rtx-24"
    none = fleet.cli("submit", "--auto-select", "--min-gpu-memory", "23000", *QUICK, check=False)
    assert none.returncode != 0 and "no worker" in none.stderr, none.stderr
    assert "a100-40: needs 1 free GPU(s) with 23000 MiB (22.5 GiB) free" in " ".join(
        none.stderr.split()
    )
    # More than any GPU has: said in the MiB it was asked in, never queued.
    never = fleet.cli(
        "submit", "--auto-select", "--queue", "--min-gpu-memory", "100000", *QUICK, check=False
    )
    message = " ".join(never.stderr.split())
    assert never.returncode != 0 and "no worker could ever run this job on a GPU" in message
    assert "needs 100000 MiB (97.7 GiB) VRAM per GPU; largest GPU has 80.0 GiB" in message

    # --session reaches exactly the worker that printed it, not the one with more memory.
    sent = fleet.cli("submit", "--session", sessions["a100-40"], "--require-cuda", *QUICK)
    assert _worker_of(fleet, sent.stdout.split()[-1]) == "a100-40"
    sent = fleet.cli("submit", "--session", sessions["cpu"], *QUICK)
    assert _worker_of(fleet, sent.stdout.split()[-1]) == "cpu"

    # A busy worker refuses, says so, and suggests where to look; nothing is queued.
    before = len(json.loads(fleet.cli("jobs", "--json").stdout))
    refused = fleet.cli("submit", "--session", sessions["a100-80"], *QUICK, check=False)
    assert refused.returncode != 0
    message = " ".join(refused.stderr.split())
    assert "a100-80 is busy" in message and busy in message, message
    assert "gpufleet workers" in message and "--auto-select" in message, message
    assert "--queue" in message
    assert len(json.loads(fleet.cli("jobs", "--json").stdout)) == before
    # --queue says to wait for it (a GPU job: it waits for the GPU the long job holds).
    queued = fleet.cli(
        "submit", "--worker", "a100-80", "--queue", "--require-cuda", *QUICK
    ).stdout.split()[-1]
    assert fleet.job(queued)["status"] == "pending"
    fleet.cli("cancel", busy)
    assert _worker_of(fleet, queued) == "a100-80"


def _answer_at_a_terminal(
    fleet: Fleet, args: list[str], answers: list[bytes], columns: int = 160
) -> str:
    """Run the CLI on a pseudo-terminal (stdin and stderr) ``columns`` wide, answering
    each prompt in turn; what the terminal showed. Bounded: 60 s in all."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet", *args],
        env={**fleet.env, "TERM": "xterm-256color", "COLUMNS": str(columns)},
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=secondary,
    )
    os.close(secondary)
    shown = bytearray()
    pending = list(answers)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):
                    shown.extend(os.read(primary, 65536))
            prompts = shown.count(b"to quit): ")
            if pending and prompts > len(answers) - len(pending):
                os.write(primary, pending.pop(0))
        assert proc.poll() is not None, "the CLI did not finish:\n" + shown.decode(errors="replace")
        out = proc.stdout.read().decode() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
        os.close(primary)
    assert proc.returncode == 0, shown.decode(errors="replace")
    return shown.decode(errors="replace") + out


def test_select_at_a_terminal_picks_the_chosen_worker(fleet: Fleet) -> None:
    _gpu_fleet(fleet)
    # The list is ordered by the free memory of the GPU the job gets: a100-80 (78), rtx-24
    # (22), a100-40 (12); cpu cannot (it needs CUDA). "r" lists them again; "2" picks the
    # second. At 80 columns each worker is one line.
    shown = _answer_at_a_terminal(
        fleet, ["submit", "--select", "--require-cuda", *QUICK], [b"r\n", b"2\n"], columns=80
    )
    assert shown.count("to quit): ") == 2, shown
    table = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.split("to quit): ")[0])
    lines = [line for line in table.splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines), table
    names = re.compile(r"\b(a100-80|a100-40|rtx-24)\b")
    rows = [line for line in lines if names.search(line)]
    order = [m[1] for line in rows if (m := names.search(line))]
    assert order == ["a100-80", "rtx-24", "a100-40"], table
    assert "GPU 0 (A100-SXM4-80GB 80 GiB), 78.0 GiB free" in rows[0], table
    assert "cpu: needs a GPU" in " ".join(shown.split()), shown
    job_id = shown.split()[-1]
    assert _worker_of(fleet, job_id) == "rtx-24"


def test_auto_select_takes_the_best_single_gpu_and_never_a_cpu_slot(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_gpu_worker("two-24", [("NVIDIA GeForce RTX 4090", 24, 24)] * 2)
    fleet.start_gpu_worker("one-40", [("NVIDIA A100-PCIE-40GB", 40, 40)])
    fleet.start_worker("laptop")
    # A job gets one GPU, not a worker's sum: one 40 GiB GPU beats two of 24 (48 in all).
    picked = fleet.cli("submit", "--auto-select", *QUICK)
    said = " ".join(picked.stderr.split())
    assert "worker one-40" in said and "GPU 0 (A100-PCIE-40GB 40 GiB), 40.0 GiB free" in said
    assert _worker_of(fleet, picked.stdout.split()[-1]) == "one-40"

    # Every GPU busy, the laptop idle: --auto-select does not put the job in its CPU slot.
    holders = [
        fleet.cli("submit", "--worker", name, *LONG).stdout.split()[-1]
        for name in ("two-24", "two-24", "one-40")
    ]
    for job_id in holders:
        fleet.wait_status(job_id, "running")
    before = len(json.loads(fleet.cli("jobs", "--json").stdout))
    refused = fleet.cli("submit", "--auto-select", *QUICK, check=False)
    message = " ".join(refused.stderr.split())
    assert refused.returncode != 0 and "can start this job on a GPU now" in message, message
    assert "laptop: no GPU" in message and "--queue" in message and "--cpu" in message
    assert len(json.loads(fleet.cli("jobs", "--json").stdout)) == before

    # --queue waits for the first GPU that frees; the idle laptop never takes it.
    queued = fleet.cli("submit", "--auto-select", "--queue", *QUICK)
    assert "queued for the first that frees" in queued.stderr, queued.stderr
    job_id = queued.stdout.split()[-1]
    time.sleep(2)  # the laptop polls every half second meanwhile
    assert fleet.job(job_id)["status"] == "pending"
    fleet.cli("cancel", holders[2])
    done = fleet.wait_status(job_id, "succeeded", "failed")
    assert (done["status"], done["worker"], done["gpus"]) == ("succeeded", "one-40", [0])
    for holder in holders[:2]:  # ended now: the workers then stop at once
        fleet.cli("cancel", holder)
    for holder in holders[:2]:
        fleet.wait_status(holder, "cancelled")


def test_select_off_a_terminal_says_how_else(fleet: Fleet) -> None:
    fleet.start_server()
    res = fleet.cli("submit", "--select", *QUICK, check=False)
    assert res.returncode != 0 and "--auto-select" in res.stderr


def test_session_with_a_token_reaches_the_worker_and_stays_out_of_argv(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    share = fleet.cli("tokens", "create", "--name", "share", "--role", "submitter")
    token = share.stdout.strip()
    proc = fleet.start_worker("shared", "--share-token", env_extra={"GPUFLEET_SHARE_TOKEN": token})
    # Off a terminal the string holds a secret, so it goes to a 0600 file, not the log.
    wait_for(lambda: "session string" in proc.text(), 20, "the session file")
    assert token not in proc.text()
    path = Path(re.search(r"not printed here\): (\S+)", proc.text()).group(1))  # type: ignore[union-attr]
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text().strip()
    # Passed on the command line it is refused (tokens never go in argv)...
    refused = fleet.cli("submit", "--session", text, *QUICK, check=False)
    assert refused.returncode != 0 and "GPUFLEET_SESSION" in refused.stderr
    # ...from a file or the environment, it works with no other token configured at all.
    bare = {"GPUFLEET_CONFIG_DIR": str(tmp_path / "empty"), "GPUFLEET_SERVER": "http://nowhere"}
    job = fleet.cli("submit", "--session", f"@{path}", *QUICK, env=bare).stdout.split()[-1]
    assert _worker_of(fleet, job) == "shared"
    job = fleet.cli("submit", *QUICK, env={**bare, "GPUFLEET_SESSION": text}).stdout.split()[-1]
    assert _worker_of(fleet, job) == "shared"


def test_a_session_for_another_server_never_gets_your_token(fleet: Fleet) -> None:
    """A session string is pasted from chat and names any server it likes: without a
    token of its own, it must not make the CLI send the user's token there."""
    from gpufleet.client.session import Session

    fleet.start_server()
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(1)
        trap.settimeout(0.5)
        elsewhere = f"http://127.0.0.1:{trap.getsockname()[1]}"
        text = Session(elsewhere, "default", "w-000000000000").encode()
        res = fleet.cli("submit", "--session", text, *QUICK, check=False)
        assert res.returncode != 0
        message = " ".join(res.stderr.split())
        assert "only ever sent to its own server" in message and elsewhere in message
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing connected
