"""The output quota's arithmetic (gpufleet.domain.quota): what an attempt may store, where
a cut begins, and when a cut ends."""

from __future__ import annotations

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
    assert got.account == Account(counted=6 * KIB, dropped=3 * KIB + 100, cut=True)
    assert got.marker == got.lines[3][1]
    assert "output rate of 1 KiB/s (beyond a 8 KiB burst)" in got.marker


def test_progress_records_pass_a_cut_and_are_not_counted() -> None:
    cut = Account(counted=8 * KIB, cut=True)
    got = admit([("progress", "{}"), line(100)], cut, QUOTA, 0)
    assert got.lines == [("progress", "{}")]
    assert got.marker is None  # the cut goes on: no second marker
    assert got.account == Account(counted=8 * KIB, dropped=100, cut=True)


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
