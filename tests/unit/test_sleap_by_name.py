"""``--model job:NAME``'s choice among jobs of one name, an inference package's track
lines, and the line that says why a sleap-nn run failed."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpufleet.client.sleap import choose_trained
from gpufleet.domain import sleap
from gpufleet.errors import GpufleetError, PackageError
from gpufleet.wire import JobOut


def job(n: int, status: str, pool: str = "default", name: str = "run") -> JobOut:
    return JobOut(
        id=f"j-{n}", name=name, status=status, pool=pool, attempts=1, max_attempts=3,
        priority=0, worker=None, worker_id=None, gpus=[],
        created_at=datetime(2026, 11, n, 12, 0, tzinfo=UTC), started_at=None,
        finished_at=None, exit_code=None, error=None,
    )  # fmt: skip


def test_the_newest_succeeded_is_taken_over_newer_failures_and_older_successes() -> None:
    named = [job(1, "succeeded"), job(2, "succeeded"), job(3, "failed"), job(4, "running")]
    assert choose_trained("run", named, None) == named[1]
    assert choose_trained("run", [job(5, "pending")], None) == job(5, "pending")
    assert choose_trained("run", [job(1, "succeeded", name="run2")], None) is None


@pytest.mark.parametrize(
    ("named", "said"),
    [
        ([job(1, "pending"), job(2, "running")], "none has succeeded and 2 have not ended"),
        ([job(1, "failed"), job(2, "cancelled")], "every job of that name failed"),
        ([job(1, "succeeded", "a"), job(2, "succeeded", "b")], "in pools a, b; give --pool"),
    ],
)
def test_an_ambiguous_name_lists_the_candidates_with_ids_and_dates(
    named: list[JobOut], said: str
) -> None:
    with pytest.raises(GpufleetError) as raised:
        choose_trained("run", named, None)
    assert said in str(raised.value)
    assert "j-2" in str(raised.value) and "2026-11-02 12:00:00" in str(raised.value)


def test_a_pool_chooses_among_pools() -> None:
    named = [job(1, "succeeded", "a"), job(2, "succeeded", "b")]
    assert choose_trained("run", named, "a") == named[0]


def test_track_lines_keep_their_options_and_drop_what_gpufleet_sets() -> None:
    (line,) = sleap.parse_track_script(
        "#!/bin/bash\nsleap-nn track --data_path /x/l.slp --only_suggested_frames "
        "--model_paths models/a -m=models/b -o l.slp.predictions.slp --batch_size 4 --gui\n",
        "inference-script.sh",
    )
    assert (line.data, line.models, line.output) == (
        "/x/l.slp", ("models/a", "models/b"), "l.slp.predictions.slp"
    )  # fmt: skip
    assert line.args == ("--only_suggested_frames", "--batch_size", "4")
    (old,) = sleap.parse_track_script("sleap track video.mp4 -m models/a\n", "s")
    assert old.data == "video.mp4" and old.models == ("models/a",)
    with pytest.raises(PackageError, match="s, line 1: && makes it more than one command"):
        sleap.parse_track_script("sleap-nn track --data_path a && rm -rf x\n", "s")


def test_the_error_line_is_the_last_exception_else_the_last_line() -> None:
    tail = ["Traceback (most recent call last):", '  File "x.py"', "ValueError: bad sigma", ""]
    assert sleap.error_line(tail) == "ValueError: bad sigma"
    logged = ["2026 | ERROR    | sleap_nn:train - no labels", "exiting"]
    assert sleap.error_line(logged) == logged[0]
    assert sleap.error_line(["killed"]) == "killed"
    assert sleap.error_line([]) is None
