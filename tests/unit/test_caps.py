"""``domain/caps.py``: what users and pools hold against their caps, the words that say
which cap holds a job back and who holds it, and a job's run under its pool's max_run."""

from __future__ import annotations

import pytest

from gpufleet.domain import caps
from gpufleet.domain.caps import POOLS, USERS, Ask, Held, Recheck
from gpufleet.domain.sharing import Share, Sharing, parse
from gpufleet.errors import ConfigError

RULES = Sharing(
    users={"alice": Share(max_gpus=4, max_cpu_slots=2), "bob": Share(weight=2)},
    pools={"default": Share(max_gpus=8), "short": Share(max_run=3600.0)},
)


def test_tally_counts_each_job_for_its_user_in_every_pool_and_for_its_pool() -> None:
    held = caps.tally(
        [("alice", "default", 2, 1), ("alice", "gpu", 1, 2), ("bob", "default", 0, 3)]
    )
    assert held[(USERS, "alice")] == Held(gpus=4, cpu_slots=0)
    assert held[(USERS, "bob")] == Held(gpus=0, cpu_slots=3)
    assert held[(POOLS, "default")] == Held(gpus=2, cpu_slots=3)
    assert held[(POOLS, "gpu")] == Held(gpus=2)


def test_any_caps_and_holders_name_only_capped_users_and_pools() -> None:
    assert caps.any_caps(RULES)
    assert not caps.any_caps(Sharing(users={"bob": Share(weight=2)}))
    assert not caps.any_caps(Sharing(pools={"short": Share(max_run=60.0)}))
    assert caps.holders(RULES, "alice", "default") == [(USERS, "alice"), (POOLS, "default")]
    assert caps.holders(RULES, "bob", "short") == []
    assert caps.capped_holders(RULES) == (["alice"], ["default"])


@pytest.mark.parametrize(
    ("held", "gpus", "expected"),
    [
        ({}, 4, None),
        ({(USERS, "alice"): Held(gpus=3)}, 1, None),
        (
            {(USERS, "alice"): Held(gpus=4)},
            1,
            "alice holds 4 of their 4 GPUs (cap users.alice.max_gpus)",
        ),
        (
            {(USERS, "alice"): Held(gpus=3)},
            2,
            "alice holds 3 of their 4 GPUs and the job needs 2 (cap users.alice.max_gpus)",
        ),
        ({}, 5, "the job needs 5 GPUs, over the cap of 4 on alice (cap users.alice.max_gpus)"),
        (
            {(USERS, "alice"): Held(gpus=1), (POOLS, "default"): Held(gpus=8)},
            1,
            "pool default holds 8 of its 8 GPUs (cap pools.default.max_gpus)",
        ),
        (
            {(USERS, "alice"): Held(gpus=4, cpu_slots=2)},
            0,
            "alice holds 2 of their 2 CPU slots (cap users.alice.max_cpu_slots)",
        ),
        ({(USERS, "alice"): Held(gpus=4, cpu_slots=1)}, 0, None),
    ],
)
def test_refusal_names_the_cap_and_who_holds_it(
    held: dict[caps.Holder, Held], gpus: int, expected: str | None
) -> None:
    """GPUs count against max_gpus, a CPU job's slot against max_cpu_slots; the user's
    cap is checked before the pool's, and the first one passed is named."""
    assert caps.refusal(RULES, Ask("j", "alice", "default", gpus), held) == expected


def test_a_cap_of_zero_and_of_one_read_well() -> None:
    rules = Sharing(users={"carol": Share(max_gpus=1, max_cpu_slots=0)})
    held = {(USERS, "carol"): Held(gpus=1)}
    assert caps.refusal(rules, Ask("j", "carol", "p", 1), held) == (
        "carol holds 1 of their 1 GPU (cap users.carol.max_gpus)"
    )
    assert caps.refusal(rules, Ask("j", "carol", "p", 0), held) == (
        "the job needs 1 CPU slot, over the cap of 0 on carol (cap users.carol.max_cpu_slots)"
    )


def test_a_name_that_is_no_bare_key_is_quoted_as_toml_would() -> None:
    assert caps.cap_key((USERS, "a.b"), "max_gpus") == 'users."a.b".max_gpus'
    assert caps.cap_key((POOLS, "lab-1_x"), "max_gpus") == "pools.lab-1_x.max_gpus"


def test_uncapped_holders_never_refuse() -> None:
    held = {(USERS, "bob"): Held(gpus=100), (POOLS, "short"): Held(gpus=100)}
    assert caps.refusal(RULES, Ask("j", "bob", "short", 8), held) is None


def test_recheck_locks_the_capped_holders_in_order_and_keeps_the_claims_under_caps() -> None:
    asks = {
        "a1": Ask("a1", "alice", "default", 2),
        "a2": Ask("a2", "alice", "default", 1),
        "b1": Ask("b1", "bob", "short", 4),
    }
    check = Recheck(RULES, asks)
    assert check.holders() == [(POOLS, "default"), (USERS, "alice")]
    held = {(USERS, "alice"): Held(gpus=3)}
    # Each alone: a claim takes one of them. Jobs no cap counts are always kept.
    assert check.allowed(["a1", "a2", "b1", "other"], held) == ["a2", "b1", "other"]


def test_caps_read_from_a_sharing_file() -> None:
    rules = parse(
        {"users": {"alice": {"max_gpus": 2}}, "pools": {"default": {"max_cpu_slots": 1}}},
        "sharing.toml",
    )
    assert caps.capped_holders(rules) == (["alice"], ["default"])
    assert not rules.fair_share  # caps alone do not turn fair share on


@pytest.mark.parametrize(
    ("own", "expected"),
    [(None, (3600.0, True)), (7200.0, (3600.0, True)), (60.0, (60.0, False))],
)
def test_run_limit_is_the_shorter_of_the_jobs_timeout_and_its_pools_max_run(
    own: float | None, expected: tuple[float, bool]
) -> None:
    assert caps.run_limit(RULES, "short", own) == expected
    assert caps.run_limit(RULES, "default", own) == (own, False)


def test_timed_out_text_names_the_pools_limit() -> None:
    assert caps.timed_out_text(30, None) == "timed out after 30s"
    assert caps.timed_out_text(3600, "short") == (
        "timed out after 3600s, the longest a job of pool short may run (pools.short.max_run)"
    )


@pytest.mark.parametrize("max_run", [0, "0s", "0.5s", 20_000_000])
def test_a_max_run_under_a_second_or_past_a_jobs_longest_timeout_is_refused(
    max_run: object,
) -> None:
    # max_run = 0 would be every attempt's timeout: each job of the pool killed at once
    with pytest.raises(ConfigError, match=r"sharing.toml: pools.short.max_run"):
        parse({"pools": {"short": {"max_run": max_run}}}, "sharing.toml")


def test_without_counts_a_leaving_job_for_its_user_and_its_pool_no_more() -> None:
    held = caps.tally([("alice", "default", 2, 2), ("bob", "default", 0, 1)])
    after = caps.without(held, "alice", "default", 2)
    assert after[(USERS, "alice")] == Held(gpus=2)
    assert after[(POOLS, "default")] == Held(gpus=2, cpu_slots=1)
    assert caps.without(after, "bob", "default", 0)[(USERS, "bob")] == Held()
    assert held[(USERS, "alice")] == Held(gpus=4), "what was held is left as it was"


def test_a_users_weight_turns_fair_share_on_and_a_pools_does_not() -> None:
    # as the docs and parse() say: a pool's weight ranks nothing (a claim sees one pool)
    assert parse({"users": {"alice": {"weight": 2}}}, "sharing.toml").fair_share
    assert not parse({"pools": {"default": {"weight": 2}}}, "sharing.toml").fair_share
