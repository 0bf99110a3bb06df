"""Checkpoints on loopback: what keeping a job's checkpoint folder costs, on a real
`gpufleet server` (SQLite) and a real `gpufleet worker`, against the raw blob transfers
measured in the same run.

    .venv/bin/python bench/checkpoints.py [--size-mib 1024] [--epochs 3] [--work-seconds 10]
                                          [--pairs 2] [--restores 3] [--tail-seconds 0]

The job rewrites one checkpoint file of ``--size-mib`` each epoch: ``--work-seconds`` of
sleep (the training: a GPU's, which leaves the host's CPU idle), then new pseudo-random
bytes written to a temporary name, ``os.replace``d into place, and a
``::gpufleet:: {"epoch": N, "checkpoint": true}`` line; after the last one it waits
``--tail-seconds`` and exits. It appends the time each file was in place to a file of the
bench's. 1 MB = 10^6 bytes. It measures:

- **sync**: from the file being in place to its snapshot being recorded by the server
  (the snapshot's ``created_at`` from ``GET /v1/jobs/{id}/checkpoints``, same clock), as
  MB/s, beside ``Client.put_blob`` of a new file of the same size: hashed while sent (as
  the CLI sends), and given its hash (the upload alone; the hash timed apart).
- **slowdown**: the same job without ``checkpoint_dir`` and with it, taking turns
  (``--pairs``): the job's wall time at the server (``started_at`` to ``finished_at``,
  which includes the worker's last sync) and the process's own (first line to exit).
- **bytes**: what the server process read (``/proc/PID/io`` rchar: its sockets and files)
  during each job, against the bytes of the snapshots it recorded.
- **restore**: ``restore()`` of the newest snapshot, called here with a ``Client`` against
  the server, beside ``Client.get_blob`` of the same blob (taking turns).
- **unchanged**: a ``FolderSync`` here on a folder of one new file: synced, synced again
  unchanged, then rewritten with the same bytes; and a job that writes the same bytes
  each epoch (the server's bytes read, and the snapshots it recorded).

Files live under the system temp dir and are mostly in the page cache, so the disk adds
mainly its fsyncs. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import psutil
from _fleet import BenchFleet, fleet

from gpufleet.client import Client
from gpufleet.domain.checkpoints import SnapFile, Snapshot
from gpufleet.wire import JobSpecModel
from gpufleet.worker.checkpoints import FolderSync, restore, snapshot_of

MB = 1_000_000
MIB = 1 << 20
WAIT = 900.0  # seconds one job may take

# The job: argv = size in MiB, epochs, seconds of work per epoch, seed, timing file,
# seconds it waits after its last checkpoint.
# The same seed gives the same bytes every epoch ("unchanged"); otherwise each epoch's
# bytes are new. Its checkpoint folder is GPUFLEET_CHECKPOINT_DIR, or ./ckpt without sync.
JOB = r"""
import json, os, random, sys, time
mib, epochs, work, tail = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[6])
seed, out = sys.argv[4], sys.argv[5]
began = time.time()
folder = os.environ.get("GPUFLEET_CHECKPOINT_DIR") or "ckpt"
os.makedirs(folder, exist_ok=True)
for epoch in range(1, epochs + 1):
    time.sleep(work)
    rnd = random.Random(seed if seed.startswith("same") else f"{seed}-{epoch}")
    tmp = os.path.join(folder, "model.pt.tmp")
    with open(tmp, "wb") as f:
        for _ in range(mib):
            f.write(rnd.randbytes(1 << 20))
    os.replace(tmp, os.path.join(folder, "model.pt"))
    with open(out, "a") as t:
        t.write(json.dumps({"epoch": epoch, "written": time.time()}) + "\n")
    print("::gpufleet:: " + json.dumps({"epoch": epoch, "checkpoint": True}), flush=True)
time.sleep(tail)
with open(out, "a") as t:
    t.write(json.dumps({"began": began, "ended": time.time()}) + "\n")
"""


@dataclass
class JobRun:
    """One job's figures."""

    sync: bool
    wall: float  # started_at -> finished_at at the server
    process: float  # the job's own first line to its exit
    latencies: list[float] = field(default_factory=list)  # in place -> snapshot recorded
    server_read: int = 0  # bytes the server read from sockets and files meanwhile
    snapshot_bytes: int = 0  # bytes of the snapshots recorded
    snapshots: int = 0
    job_id: str = ""


def write_file(path: Path, size: int) -> str:
    """A new file of ``size`` random bytes; its SHA-256."""
    h = hashlib.sha256()
    with path.open("wb") as f:
        for _ in range(size // MIB):
            chunk = os.urandom(MIB)
            h.update(chunk)
            f.write(chunk)
    return h.hexdigest()


def server_reads(f: BenchFleet) -> int:
    return int(psutil.Process(f.procs[0].pid).io_counters().read_chars)


def run_job(f: BenchFleet, c: Client, args: argparse.Namespace, sync: bool, seed: str) -> JobRun:
    """Submit the job, wait for its success, and read its figures."""
    timing = f.root / f"timing-{seed}.jsonl"
    command = [sys.executable, "-c", JOB, str(args.size_mib), str(args.epochs)]
    command += [str(args.work_seconds), seed, str(timing), str(args.tail_seconds)]
    spec = JobSpecModel(
        name=f"ckpt-{seed}", command=command, outputs=[], checkpoint_dir="ckpt" if sync else None
    )
    read0 = server_reads(f)
    job_id = c.submit(spec).job.id
    deadline = time.monotonic() + WAIT
    while (job := c.job(job_id)).status not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} not done after {WAIT:.0f}s: see {f.root}")
        time.sleep(0.2)
    if job.status != "succeeded":
        raise SystemExit(f"job {job_id} {job.status}: {job.error}; see {f.root}")
    assert job.started_at is not None and job.finished_at is not None
    lines = [json.loads(line) for line in timing.read_text().splitlines()]
    written = {r["epoch"]: r["written"] for r in lines if "epoch" in r}
    own = next(r for r in lines if "began" in r)
    snaps = c.checkpoints(job_id)
    run = JobRun(
        sync,
        (job.finished_at - job.started_at).total_seconds(),
        own["ended"] - own["began"],
        server_read=server_reads(f) - read0,
        snapshot_bytes=sum(s.bytes for s in snaps),
        snapshots=len(snaps),
        job_id=job_id,
    )
    for s in snaps:
        epoch = s.progress.get("epoch")
        if epoch in written:
            run.latencies.append(s.created_at.timestamp() - written[epoch])
    return run


def uploads(f: BenchFleet, c: Client, size: int) -> dict[str, float]:
    """Seconds of ``put_blob`` for a new file hashed while sent, for one given its hash,
    and of hashing that file."""
    got: dict[str, float] = {}
    for key in ("put", "put_known"):
        path = f.root / f"{key}.bin"
        write_file(path, size)
        began = time.perf_counter()
        if key == "put":
            sent = c.put_blob(path)
        else:
            sha = hashlib.file_digest(path.open("rb"), "sha256").hexdigest()
            got["hash"] = time.perf_counter() - began
            began = time.perf_counter()
            sent = c.put_blob(path, sha)
        got[key] = time.perf_counter() - began
        assert sent.sent == size, f"{key}: sent {sent.sent} of {size} bytes"
        path.unlink()
    return got


def restores(f: BenchFleet, c: Client, job_id: str, turns: int) -> tuple[list[float], list[float]]:
    """Seconds of restore() of the job's newest snapshot and of get_blob of its blob."""
    snap = snapshot_of(c.checkpoints(job_id)[0])
    assert len(snap.files) == 1
    fast: list[float] = []
    plain: list[float] = []
    for turn in range(turns):
        root = f.root / f"restore{turn}"
        root.mkdir()
        done, _ = restore(c, snap, root, "ckpt")
        fast.append(done.seconds)
        shutil.rmtree(root)
        dest = f.root / f"get{turn}.bin"
        began = time.perf_counter()
        c.get_blob(snap.files[0].sha256, dest)
        plain.append(time.perf_counter() - began)
        dest.unlink()
    return fast, plain


def unchanged(f: BenchFleet, c: Client, size: int) -> list[tuple[str, int, bool]]:
    """A FolderSync here: (what was done, bytes it sent, whether it recorded a snapshot)
    for a new file, the folder unchanged, and the file rewritten with the same bytes."""
    posted: list[int] = []

    async def post(files: list[SnapFile], progress: dict[str, int]) -> Snapshot:
        posted.append(len(files))  # stands for the server's POST (which needs a lease)
        return Snapshot(len(posted), "bench", 1, time.time(), tuple(files), progress)

    root = f.root / "folder"
    (root / "ckpt").mkdir(parents=True)
    sync = FolderSync(root, "ckpt", c, post)
    path = root / "ckpt" / "model.pt"
    write_file(path, size)
    steps: list[tuple[str, int, bool]] = []
    for label in ("new file", "folder unchanged", "same bytes rewritten"):
        if label == "same bytes rewritten":
            data = path.read_bytes()
            (root / "ckpt" / "model.pt.tmp").write_bytes(data)
            os.replace(root / "ckpt" / "model.pt.tmp", path)
        before = len(posted)
        got = asyncio.run(sync.sync({}, settled=False))
        steps.append((label, got.bytes, len(posted) > before))
    steps.append(("FolderSync.sent_bytes in all", sync.sent_bytes, False))
    return steps


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rate(size: int, seconds: float) -> str:
    return f"{size / seconds / MB:8.1f}" if seconds > 0 else "     inf"


def print_transfers(size: int, up: dict[str, float], runs: list[JobRun]) -> None:
    lat = [x for r in runs if r.sync for x in r.latencies]
    print(f"{'':58}{'seconds':>8}{'MB/s':>9}   every one (s)")
    rows = [
        ("sync: file in place -> snapshot recorded (median)", median(lat), lat),
        ("put_blob, new file, hashed while sent", up["put"], [up["put"]]),
        ("put_blob, new file, hash given (upload alone)", up["put_known"], [up["put_known"]]),
        ("  + hashing that file first (sha256, here)", up["hash"], [up["hash"]]),
    ]
    for label, secs, each in rows:
        shown = ", ".join(f"{x:.2f}" for x in each)
        print(f"{label:58}{secs:8.2f}{rate(size, secs)}   {shown}")


def print_jobs(runs: list[JobRun]) -> None:
    print(
        f"\n{'job':10}{'wall s':>8}{'process s':>11}{'snapshots':>11}{'server read MB':>16}"
        f"{'snapshot MB':>13}"
    )
    for r in runs:
        print(
            f"{'sync' if r.sync else 'no sync':10}{r.wall:8.2f}{r.process:11.2f}{r.snapshots:11}"
            f"{r.server_read / MB:16.1f}{r.snapshot_bytes / MB:13.1f}"
        )
    on = [r for r in runs if r.sync]
    off = [r for r in runs if not r.sync]
    for key in ("wall", "process"):
        a = median([getattr(r, key) for r in off])
        b = median([getattr(r, key) for r in on])
        print(
            f"slowdown ({key}, medians): {a:.2f} -> {b:.2f} s: {100 * (b / a - 1):+.1f} %"
            f" (goal under 5 %)"
        )


def bench(args: argparse.Namespace) -> None:
    size = args.size_mib * MIB
    with fleet() as f:
        f.start_server(None)
        f.spawn("w0", "worker", "--name", "w0", "--work-dir", str(f.root / "work"))
        with Client(f.url, f.token()) as c:
            deadline = time.monotonic() + 30
            while not c.workers():
                if time.monotonic() > deadline:
                    raise SystemExit(f"the worker did not register: see {f.root}/w0.log")
                time.sleep(0.1)
            salt = os.urandom(4).hex()
            runs: list[JobRun] = []
            for pair in range(args.pairs):  # off, on, on, off, ...: the machine drifts
                for sync in (False, True) if pair % 2 == 0 else (True, False):
                    runs.append(run_job(f, c, args, sync, f"{salt}-{len(runs)}"))
                    print(f"job {len(runs)}: sync={sync} wall {runs[-1].wall:.2f} s", flush=True)
            up = uploads(f, c, size)
            last_sync = [r for r in runs if r.sync][-1]
            fast, plain = restores(f, c, last_sync.job_id, args.restores)
            steps = unchanged(f, c, size)
            same = run_job(f, c, args, True, f"same-{salt}")
        print(
            f"\n{args.size_mib} MiB checkpoint, {args.epochs} epochs of {args.work_seconds:g} s;"
            " 1 MB = 10^6 bytes\n"
        )
        print_transfers(size, up, runs)
        print_jobs(runs)
        print(
            f"\n{'restore of the newest snapshot':58}{median(fast):8.2f}{rate(size, median(fast))}"
            f"   {', '.join(f'{x:.2f}' for x in fast)}"
        )
        print(
            f"{'get_blob of its blob':58}{median(plain):8.2f}{rate(size, median(plain))}"
            f"   {', '.join(f'{x:.2f}' for x in plain)}"
        )
        print("\nunchanged files (FolderSync here, the server's put_blob):")
        for label, sent, recorded in steps:
            print(f"  {label:40}{sent:>14,} bytes sent   snapshot recorded: {recorded}")
        print(
            f"  job writing the same bytes each epoch: {same.snapshots} snapshots recorded, "
            f"server read {same.server_read / MB:.1f} MB for {size / MB:.1f} MB of new bytes "
            f"({same.snapshot_bytes / MB:.1f} MB listed)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="the checkpoint file's size")
    parser.add_argument(
        "--epochs", type=int, default=3, help="checkpoints a job writes (<= 3 kept)"
    )
    parser.add_argument("--work-seconds", type=float, default=10.0, help="an epoch's training")
    parser.add_argument(
        "--tail-seconds", type=float, default=0.0, help="the job's wait after its last checkpoint"
    )
    parser.add_argument("--pairs", type=int, default=2, help="jobs without and with sync")
    parser.add_argument("--restores", type=int, default=3, help="restores and downloads")
    bench(parser.parse_args())


if __name__ == "__main__":
    main()
