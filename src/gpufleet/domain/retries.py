"""When a failed attempt is tried again: the exit codes that say the command itself is
wrong (never retried unless the job says so), a job's own lists of them, and the backoff
between attempts."""

from __future__ import annotations

from collections.abc import Collection, Sequence

#: Exit codes a failed attempt is not retried after unless its job names them in
#: ``retry_on``: each says the command itself is wrong, so running it again fails the
#: same way (docs/jobs.md, "Retries").
NOT_RETRIED: dict[int, str] = {
    2: "a usage error: the command line was refused (argparse, click and typer exit 2)",
    126: "the command could not be executed",
    127: "the command was not found",
}


#: The most exit codes one of a job's lists names.
MOST_EXIT_CODES = 64


def exit_codes_problem(retry_on: Sequence[int], no_retry_on: Sequence[int]) -> str | None:
    """What is wrong with a job's ``retry_on`` and ``no_retry_on``, or None: each names
    failing exit codes (1 to 255, or -1 to -64: killed by that signal), at most
    ``MOST_EXIT_CODES``, and no code is in both."""
    for name, codes in (("retry_on", retry_on), ("no_retry_on", no_retry_on)):
        if len(codes) > MOST_EXIT_CODES:
            return f"{name} names {len(codes)} exit codes; at most {MOST_EXIT_CODES}"
        for code in codes:
            if isinstance(code, bool) or not isinstance(code, int) or not _failing(code):
                return (
                    f"{name}: {code!r} is not a failing exit code "
                    "(1 to 255, or -1 to -64 for a process killed by that signal)"
                )
    both = sorted(set(retry_on) & set(no_retry_on))
    if both:
        return f"exit code {', '.join(map(str, both))} is in both retry_on and no_retry_on"
    return None


def _failing(code: int) -> bool:
    return 1 <= code <= 255 or -64 <= code <= -1


def not_retried(
    exit_code: int | None, retry_on: Collection[int] = (), no_retry_on: Collection[int] = ()
) -> str | None:
    """Why an attempt that failed with ``exit_code`` is not tried again, whatever attempts
    are left (to follow "exit code N, "); None when it may be. A job's ``no_retry_on``
    wins over its ``retry_on``."""
    if exit_code is None:  # it did not start, timed out or was lost: worth another try
        return None
    if exit_code in no_retry_on:
        return "never retried (the job's no_retry_on names it)"
    if exit_code in NOT_RETRIED and exit_code not in retry_on:
        return f"not retried by default ({NOT_RETRIED[exit_code]}; retry_on retries it)"
    return None


def backoff_seconds(attempts_used: int, base: float, cap: float = 600.0) -> float:
    """Exponential backoff before the next attempt: base, 2*base, 4*base ... up to cap."""
    if attempts_used <= 0 or base <= 0:
        return 0.0
    return float(min(cap, base * (2 ** (attempts_used - 1))))
