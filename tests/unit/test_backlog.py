"""A job's unsent output: bounded in memory, spilled to disk, oldest dropped past the
disk bound with a marker where the gap is, and nothing lost or sent twice otherwise."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.wire import JobSpecModel, Lease
from gpufleet.worker.adapters import Adapter
from gpufleet.worker.backlog import LINE_OVERHEAD, Backlog
from gpufleet.worker.running import Running
from gpufleet.worker.uploads import MAX_BATCH, MAX_BATCH_CHARS


def drain(backlog: Backlog, lines: int = 1000, chars: int = 1 << 20) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for _ in range(100_000):
        batch = backlog.peek(lines, chars)
        if not batch:
            return out
        out.extend(batch)
        backlog.sent()
    raise AssertionError("the backlog never emptied")


def test_lines_spill_to_disk_past_the_memory_bound_and_come_back_in_order(
    tmp_path: Path,
) -> None:
    backlog = Backlog(tmp_path / "spill", memory=10_000, disk=1 << 20)
    lines = [("stdout" if n % 3 else "stderr", f"line {n} " + "x" * 50) for n in range(2000)]
    for stream, line in lines:
        backlog.add(stream, line)
        assert backlog.memory_bytes <= 10_000
    assert list((tmp_path / "spill").iterdir())  # on disk
    assert len(backlog) == 2000
    assert drain(backlog, lines=77) == lines
    assert len(backlog) == 0 and not list((tmp_path / "spill").iterdir())


def test_a_batch_that_failed_to_send_is_sent_again_not_lost(tmp_path: Path) -> None:
    backlog = Backlog(tmp_path / "spill", memory=2_000)
    for n in range(100):
        backlog.add("stdout", f"{n}")
    first = backlog.peek(10, 1 << 20)
    for n in range(100, 400):  # the job goes on printing while the upload fails...
        backlog.add("stdout", f"{n}")
    assert backlog.peek(10, 1 << 20) == first  # ...and the retry sends the same batch
    backlog.sent()
    assert [int(line) for _, line in first + drain(backlog)] == list(range(400))


def test_past_the_disk_bound_the_oldest_lines_go_and_a_marker_says_how_many(
    tmp_path: Path,
) -> None:
    backlog = Backlog(tmp_path / "spill", memory=4_096, disk=64 * 1024, segments=4)
    for n in range(20_000):
        backlog.add("stdout", f"{n:06d} " + "y" * 93)
    spilled = sum(p.stat().st_size for p in (tmp_path / "spill").iterdir())
    assert spilled <= 64 * 1024 + 16 * 1024  # the bound, and at most one segment's slack
    out = drain(backlog)
    marker, kept = out[0], out[1:]
    numbers = [int(line.split()[0]) for _, line in kept]
    dropped = 20_000 - len(kept)
    assert dropped > 15_000 and numbers == list(range(dropped, 20_000))  # the newest kept
    assert marker[0] == "stderr" and marker[1].startswith(f"[gpufleet] {dropped} line(s)")
    assert "could not be reached" in marker[1] and "64.0 KiB" in marker[1]


def test_batches_stay_under_the_servers_body_limit(tmp_path: Path) -> None:
    backlog = Backlog(tmp_path / "spill", memory=1 << 30)
    for _ in range(5):
        backlog.add("stdout", "x" * 1_000_000)
    batch = backlog.peek(MAX_BATCH, MAX_BATCH_CHARS)
    assert len(batch) == 2  # 2M characters, no more
    backlog.sent()
    many = Backlog(tmp_path / "spill2", memory=1 << 30)
    for _ in range(MAX_BATCH + 7):
        many.add("stdout", "y")
    assert len(many.peek(MAX_BATCH, MAX_BATCH_CHARS)) == MAX_BATCH


def test_short_lines_are_bounded_by_count_as_well_as_characters(tmp_path: Path) -> None:
    backlog = Backlog(tmp_path / "spill", memory=100 * LINE_OVERHEAD)
    for _ in range(1000):
        backlog.add("stdout", "")
    assert backlog.memory_bytes <= 100 * LINE_OVERHEAD
    assert len(drain(backlog)) == 1000


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.text(max_size=300)),
            st.tuples(st.just("send"), st.integers(1, 50)),
            st.tuples(st.just("fail"), st.integers(1, 50)),
        ),
        max_size=300,
    )
)
def test_with_room_enough_every_line_arrives_once_in_order(
    ops: list[tuple[str, object]],
) -> None:
    """Whatever the interleaving of lines, sends and failed sends."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        backlog = Backlog(Path(tmp) / "spill", memory=2_000, disk=1 << 30, segments=64)
        added: list[str] = []
        arrived: list[str] = []
        for op, arg in ops:
            if op == "add":
                assert isinstance(arg, str)
                added.append(arg)
                backlog.add("stdout", arg)
            else:
                assert isinstance(arg, int)
                batch = backlog.peek(arg, 4_000)
                if op == "send":
                    arrived.extend(line for _, line in batch)
                    backlog.sent()
        arrived.extend(line for _, line in drain(backlog))
        assert arrived == added


def test_a_bars_unsent_states_are_replaced_by_its_latest(tmp_path: Path) -> None:
    backlog = Backlog(tmp_path / "spill")
    backlog.add("stdout", "epoch 1")
    backlog.update("stderr", " 10%\r")
    backlog.update("stderr", " 20%\r")  # the 10% state was not sent: replaced
    assert backlog.peek(100, 1000) == [("stdout", "epoch 1"), ("stderr", " 20%\r")]
    backlog.update("stderr", " 30%\r")  # the batch in flight keeps its 20%
    backlog.sent()
    backlog.update("stdout", "s 1\r")  # another stream's bar is a line of its own
    backlog.add("stderr", "100%")
    assert drain(backlog) == [("stderr", " 30%\r"), ("stdout", "s 1\r"), ("stderr", "100%")]
    assert backlog.memory_bytes == 0


class _TakesPercent(Adapter):
    """A job type's adapter that reads "NN%" lines as its progress."""

    def __init__(self) -> None:
        self.records: list[str] = []

    def line(self, stream: str, line: str) -> bool:
        if line.endswith("%"):
            self.records.append(line)
            return True
        return False


def test_a_bars_state_its_adapter_takes_is_progress_not_output(tmp_path: Path) -> None:
    adapter = _TakesPercent()
    lease = Lease(
        job_id="j-1",
        attempt=1,
        spec=JobSpecModel(name="j", command=["x"]),
        gpus=[],
        lease_timeout=30,
    )
    run = Running(lease, Backlog(tmp_path / "spill"), adapter=adapter)
    run.on_bar("stdout", "frames 40%")  # the adapter's: a record, never a stored state
    run.on_bar("stdout", '::gpufleet::{"ep')  # a mark not finished: waits for its end
    run.on_bar("stdout", "loading 3/9")  # an ordinary bar: output
    assert adapter.records == ["frames 40%"]
    assert drain(run.backlog) == [("stdout", "loading 3/9\r")]
