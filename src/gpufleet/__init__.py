"""gpufleet: run ML jobs across a mixed fleet of machines.

Inside a job, :func:`report` tells the fleet how far it is; nothing else is needed.
"""

from __future__ import annotations

import json
import os

__version__ = "0.1.0"


def report(**values: object) -> None:
    """Report progress from inside a job: one record (``epoch``/``epochs``,
    ``step``/``steps``, ``progress`` 0-1, ``eta_s``, ``message``, and any numeric
    metric such as ``loss=0.12``) appended to ``GPUFLEET_PROGRESS_FILE``. Outside a
    gpufleet job (no such variable) it does nothing."""
    if path := os.environ.get("GPUFLEET_PROGRESS_FILE"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(values) + "\n")


def checkpoint(**values: object) -> None:
    """Ask the worker to keep the job's checkpoint folder on the server now (a sync that
    does not wait for its files to settle), with an optional progress record
    (``epoch=5``) to keep with the snapshot. Call it once a checkpoint is written. Outside
    a gpufleet job it does nothing."""
    report(checkpoint=True, **values)
