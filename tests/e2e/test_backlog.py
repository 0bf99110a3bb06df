"""A worker cut off from its server while its job prints far more than the worker may
keep: its memory stays bounded, the output spills to disk up to --log-backlog, the oldest
is dropped, and the server, once back, shows a marker where lines went missing.
(``bench/backlog.py`` runs the same with 1 GB of output.)"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import Fleet, free_port, wait_for

LINE = "x" * 99  # 100 bytes a line with its newline
JOB = """
import os, sys, time
lines, flag = int(sys.argv[1]), sys.argv[2]
while not os.path.exists(flag + ".go"):
    time.sleep(0.05)
out = sys.stdout
for n in range(lines):
    out.write("%09d " % n + "{line}"[10:] + "\\n")
out.flush()
open(flag + ".printed", "w").close()
while not os.path.exists(flag + ".end"):
    time.sleep(0.05)
""".replace("{line}", LINE)


class PeakRss(threading.Thread):
    """The largest resident set of a process, polled every 20 ms until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self.stopping.wait(0.02)


def cut_off_while_printing(fleet: Fleet, root: Path, lines: int, backlog: str) -> dict[str, int]:
    """Run it; return the worker's memory growth, the lines the server kept and the marker
    count, for a job printing ``lines`` lines of 100 bytes while no server runs."""
    fleet.start_server("--port", str(free_port()), lease_timeout=600)
    worker = fleet.start_worker("w1", "--log-backlog", backlog)
    script, flag = root / "job.py", root / "flag"
    script.write_text(JOB)
    job_id = fleet.cli("submit", "--", "python3", str(script), str(lines), str(flag)).stdout
    job_id = job_id.split()[-1]
    fleet.wait_status(job_id, "running")
    rss = PeakRss(worker.popen.pid)
    rss.start()
    wait_for(lambda: rss.peak, 5, "a first reading")
    baseline = rss.proc.memory_info().rss
    assert fleet.server is not None
    fleet.server.stop()  # the worker is cut off
    (root / "flag.go").touch()
    wait_for((root / "flag.printed").exists, 600, "the job to print everything")
    fleet.restart_server()
    (root / "flag.end").touch()
    done = fleet.wait_status(job_id, "succeeded", "failed", timeout=300)
    rss.stopping.set()
    rss.join(5)
    assert done["status"] == "succeeded", done
    kept, markers, last = 0, 0, ""
    with fleet.client() as c:
        after = 0
        while page := c.logs(job_id, after=after, limit=100_000).lines:
            after = page[-1].seq
            for e in page:
                if e.line.startswith("[gpufleet]") and "dropped here" in e.line:
                    markers += 1
                else:
                    kept += 1
                    last = e.line
    assert last.startswith(f"{lines - 1:09d} "), last  # the newest lines are the ones kept
    return {"grew": rss.peak - baseline, "kept": kept, "markers": markers}


@pytest.mark.slow
def test_a_worker_cut_off_keeps_its_memory_bound_and_marks_what_it_dropped(
    fleet: Fleet, tmp_path: Path
) -> None:
    lines = 400_000  # 40 MB of output, with 8 MiB in memory and 16 MiB on disk at most
    got = cut_off_while_printing(fleet, tmp_path, lines, "16M")
    assert got["markers"] >= 1
    assert 0 < got["kept"] < lines * 6 // 10  # 24 MiB at most kept of 40 MB
    # everything would be ~100 MB of Python strings; the bound is 8 MiB of lines
    assert got["grew"] < 40 << 20, got
