"""The output quota's arithmetic (gpufleet.domain.quota): what an attempt may store, where
a cut begins, and when a cut ends."""

from __future__ import annotations

import json

from gpufleet.domain.quota import (
    MARKER,
    ROW_BYTES,
    Account,
    OutputQuota,
    admit,
    line_cost,
    size_text,
)

KIB = 1024
QUOTA = OutputQuota(total=64 * KIB, rate=KIB, burst=8 * KIB)


def line(n: int) -> tuple[str, str]:
    """A stdout line that costs ``n`` bytes of the quota (``n`` > ROW_BYTES)."""
    assert n > ROW_BYTES
    return ("stdout", "x" * (n - 1 - ROW_BYTES))


def test_the_allowance_is_the_burst_plus_the_rate_since_the_claim_up_to_the_total() -> None:
    assert QUOTA.allowance(0) == 8 * KIB
    assert QUOTA.allowance(10) == 18 * KIB
    assert QUOTA.allowance(-5) == 8 * KIB  # a clock behind the claim gives no more
    assert QUOTA.allowance(3600) == 64 * KIB


def test_a_line_costs_its_bytes_a_newline_and_its_row() -> None:
    assert line_cost("") == 1 + ROW_BYTES  # a flood of empty lines is not free
    assert line_cost("é") == 2 + 1 + ROW_BYTES


def test_output_is_stored_until_a_line_does_not_fit_then_one_marker_and_nothing() -> None:
    lines = [line(3 * KIB), line(3 * KIB), ("progress", '{"step":1}'), line(3 * KIB), line(100)]
    got = admit(lines, Account(), QUOTA, 0)
    assert got.lines[:3] == lines[:3]
    assert got.lines[3][0] == "stderr" and got.lines[3][1].startswith(MARKER)
    assert got.lines[4:] == []
    progress = line_cost('{"step":1}')  # counted too: it fit
    assert got.account == Account(counted=6 * KIB + progress, dropped=3 * KIB + 100, cut=True)
    assert got.marker == got.lines[3][1]
    assert "output rate of 1 KiB/s (beyond a 8 KiB burst)" in got.marker


def test_progress_records_are_counted_and_cut_like_output() -> None:
    """A job's progress records are its own writing: a job printing nothing but progress
    must not get around its quota (the review stored 2.6 MB of them past a 16 KiB one)."""
    cut = Account(counted=8 * KIB, cut=True)
    got = admit([("progress", "{}"), line(100)], cut, QUOTA, 0)
    assert got.lines == []
    assert got.marker is None  # the cut goes on: no second marker
    assert got.account == Account(counted=8 * KIB, dropped=line_cost("{}") + 100, cut=True)
    flood = [("progress", json.dumps({"step": i})) for i in range(1000)]
    got = admit(flood, Account(), QUOTA, 0)
    assert got.marker is not None and got.account.counted <= QUOTA.allowance(0)


def test_a_rate_cut_ends_once_half_the_burst_is_back_and_the_next_is_marked_again() -> None:
    cut = Account(counted=8 * KIB, dropped=5, cut=True)
    assert admit([line(100)], cut, QUOTA, 3).account.cut  # 3 KiB back: still cut
    resumed = admit([line(100)], cut, QUOTA, 4)  # 4 KiB, half the burst
    assert resumed.lines == [line(100)] and resumed.marker is None
    assert resumed.account == Account(counted=8 * KIB + 100, dropped=5, cut=False)
    again = admit([line(5 * KIB)], resumed.account, QUOTA, 4)
    assert again.marker is not None and again.account.cut


def test_past_the_total_the_cut_never_ends_and_the_marker_says_the_quota() -> None:
    full = admit([line(64 * KIB), line(100)], Account(), QUOTA, 3600)
    assert full.marker is not None
    assert "passed its output quota of 64 KiB; the rest of its output is dropped" in full.marker
    assert admit([line(100)], full.account, QUOTA, 10**6).lines == []


def test_sizes_read_as_an_operator_writes_them() -> None:
    assert [size_text(n) for n in (0, 1023, 1536, 64 << 20, 1 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "64 MiB",
        "1 GiB",
    ]
