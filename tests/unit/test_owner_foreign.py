"""Under --run-as, a GPU process of a running job's slot user is the job's, even once it
has left the job's process group: a job cannot pass for the workstation's owner and have
the jobs beside it vacated."""

from __future__ import annotations

import os
import subprocess
import sys

from gpufleet.worker.nvml import GpuReading
from gpufleet.worker.owner import foreign_processes


def test_a_process_of_a_running_jobs_slot_user_is_not_foreign() -> None:
    # A process in a session of its own, as `setsid` makes it: no job's group or parent.
    escaped = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        readings = {1: GpuReading(100, None, ((escaped.pid, 900),))}
        assert [f.pid for f in foreign_processes(readings, [])] == [escaped.pid]
        # Its user is a running job's slot user: the job's, not the owner's.
        assert foreign_processes(readings, [], {os.getuid()}) == ()
        assert [f.pid for f in foreign_processes(readings, [], {os.getuid() + 1})] == [escaped.pid]
    finally:
        escaped.kill()
        escaped.wait(10)
