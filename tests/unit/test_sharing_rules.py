"""Hostile values in the sharing file: refused with the key named, never kept to break
claims or webhooks later."""

from __future__ import annotations

import pytest

from gpufleet.domain import caps
from gpufleet.domain.limits import MAX_TIMEOUT
from gpufleet.domain.sharing import parse
from gpufleet.errors import ConfigError
from gpufleet.wire import JobSpecModel


@pytest.mark.parametrize("max_run", [0, "0s", MAX_TIMEOUT + 1, "200d"])
def test_a_pools_max_run_of_zero_or_past_a_timeouts_limit_is_refused(max_run: object) -> None:
    # It becomes a job's timeout in its lease: 0 or past the limit is a lease every
    # worker refuses to read (its claim loop ends), so the file is refused instead.
    with pytest.raises(ConfigError, match=r"pools\.gpu\.max_run: must be above 0"):
        parse({"pools": {"gpu": {"max_run": max_run}}}, "sharing.toml")


def test_the_longest_max_run_allowed_makes_a_timeout_a_worker_reads() -> None:
    rules = parse({"pools": {"gpu": {"max_run": MAX_TIMEOUT}}}, "sharing.toml")
    timeout, by_pool = caps.run_limit(rules, "gpu", None)
    assert by_pool
    JobSpecModel.model_validate({"name": "j", "command": ["true"], "timeout": timeout})


@pytest.mark.parametrize("entry", ["not a host!", "10.0.0.0/33", "a..b"])
def test_a_webhook_allow_entry_that_is_no_host_or_network_is_refused(entry: str) -> None:
    # Kept, it made every webhook's creation (and delivery) fail with a 500 later.
    with pytest.raises(ConfigError, match=r"webhooks\.allow: .* is not a host name"):
        parse({"webhooks": {"allow": [entry]}}, "sharing.toml")
